"""Reasoning (think tokens) through every API, streamed and not, with each ecosystem's own
client: a real HTTP front end over an in-process 2-stage pipeline of the thinking tiny
checkpoint (tests/tool_checkpoint.py: its generation prompt opens a <think>, its greedy
answer is REASONING, </think>, ANSWER). The reply is split by chat_format.py's ReplySplitter; what a
client sends back goes into the prompt where the template renders it (<think>…</think>)."""

import json
import urllib.request
from types import SimpleNamespace

import anthropic
import grpc
import ollama
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from browser import Browser, chat as page_chat
from conftest import wait_until
from distributed.runtime.scheduler import Scheduler
from distributed.serving.grpc_client import generate as client_generate
from distributed.serving.grpc_service import start_grpc_server
from distributed.serving.http_api import start_http_server
from distributed.serving.options import ServeOptions
from distributed.serving.proto import generation_pb2 as pb
from distributed.serving.proto import generation_pb2_grpc as pb_grpc
from distributed.serving.request_log import RequestLog
from distributed.serving.chat_format import ModelInfo, ReplySplitter
from distributed.shard.config import read_config
from stages import in_process_pipeline
from tool_checkpoint import ANSWER, REASONING, make_think_checkpoint

ASK = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT, SAID = "".join(REASONING), "".join(ANSWER)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_think_checkpoint(tmp_path_factory.mktemp("think_model"))
    pipeline, _ = in_process_pipeline(path, (4, 4))
    tokenizer = load_tokenizer(path, eos_token_ids=read_config(path)["eos_token_id"])
    scheduler = Scheduler(pipeline, tokenizer).start()
    options, requests = ServeOptions(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0"), RequestLog()
    front, grpc_front = start_http_server(options, requests), start_grpc_server(options, requests)
    info = ModelInfo("think", read_config(path)["vocab_size"], 4096, 4000)
    front.attach(scheduler, tokenizer, info)
    grpc_front.attach(scheduler, tokenizer, info)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_front.port}")
    base = f"http://127.0.0.1:{front.port}"
    yield SimpleNamespace(
        base=base, tokenizer=tokenizer, front=front, scheduler=scheduler, requests=requests, grpc=pb_grpc.GenerationStub(channel),
        openai=openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60),
        anthropic=anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=60),
        ollama=ollama.Client(host=base, timeout=60))
    channel.close()
    grpc_front.stop()
    front.stop()
    scheduler.close()


def prompt_len(served, messages, **template) -> int:
    return len(served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template))


def chat(served, **kwargs):
    return served.openai.chat.completions.create(**{"model": "think", "messages": ASK, "temperature": 0,
                                                    "max_tokens": 16, **kwargs})


def test_the_checkpoint_thinks_as_built(served):
    """The tokenizer has think tokens, the prompt ends inside an open think, and the raw tokens
    are the chain, whose text the splitter divides into exactly REASONING and ANSWER."""
    tk = served.tokenizer
    assert tk.has_thinking and (tk.think_start, tk.think_end) == ("<think>", "</think>")
    prompt = tk.apply_chat_template(ASK, add_generation_prompt=True)
    out = served.openai.completions.create(model="think", prompt=prompt, temperature=0, max_tokens=16, logprobs=0)
    raw = out.choices[0].text  # completions do not split: the generated text as it is
    assert raw == THOUGHT + "</think>" + SAID
    splitter = ReplySplitter(tk, None, prompt)
    pieces = [splitter.feed(t) for t in out.choices[0].logprobs.tokens] + [splitter.finish()]
    assert ("".join(p.reasoning for p in pieces), "".join(p.content for p in pieces)) == (THOUGHT, SAID)


