"""The OpenAI fields of the HTTP API (openai_api.py) with the `openai`
package against a real front end over an in-process 2-stage pipeline: echo and prompt
logprobs as lm-evaluation-harness's `local-completions` asks for them, top logprobs,
penalties and logit_bias, n and several prompts, and every refused field. Values are
compared with one-device mlx-lm (tests/reference.py)."""

import json
import re
from itertools import accumulate
import urllib.request
from types import SimpleNamespace

import mlx.core as mx
import openai
import pytest
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_tokenizer

from conftest import ROOT, free_port_range
from distributed.runtime.scheduler import Scheduler
from distributed.runtime.speculation import PromptLookupDrafter
from distributed.serving.http_api import start_http_server
from distributed.serving.openai_api import NEUTRAL, REFUSED, fields
from distributed.serving.options import ServeOptions
from distributed.serving.chat_format import ModelInfo
from distributed.shard.config import read_config
from grpc_server import Server
from reference import PROMPT, mlx_lm_greedy, mlx_lm_logprobs
from stages import in_process_pipeline

HI = [{"role": "user", "content": "hi"}]
TOL = 1e-4


@pytest.fixture(scope="module")
def served(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (4, 4))
    tokenizer = load_tokenizer(hf_checkpoint, eos_token_ids=read_config(hf_checkpoint)["eos_token_id"])
    scheduler = Scheduler(pipeline, tokenizer, max_queue=16, prefill_step_size=16, prefix_cache_bytes=2**24).start()
    front = start_http_server(ServeOptions(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0"))
    info = ModelInfo("tiny", 259, 1024, 1000)
    front.attach(scheduler, tokenizer, info)
    front.requests.metrics.attach(scheduler, info)  # as the command line does
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{front.port}/v1", api_key="none", max_retries=0, timeout=60)
    yield SimpleNamespace(front=front, tokenizer=tokenizer, client=client, path=hf_checkpoint, scheduler=scheduler)
    front.stop()
    scheduler.close()


def close(a, b):
    return len(a) == len(b) and all(abs(x - y) < TOL for x, y in zip(a, b))


def token(served, t):
    return served.tokenizer.decode([t])


# ---------------------------------------------------------------- echo and prompt logprobs


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_score_the_prompt_as_lm_eval_asks(served, max_tokens):
    """lm-eval's local-completions: token-id prompts in a batch, echo, logprobs 1, temperature 0;
    it sums token_logprobs[ctxlen:-1] and checks each against max(top_logprobs)."""
    prompts = [PROMPT, PROMPT[5:30]]
    out = served.client.completions.create(model="tiny", prompt=prompts, max_tokens=max_tokens, echo=True,
                                           logprobs=1, temperature=0, seed=1234)
    assert [c.index for c in out.choices] == [0, 1]
    for prompt, choice in zip(prompts, out.choices):
        lp = choice.logprobs
        ref = mlx_lm_logprobs(served.path, prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert close(lp.token_logprobs[1:len(prompt)], [ref[i - 1, t].item() for i, t in enumerate(prompt) if i])
        assert lp.tokens[:len(prompt)] == [token(served, t) for t in prompt]
        for i in range(1, len(prompt)):
            top, best = lp.top_logprobs[i], mx.argmax(ref[i - 1]).item()
            assert token(served, best) in top and len(top) <= 2
            if "\ufffd" not in (lp.tokens[i], token(served, best)):  # bytes of a longer character share a string
                assert abs(top[token(served, best)] - ref[i - 1, best].item()) < TOL
                assert top[lp.tokens[i]] == lp.token_logprobs[i]
        assert len(lp.tokens) == len(prompt) + max_tokens == len(lp.text_offset)
        assert choice.text.startswith(served.tokenizer.decode(prompt))
        assert lp.text_offset == list(accumulate(len(t) for t in [""] + lp.tokens[:-1]))  # as vLLM counts them
        if max_tokens:
            assert lp.tokens[-1] == token(served, mlx_lm_greedy(served.path, prompt, 1, 16)[0][0])
        assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == sum(map(len, prompts)) and out.usage.completion_tokens == 2 * max_tokens


def test_echo_streamed_and_without_logprobs(served):
    chunks = list(served.client.completions.create(model="tiny", prompt="Hello there", max_tokens=3, echo=True,
                                                   logprobs=2, temperature=0, stream=True))
    assert chunks[0].choices[0].text == "Hello there"
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None and "".join(first.tokens) == "Hello there"
    assert all("Hello there"[o:].startswith(t) for o, t in zip(first.text_offset, first.tokens))
    whole = served.client.completions.create(model="tiny", prompt="Hello there", max_tokens=3, echo=True, logprobs=2,
                                             temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and close(streamed[1:], whole.choices[0].logprobs.token_logprobs[1:])
    plain = served.client.completions.create(model="tiny", prompt="Hello there", max_tokens=3, echo=True, temperature=0)
    assert plain.choices[0].text == whole.choices[0].text and plain.choices[0].logprobs is None
    empty = served.client.completions.create(model="tiny", prompt="Hello", max_tokens=0, echo=True)
    assert empty.choices[0].text == "Hello" and empty.usage.completion_tokens == 0


def test_echo_logprobs_over_a_real_two_rank_ring(hf_checkpoint):
    """run_trinity.py --serve --http under mlx.launch -n 2: the prompt's hidden states cross processes."""
    port = free_port_range(1)
    server = Server(hf_checkpoint, 2, ["--http", f"127.0.0.1:{port}"])
    try:
        server.wait_serving()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=2, timeout=60)
        out = client.completions.create(model=str(hf_checkpoint), prompt=[PROMPT], max_tokens=1, echo=True, logprobs=1,
                                        temperature=0)
    finally:
        server.stop()
    ref = mlx_lm_logprobs(hf_checkpoint, PROMPT)
    lp = out.choices[0].logprobs.token_logprobs
    assert lp[0] is None and close(lp[1:len(PROMPT)], [ref[i - 1, t].item() for i, t in enumerate(PROMPT) if i])


# ---------------------------------------------------------------- top logprobs


def test_top_logprobs_in_chat_and_completions(served):
    messages_ids = served.tokenizer.apply_chat_template(HI, add_generation_prompt=True)
    out = served.client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=20)
    content = out.choices[0].logprobs.content
    generated = []
    for item in content:
        ref = mlx_lm_logprobs(served.path, messages_ids + generated)[-1]
        order = mx.argsort(-ref)[:20].tolist()
        assert [t.token for t in item.top_logprobs] == [token(served, t) for t in order]
        assert close([t.logprob for t in item.top_logprobs], [ref[t].item() for t in order])
        assert item.top_logprobs[0].token == item.token and item.bytes == list(item.token.encode())
        generated.append(order[0])
    chunks = list(served.client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=0,
                                                        logprobs=True, top_logprobs=20, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.model_dump() for x in streamed] == [x.model_dump() for x in content]
    assert all(x.top_logprobs == [] for x in served.client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=3, logprobs=True).choices[0].logprobs.content)
    out = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=5)
    generated = mlx_lm_greedy(served.path, PROMPT, 4, 16)[0]
    for i, top in enumerate(out.choices[0].logprobs.top_logprobs):
        row = mlx_lm_logprobs(served.path, PROMPT + generated[:i])[-1]
        assert set(top) == {token(served, t) for t in mx.argsort(-row)[:5].tolist()}