def test_chat_reasoning_content_whole_and_streamed(served):
    out = chat(served)
    message = out.choices[0].message
    assert (message.reasoning_content, message.content, out.choices[0].finish_reason) == (THOUGHT, SAID, "stop")
    details = out.usage.completion_tokens_details
    assert details.reasoning_tokens == len(REASONING) + 1 and out.usage.completion_tokens == 5  # </think> is reasoning's

    chunks = list(chat(served, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    assert reasoning == REASONING  # one delta per token, as they come
    assert "".join(d.content or "" for d in deltas) == SAID
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 3


def test_max_tokens_counts_reasoning_too(served):
    out = chat(served, max_tokens=2)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "length" and message.reasoning_content == THOUGHT and not message.content
    assert out.usage.completion_tokens == 2 == out.usage.completion_tokens_details.reasoning_tokens


def test_chat_history_reasoning_goes_back_into_the_prompt(served):
    first = chat(served).choices[0].message
    history = [*ASK, first.model_dump(exclude_none=True), {"role": "user", "content": "And tomorrow?"}]
    out = chat(served, messages=history)
    rendered = served.tokenizer.apply_chat_template(
        [*ASK, {"role": "assistant", "content": SAID, "reasoning_content": THOUGHT}, history[-1]],
        add_generation_prompt=True, tokenize=False)
    assert f"<think>\n{THOUGHT}\n</think>\n{SAID}" in rendered
    assert out.usage.prompt_tokens == len(served.tokenizer.encode(rendered, add_special_tokens=False))


def test_chat_template_kwargs_reach_the_template(served):
    """enable_thinking false: the generation prompt opens no think, so nothing is reasoning."""
    out = chat(served, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.usage.prompt_tokens == prompt_len(served, ASK, enable_thinking=False) == prompt_len(served, ASK) - 2
    assert out.choices[0].message.reasoning_content is None and out.usage.completion_tokens_details.reasoning_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:
        chat(served, extra_body={"chat_template_kwargs": {"tools": []}})
    assert e.value.body["param"] == "chat_template_kwargs.tools"


def test_responses_reasoning_items(served):
    client = served.openai
    out = client.responses.create(model="think", input="Weather in Paris?", temperature=0, max_output_tokens=16)
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT and reasoning.status == "completed"
    assert message.type == "message" and out.output_text == SAID
    assert out.usage.output_tokens_details.reasoning_tokens == 3

    with client.responses.stream(model="think", input="Weather in Paris?", temperature=0, max_output_tokens=16) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [THOUGHT]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert final.output[0].content[0].text == THOUGHT and final.output_text == SAID

    # The items sent back: the reasoning restored before the answer, as the chat template renders it.
    again = client.responses.create(model="think", temperature=0, max_output_tokens=16, input=[
        {"role": "user", "content": "Weather in Paris?"}, *[item.model_dump(exclude_none=True) for item in out.output],
        {"role": "user", "content": "And tomorrow?"}])
    expected = [*ASK, {"role": "assistant", "content": SAID, "reasoning_content": THOUGHT},
                {"role": "user", "content": "And tomorrow?"}]
    assert again.usage.input_tokens == prompt_len(served, expected)


def test_responses_encrypted_reasoning_round_trip(served):
    """Codex with store false: include ["reasoning.encrypted_content"] seals the reasoning into its item;
    sent back with its content left out, the item's reasoning reaches the prompt; one sealed with another
    key (or forged) is left out, named in the access log, and the request still runs."""
    client = served.openai
    out = client.responses.create(model="think", input="Weather in Paris?", temperature=0, max_output_tokens=16,
                                  include=["reasoning.encrypted_content"], store=False,
                                  reasoning={"effort": "medium", "summary": "auto"})
    reasoning = out.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content and THOUGHT not in reasoning.encrypted_content[:9]
    with client.responses.stream(model="think", input="Weather in Paris?", temperature=0, max_output_tokens=16,
                                 include=["reasoning.encrypted_content"]) as s:
        streamed = s.get_final_response()
    assert streamed.output[0].encrypted_content and sealed_text(served, streamed.output[0].encrypted_content) == THOUGHT
    opaque = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
    history = [{"role": "user", "content": "Weather in Paris?"}, opaque, {"role": "assistant", "content": SAID},
               {"role": "user", "content": "And tomorrow?"}]
    again = client.responses.create(model="think", temperature=0, max_output_tokens=16, input=history)
    expected = [*ASK, {"role": "assistant", "content": SAID, "reasoning_content": THOUGHT},
                {"role": "user", "content": "And tomorrow?"}]
    assert again.usage.input_tokens == prompt_len(served, expected)
    forged = [history[0], {**opaque, "encrypted_content": opaque["encrypted_content"][:-4] + "AAAA"}, *history[2:]]
    unread = client.responses.create(model="think", temperature=0, max_output_tokens=16, input=forged)
    assert unread.usage.input_tokens == prompt_len(served, [*ASK, {"role": "assistant", "content": SAID},
                                                            {"role": "user", "content": "And tomorrow?"}])


def sealed_text(served, token):
    return served.front.sealer.unseal(token)


def test_context_management_clears_old_thinking(served):
    """Claude Code's clear_thinking edit: all but the last `keep` thinking turns lose their thinking."""
    client = served.anthropic
    turn = {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                                             {"type": "text", "text": SAID}]}
    history = [*ASK, turn, {"role": "user", "content": "And tomorrow?"}, turn, {"role": "user", "content": "Thanks"}]
    edits = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]}
    cleared = client.messages.count_tokens(model="think", messages=history, extra_body={"context_management": edits})
    kept = client.messages.count_tokens(model="think", messages=history, extra_body={"context_management": {
        "edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}})
    expected = [*ASK, {"role": "assistant", "content": SAID}, {"role": "user", "content": "And tomorrow?"},
                {"role": "assistant", "content": SAID, "reasoning_content": THOUGHT}, {"role": "user", "content": "Thanks"}]
    assert cleared.input_tokens == prompt_len(served, expected) < kept.input_tokens


def test_messages_thinking_blocks(served):
    client = served.anthropic
    args = {"model": "think", "max_tokens": 2048, "messages": ASK, "extra_body": {"temperature": 0}}
    out = client.messages.create(**args, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.content[0].thinking == THOUGHT and out.content[1].text == SAID and out.stop_reason == "end_turn"

    with client.messages.stream(**args) as s:
        events = list(s)
        final = s.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.thinking for d in deltas if d.type == "thinking_delta"] == REASONING
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == THOUGHT

    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in out.content]},
               {"role": "user", "content": "And tomorrow?"}]
    counted = client.messages.count_tokens(model="think", messages=history)
    expected = [*ASK, {"role": "assistant", "content": SAID, "reasoning_content": THOUGHT}, history[-1]]
    assert counted.input_tokens == prompt_len(served, expected)
    plain = client.messages.create(**args, thinking={"type": "disabled"})  # the template opens no think
    assert [b.type for b in plain.content] == ["text"] and plain.usage.input_tokens == prompt_len(served, ASK) - 2
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**{**args, "max_tokens": 1024}, thinking={"type": "enabled", "budget_tokens": 1024})
    assert e.value.body["error"]["message"].startswith("thinking.budget_tokens: ")