# ---------------------------------------------------------------- penalties and logit_bias


PENALTIES = [dict(presence_penalty=1.5), dict(frequency_penalty=2.0), dict(extra_body={"repetition_penalty": 1.5}),
             dict(logit_bias={"40": 100, "41": 100}),
             dict(presence_penalty=0.4, frequency_penalty=0.9, logit_bias={"5": -100},
                  extra_body={"repetition_penalty": 1.2, "repetition_context_size": 30})]


@pytest.mark.parametrize("fields", PENALTIES, ids=["presence", "frequency", "repetition", "logit_bias", "all"])
def test_penalties_equal_mlx_lm_generate(served, fields):
    p = {**fields, **fields.get("extra_body", {})}
    bias = {int(k): v for k, v in p.get("logit_bias", {}).items()} or None
    processors = make_logits_processors(bias, p.get("repetition_penalty"), p.get("repetition_context_size", 20),
                                        p.get("presence_penalty"), 20, p.get("frequency_penalty"), 20)
    ref, _ = mlx_lm_greedy(served.path, PROMPT, 30, 16, logits_processors=processors)
    assert ref != mlx_lm_greedy(served.path, PROMPT, 30, 16)[0], "the penalty changes nothing here"
    for stream in (False, True):
        out = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, logprobs=0,
                                               stream=stream, **fields)
        choices = [c.choices[0] for c in out] if stream else out.choices
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
        assert tokens == [token(served, t) for t in ref]