def test_ollama_thinking(served):
    client = served.ollama
    out = client.chat("think", messages=ASK, options={"temperature": 0, "num_predict": 16})
    assert (out.message.thinking, out.message.content) == (THOUGHT, SAID)
    lines = list(client.chat("think", messages=ASK, options={"temperature": 0, "num_predict": 16}, stream=True))
    assert [x.message.thinking for x in lines if x.message.thinking] == REASONING
    assert "".join(x.message.content or "" for x in lines) == SAID
    generated = client.generate("think", "Weather in Paris?", options={"temperature": 0, "num_predict": 16})
    assert (generated.thinking, generated.response) == (THOUGHT, SAID)

    history = [*ASK, {"role": "assistant", "content": SAID, "thinking": THOUGHT}, {"role": "user", "content": "And?"}]
    again = client.chat("think", messages=history, options={"temperature": 0, "num_predict": 16})
    expected = [*ASK, {"role": "assistant", "content": SAID, "reasoning_content": THOUGHT}, history[-1]]
    assert again.prompt_eval_count == prompt_len(served, expected)
    plain = client.chat("think", messages=ASK, think=False, options={"temperature": 0, "num_predict": 16})
    assert not plain.message.thinking and plain.prompt_eval_count == prompt_len(served, ASK) - 2
    request = urllib.request.Request(f"{served.base}/api/show", data=json.dumps({"model": "think"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert "thinking" in json.loads(r.read())["capabilities"]


def generate(served, **fields):
    return list(served.grpc.Generate(pb.GenerateRequest(max_tokens=16, **fields), timeout=60))


def test_grpc_separate_reasoning(served):
    ask = [pb.ChatMessage(role="user", content=ASK[0]["content"])]
    split = generate(served, messages=ask, separate_reasoning=True)
    assert [r.reasoning_text for r in split if r.reasoning_text] == REASONING
    assert "".join(r.text for r in split) == SAID and split[-1].usage.reasoning_tokens == 3
    raw = generate(served, messages=ask)  # unset: the text as it came (the router's way), no reasoning_text
    assert "".join(r.text for r in raw) == THOUGHT + "</think>" + SAID and not any(r.reasoning_text for r in raw)
    assert raw[-1].usage.reasoning_tokens == 0

    result = client_generate(served.grpc, pb.GenerateRequest(messages=ask, separate_reasoning=True, max_tokens=16),
                             None, 60, stream=False)  # python -m distributed.client --separate-reasoning
    assert (result["reasoning_text"], result["text"], result["usage"]["reasoning_tokens"]) == (THOUGHT, SAID, 3)

    history = [*ask, pb.ChatMessage(role="assistant", content=SAID, reasoning_content=THOUGHT),
               pb.ChatMessage(role="user", content="And?")]
    expected = [*ASK, {"role": "assistant", "content": SAID, "reasoning_content": THOUGHT},
                {"role": "user", "content": "And?"}]
    assert generate(served, messages=history)[-1].usage.prompt_tokens == prompt_len(served, expected)
    with pytest.raises(grpc.RpcError) as e:
        generate(served, messages=[pb.ChatMessage(role="user", content="x", reasoning_content="y")])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("messages[0].reasoning_content: ")


def test_metrics_count_reasoning_tokens(served):
    def counted(front_end):
        with urllib.request.urlopen(f"{served.base}/metrics", timeout=60) as r:
            text = r.read().decode()
        line = next(x for x in text.splitlines() if x.startswith(f'trinity_reasoning_tokens_total{{front_end="{front_end}"}}'))
        return float(line.split()[-1])

    wait_until(lambda: served.requests._open == 0)  # the earlier tests' requests all counted
    before = counted("http"), counted("grpc")
    chat(served)
    chat(served, max_tokens=1)
    generate(served, messages=[pb.ChatMessage(role="user", content="x")], separate_reasoning=True)
    expected = (before[0] + 3 + 1, before[1] + 3)
    wait_until(lambda: (counted("http"), counted("grpc")) == expected)  # counted once each answer is out



def test_the_chat_page_shows_the_reasoning_apart(served):
    browser = Browser()
    try:
        browser.open(served.base + "/chat")
        reply = page_chat(browser, ASK[0]["content"], 16)
        browser.wait(lambda: reply.get_attribute("data-finish"), "the reply ends")
        reasoning = reply.find_element("css selector", "details")
        assert reply.get_attribute("data-finish") == "stop" and reasoning.is_displayed()
        assert reasoning.get_attribute("textContent") == "reasoning" + THOUGHT  # its summary, then the text
        assert reply.find_element("css selector", ".content").get_attribute("textContent") == SAID
        assert browser.console_errors() == []
    finally:
        browser.close()