# ---------------------------------------------------------------- n and several prompts


def test_n_choices(served):
    out = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, n=3, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2] and len({c.text for c in out.choices}) == 3
    alone = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, seed=8)
    assert alone.choices[0].text == out.choices[1].text  # choice j runs with seed + j
    assert out.usage.prompt_tokens == len(PROMPT) and out.usage.completion_tokens == 36
    chunks = list(served.client.chat.completions.create(model="tiny", messages=HI, max_tokens=5, n=2, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)]
    whole = served.client.chat.completions.create(model="tiny", messages=HI, max_tokens=5, temperature=0)
    assert texts == [whole.choices[0].message.content] * 2
    assert chunks[-1].usage.completion_tokens == 2 * whole.usage.completion_tokens


def test_speculative_false_opts_a_request_out(served):
    """The `speculative` extension where the server speculates (prompt lookup): the same
    text either way, verification frames only for the request that allows them."""
    batcher = served.scheduler.batcher
    batcher.verifier.drafter = PromptLookupDrafter()
    try:
        texts, passes = [], []
        for speculative in (True, False):
            before = batcher.verifier.stats.passes
            out = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=80, temperature=0,
                                                   extra_body={"speculative": speculative})
            texts.append(out.choices[0].text)
            passes.append(batcher.verifier.stats.passes - before)
        with urllib.request.urlopen(f"http://127.0.0.1:{served.front.port}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        for name, value in batcher.verifier.stats.as_dict().items():
            assert f"trinity_speculative_{name}_total {float(value)}" in metrics, name
    finally:
        batcher.verifier.drafter = None
    assert texts[0] == texts[1] and passes[0] > 0 and passes[1] == 0, passes
    assert bad(served, True, {"speculative": "no"}).body["param"] == "speculative"


# ---------------------------------------------------------------- refused and unknown fields, model, roles


def bad(served, chat, fields, status=400):
    """The error a request with `fields` gets (non-streamed and streamed alike)."""
    errors = []
    for stream in (False, True):
        base = dict(model="tiny", max_tokens=2, stream=stream)
        base.update(dict(messages=HI) if chat else dict(prompt=PROMPT))
        create = served.client.chat.completions.create if chat else served.client.completions.create
        with pytest.raises(openai.APIStatusError) as e:
            create(**base, extra_body=fields) if not fields.keys() & base.keys() else create(**{**base, **fields})
        assert e.value.status_code == status, e.value
        errors.append(e.value)
    return errors[0]


REFUSALS = [(True, {name: "x"}, name) for name in REFUSED] + [
    (chat, {name: value}, name) for name, chat, value in [
        ("best_of", False, 2), ("suffix", False, "end"), ("response_format", False, {"type": "json_object"}),
        ("service_tier", True, 3), ("store", True, "yes"),  # hints, accepted with no effect, still typed
        ("metadata", True, "x"), ("reasoning_effort", True, 1), ("modalities", True, ["text", "audio"])]] + [
    (False, {"tools": []}, "tools"), (True, {"echo": True}, "echo"), (True, {"frobnicate": 1}, "frobnicate"),
    (True, {"stream_options": {"include_usage": True, "x": 1}}, "stream_options"),
    (True, {"top_logprobs": 2}, "top_logprobs"),
    (False, {"logprobs": 21}, "logprobs"), (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (True, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (True, {"tool_choice": "required"}, "tool_choice"), (False, {"presence_penalty": 3}, "presence_penalty"),
    (True, {"response_format": {"type": "xml"}}, "response_format.type"),
    (True, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format"),
    (True, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": 1}}},
     "response_format.json_schema.strict"),
    (False, {"logit_bias": {"999": 1}}, "logit_bias"), (False, {"logit_bias": {"a": 1}}, "logit_bias"),
    (True, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    (True, {"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
    (True, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    (True, {"messages": [{"role": "user", "content": "hi", "audio": {"id": "a"}}]}, "messages[0].audio"),
    (True, {"messages": [{"role": "assistant", "content": "a", "reasoning_content": "r"}, *HI]},
     "messages[0].reasoning_content"),  # no think tokens here
    (True, {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    (True, {"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    (False, {"chat_template_kwargs": {}}, "chat_template_kwargs"),  # completions have no template
]


@pytest.mark.parametrize("chat, fields, param", REFUSALS, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(REFUSALS)])
def test_refused_fields_are_400_naming_them(served, chat, fields, param):
    error = bad(served, chat, fields)
    assert error.body["param"] == param and error.body["message"].startswith(param), error.body
    if param == "tools":
        assert "no tool support" in error.body["message"] or not chat


def test_neutral_values_hints_and_roles_are_accepted(served):
    out = served.client.chat.completions.create(
        model="tiny", max_tokens=2, temperature=0, parallel_tool_calls=True, response_format={"type": "text"},
        service_tier="auto", store=False, metadata={}, modalities=["text"], user="u1", tool_choice="none",
        safety_identifier="s", prompt_cache_key="k",
        messages=[{"role": "developer", "content": "Be brief."}, *HI, {"role": "assistant", "content": "ok", "refusal": None}])
    system = served.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, *HI,
                                                    {"role": "assistant", "content": "ok"}], add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(system)  # "developer" reached the template as "system"
    assert served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, best_of=1, suffix="",
                                            user="u", temperature=0).usage.completion_tokens == 2


def test_stream_options_need_stream(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"


def test_unknown_model_is_404(served):
    for chat in (False, True):
        error = bad(served, chat, {"model": "gpt-4o"}, status=404)
        assert isinstance(error, openai.NotFoundError) and error.body["code"] == "model_not_found"
    request = urllib.request.Request(f"http://127.0.0.1:{served.front.port}/v1/completions",
                                     data=json.dumps({"prompt": "hi", "max_tokens": 1}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:  # no model: the one served
        assert json.loads(r.read())["model"] == "tiny"


def test_the_docs_list_every_field(served):
    """docs/serving.md's field table says what fields() does, field by field."""
    section = (ROOT / "docs/serving.md").read_text().split("## OpenAI fields")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|", section, re.M)
    words = {"implemented": "implemented", "extension": "extension", "no effect": "hint",
             "only": "neutral only", "refused": "refused", "—": None}

    def status(cell):
        return next(v for k, v in words.items() if k in cell)

    for endpoint, column in (("completions", 1), ("chat", 2)):
        table = {row[0]: status(row[column]) for row in rows if status(row[column])}
        assert table == fields(endpoint), endpoint
    assert set(NEUTRAL) | set(REFUSED) <= {row[0] for row in rows}
