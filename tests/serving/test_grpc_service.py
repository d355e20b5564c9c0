"""The gRPC service end to end: real `run_trinity.py --serve` processes on free ports.

One server per configuration (module-scoped, torn down before the next starts:
idle ring ranks and mlx.launch still use CPU): `--stages 2` in one process, 2 ranks
and 3 under our launcher (`trinity-launch run --single-host N`). Greedy output through gRPC must equal the
one-shot command line's (`run_json`, 1 rank) for the same request. Auth, TLS, the
queue's bound and health over a server's life: test_grpc_access.py.
"""

import json
import math
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import mlx.core as mx
import pytest
from pathlib import Path
from mlx_lm.sample_utils import make_logits_processors

from conftest import run_json
from grpc_server import (CONFIGS, IDS, LONG, MAX_TOKENS, SERVER_ARGS, SERVICE, SERVING, Server, assert_matches, client,
                         generate, reflection_generate, rpc_error)
from distributed.runtime.grammar import json_schema_grammar
from distributed.serving.proto import generation_pb2 as pb
from distributed.shard.memory import MAX_BATCH
from reference import PROMPT, mlx_lm_greedy, mlx_lm_logprobs, mlx_lm_masked_greedy

# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def reference(hf_checkpoint):
    return run_json(["--model", str(hf_checkpoint), "--prompt-ids", IDS, "--max-tokens", str(MAX_TOKENS)])


@pytest.fixture(scope="module")
def chat_reference(hf_checkpoint):
    return run_json(["--model", str(hf_checkpoint), "--prompt", "hi", "--max-tokens", "8"])


@pytest.fixture(scope="module", params=list(CONFIGS))
def server(request, hf_checkpoint, reference, chat_reference):
    ranks, extra, layers = CONFIGS[request.param]
    # Our launcher: mlx.launch's own loop keeps a core busy while its ranks run (it polls their pipes
    # without waiting), so its serving ring is test_lifecycle.py's and test_chat.py's alone.
    s = Server(hf_checkpoint, ranks, [*extra, *SERVER_ARGS])
    s.name, s.layers = request.param, layers
    try:
        s.wait_serving()
        yield s
    finally:
        s.stop()


# ---------------------------------------------------------------- every configuration


def test_stream_equals_the_command_line(server, reference):
    out = generate(server.stub, token_ids=PROMPT, max_tokens=MAX_TOKENS)
    assert_matches(out, reference)
    assert out["finish_reason"] == reference["finish_reason"] == "length"
    assert out["responses"] == MAX_TOKENS + 1
    assert (out["usage"].prompt_tokens, out["usage"].completion_tokens) == (len(PROMPT), MAX_TOKENS)
    assert out["usage"].generation_tokens_per_sec > 0


def test_chat_messages_and_chat_template_prompt(server, chat_reference):
    for fields in ({"messages": [pb.ChatMessage(role="user", content="hi")]},
                   {"prompt": "hi", "chat_template": True}):
        out = generate(server.stub, max_tokens=8, **fields)
        assert out["usage"].prompt_tokens == len(chat_reference["prompt_token_ids"])
        assert out["token_ids"] == chat_reference["token_ids"] and out["text"] == chat_reference["text"]
    raw = generate(server.stub, prompt="hi", max_tokens=2)  # no template: the bytes of "hi"
    assert raw["usage"].prompt_tokens == 2


def test_concurrent_clients_all_get_their_output(server, reference):
    sizes = [6 + i for i in range(8)]  # different lengths, so requests cannot stand in for each other
    with ThreadPoolExecutor(len(sizes)) as pool:
        outs = list(pool.map(lambda n: generate(server.stub, token_ids=PROMPT, max_tokens=n), sizes))
    for n, out in zip(sizes, outs):
        assert_matches(out, reference, n)
        assert out["finish_reason"] == "length" and out["usage"].completion_tokens == n


def test_cancel_mid_stream_then_exact(server, reference):
    call = server.stub.Generate(pb.GenerateRequest(token_ids=PROMPT, max_tokens=LONG), timeout=120)
    got = [next(call) for _ in range(3)]
    assert [r.token_ids[0] for r in got] == reference["token_ids"][:3]
    call.cancel()
    assert rpc_error(list, call).code() == grpc.StatusCode.CANCELLED
    # If the cancelled request kept generating (~400 tokens), this would wait behind it.
    assert_matches(generate(server.stub, token_ids=PROMPT, max_tokens=MAX_TOKENS, timeout=60), reference)


def test_deadline_then_exact(server, reference):
    # 1000 tokens take seconds on any configuration here; the deadline passes long before.
    error = rpc_error(generate, server.stub, token_ids=PROMPT, max_tokens=1000, timeout=0.3)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_matches(generate(server.stub, token_ids=PROMPT, max_tokens=MAX_TOKENS, timeout=60), reference)


BAD = [  # (request fields, field named in the message, words in the message)
    ({"prompt": ""}, "prompt", "exactly one"),  # proto3: an empty prompt is no prompt
    ({}, "prompt", "got none"),
    ({"prompt": "hi", "token_ids": [1, 2]}, "prompt", "prompt and token_ids"),
    ({"prompt": "hi", "messages": [pb.ChatMessage(role="user", content="hi")]}, "prompt", "prompt and messages"),
    ({"token_ids": [1, 259]}, "token_ids", "259"),
    ({"token_ids": [1] * 2048, "max_tokens": 1000}, "max_tokens", "context of 2048"),  # no room: a shorter one is clamped
    ({"token_ids": PROMPT, "max_tokens": 0}, "max_tokens", "at least 1"),
    ({"token_ids": PROMPT, "temperature": -0.5}, "temperature", ">= 0"),
    ({"token_ids": PROMPT, "temperature": math.nan}, "temperature", "nan"),
    ({"token_ids": PROMPT, "top_p": 0.0}, "top_p", "(0, 1]"),
    ({"token_ids": PROMPT, "top_p": 1.5}, "top_p", "(0, 1]"),
    ({"token_ids": PROMPT, "top_k": -1}, "top_k", ">= 0"),
    ({"token_ids": PROMPT, "min_p": -0.1}, "min_p", "[0, 1]"),
    ({"token_ids": PROMPT, "min_p": 1.5}, "min_p", "[0, 1]"),
    ({"token_ids": PROMPT, "stop": [""]}, "stop", "empty"),
    ({"token_ids": PROMPT, "presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"token_ids": PROMPT, "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"token_ids": PROMPT, "logit_bias": {300: 1.0}}, "logit_bias", "300"),
    ({"token_ids": PROMPT, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"messages": [pb.ChatMessage(role="wizard", content="hi")]}, "messages[0].role", "unknown role"),
    ({"token_ids": PROMPT, "max_tokens": 3, "resume_token_ids": [1, 2, 3]}, "resume_token_ids", "leave none"),
    ({"token_ids": PROMPT, "max_tokens": 8, "resume_token_ids": [1, 259]}, "resume_token_ids", "259"),
    ({"token_ids": PROMPT, "json_schema": "{not json"}, "json_schema", "not JSON"),
    ({"token_ids": PROMPT, "json_schema": '{"type": "wat"}'}, "json_schema", "Invalid type: wat"),
    ({"token_ids": PROMPT, "lark_grammar": "start: missing_rule"}, "lark_grammar", "missing_rule"),
    ({"token_ids": PROMPT, "regex": "(open"}, "regex", "unclosed group"),
]


def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(server, reference):
    for fields, field, words in BAD:
        error = rpc_error(generate, server.stub, **fields)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, error)
        assert error.details().startswith(f"{field}:") and words in error.details(), (fields, error.details())
    assert server.health_status() == SERVING
    assert_matches(generate(server.stub, token_ids=PROMPT, max_tokens=4), reference, 4)


def test_model_info_has_the_rank_map(server, hf_checkpoint):
    # Auth is off: a stray authorization header is ignored.
    for metadata in (None, [("authorization", "Bearer whatever")]):
        info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, metadata=metadata)
    assert (info.model_id, info.vocab_size, info.max_context, info.max_tokens_cap) == (str(hf_checkpoint), 259, 2048, 1024)
    assert [[r.layer_start, r.layer_end] for r in info.ranks] == server.layers
    assert [r.rank for r in info.ranks] == list(range(len(server.layers)))
    assert [r.embed for r in info.ranks] == [True] + [False] * (len(server.layers) - 1)
    assert info.ranks[0].head
    assert all(r.host and r.peak_memory_bytes > 0 and r.parameter_bytes > 0 for r in info.ranks)
    # No --max-batch: as many 2048-token (--max-context) sequences as fit on the tightest rank, said at start.
    assert 1 <= info.max_batch <= MAX_BATCH
    assert f"max batch: {info.max_batch}: {info.max_batch} sequences of 2048 tokens (rank " in server.output(100000)


def loaded_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux): reads mapped libraries")
@pytest.mark.parametrize("server", [c for c in CONFIGS if CONFIGS[c][0] > 1], indirect=True)
def test_only_rank_0_loads_the_tokenizer_libraries(server):
    # transformers brings in the `tokenizers` extension; ranks other than 0 import mlx-lm's model code
    # alone (distributed/startup/light_imports.py), while rank 0 tokenizes.
    tokenizers = ["tokenizers.abi3" in loaded_libraries(server.rank_pid(r)) for r in range(CONFIGS[server.name][0])]
    assert tokenizers == [True] + [False] * (len(tokenizers) - 1)


def test_reflection_only_client(server, reference):
    services, responses = reflection_generate(server.channel, {"token_ids": PROMPT, "max_tokens": 8})
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    assert [t for r in responses for t in r.token_ids] == reference["token_ids"][:8]
    assert responses[-1].finish_reason == "length" and responses[-1].usage.completion_tokens == 8


def test_client_command_line(server, reference):
    proc = client("--target", server.address, "--token-ids", IDS, "--max-tokens", str(MAX_TOKENS), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert_matches(out, reference)
    assert out["finish_reason"] == "length" and out["usage"] == {"prompt_tokens": 40, "completion_tokens": MAX_TOKENS}
    info = client("--target", server.address, "--info", "--json")
    assert info.returncode == 0, info.stderr
    info = json.loads(info.stdout)
    assert [[r["layer_start"], r["layer_end"]] for r in info["ranks"]] == server.layers
    # uint64 fields as JSON numbers, not protobuf's strings
    assert type(info["max_context"]) is int and all(type(r["peak_memory_bytes"]) is int for r in info["ranks"])


def test_prompt_logprobs_top_logprobs_and_penalties_equal_mlx_lm(server, hf_checkpoint):
    """Scoring a prompt needs every position back from the last rank, across this split."""
    out = generate(server.stub, token_ids=PROMPT, max_tokens=0, prompt_logprobs=True, top_logprobs=3)
    ref, p = mlx_lm_logprobs(hf_checkpoint, PROMPT), out["prompt"]
    assert list(p.prompt_token_ids) == PROMPT and math.isnan(p.prompt_logprobs[0]) and not p.prompt_top_logprobs[0].token_ids
    assert max(abs(lp - ref[i - 1, t].item()) for i, (lp, t) in enumerate(zip(p.prompt_logprobs, PROMPT)) if i) < 1e-4
    assert all(list(top.token_ids) == mx.argsort(-ref[i - 1])[:3].tolist() for i, top in enumerate(p.prompt_top_logprobs) if i)
    assert out["token_ids"] == [] and out["finish_reason"] == "length"
    fields = dict(presence_penalty=1.5, repetition_penalty=1.3, logit_bias={5: -100.0})
    penalized = generate(server.stub, token_ids=PROMPT, max_tokens=MAX_TOKENS, top_logprobs=2, **fields)
    expected, _ = mlx_lm_greedy(hf_checkpoint, PROMPT, MAX_TOKENS, 512,
                                logits_processors=make_logits_processors({5: -100.0}, 1.3, 20, 1.5, 20))
    assert penalized["token_ids"] == expected != mlx_lm_greedy(hf_checkpoint, PROMPT, MAX_TOKENS, 512)[0]
    assert [len(t.token_ids) for t in penalized["top_logprobs"]] == [2] * len(expected)
    proc = client("--target", server.address, "--token-ids", IDS, "--max-tokens", "0", "--prompt-logprobs",
                  "--top-logprobs", "2", "--logit-bias", "5=-100", "--presence-penalty", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    scored = json.loads(proc.stdout)
    assert scored["prompt_logprobs"][0] is None and close_to(scored["prompt_logprobs"][1:], p.prompt_logprobs[1:])
    assert len(scored["prompt_top_logprobs"][1]) == 2 and scored["token_ids"] == []


def close_to(a, b):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-5


def test_resume_token_ids_continue_the_stream_exactly(server, reference):
    """A replay after a failure (the router): resuming after k streamed tokens streams exactly the rest
    of the undisturbed stream (greedy; seeded, penalised), also across a stop string; the texts join up."""
    for fields in ({}, dict(temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.3, logit_bias={65: 2.0})):
        def stream(**more):
            return list(server.stub.Generate(pb.GenerateRequest(token_ids=PROMPT, max_tokens=MAX_TOKENS, **fields,
                                                                **more), timeout=120))
        full = stream()
        ids, text = [r.token_ids[0] for r in full[:-1]], "".join(r.text for r in full)
        assert ids == reference["token_ids"] or fields
        for k in (1, 5, len(ids) - 1):  # the prompt's logprobs went out before the cut: not again
            out = generate(server.stub, token_ids=PROMPT, max_tokens=MAX_TOKENS, resume_token_ids=ids[:k],
                           prompt_logprobs=True, **fields)
            assert "prompt" not in out and out["token_ids"] == ids[k:], (fields, k)
            assert close_to(out["logprobs"], [r.logprobs[0] for r in full[k:-1]])
            assert "".join(r.text for r in full[:k]) + out["text"] == text
            assert (out["finish_reason"], out["usage"].prompt_tokens, out["usage"].completion_tokens) == \
                (full[-1].finish_reason, len(PROMPT), full[-1].usage.completion_tokens)
        stop = text[len("".join(r.text for r in full[:4])) - 1:][:3]
        stopped = stream(stop=[stop])
        out = generate(server.stub, token_ids=PROMPT, max_tokens=MAX_TOKENS, stop=[stop], resume_token_ids=ids[:4],
                       **fields)
        assert ids[:4] + out["token_ids"] == [r.token_ids[0] for r in stopped[:-1]] and out["finish_reason"] == "stop"
        assert "".join(r.text for r in stopped[:4]) + out["text"] == text[:text.index(stop)] != text


def test_speculative_false_changes_nothing_but_the_passes(server, reference):
    """ranks2 speculates: the same tokens with and without a request's opt-out (and as the
    one-rank command line's), its verification passes only when allowed (metrics)."""
    out = generate(server.stub, token_ids=PROMPT, max_tokens=MAX_TOKENS, speculative=False)
    assert_matches(out, reference)


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["x", "y", "z"]}}, "required": ["n", "tag"],
          "additionalProperties": False}


def test_constraints_keep_the_output_to_the_grammar(server, hf_checkpoint):
    """Greedy under a JSON schema: mlx-lm's tokens masked by llguidance itself, on every
    split (ranks2 speculates); sampled under a regex and a Lark grammar: always a match."""
    reference = mlx_lm_masked_greedy(hf_checkpoint, PROMPT, json_schema_grammar(SCHEMA), 60)
    out = generate(server.stub, token_ids=PROMPT, max_tokens=60, json_schema=json.dumps(SCHEMA))
    assert out["token_ids"] == reference and out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    for seed in range(3):
        out = generate(server.stub, token_ids=PROMPT, max_tokens=20, temperature=1.3, seed=seed, regex=r"[0-9]{3}-[ab]+")
        assert re.fullmatch(r"[0-9]{3}-[ab]+", out["text"]) or out["finish_reason"] == "length", out
        out = generate(server.stub, token_ids=PROMPT, max_tokens=20, temperature=1.3, seed=seed,
                       lark_grammar='start: "on" | "off"')
        assert out["text"] in ("on", "off") and out["finish_reason"] == "stop"
    cut = generate(server.stub, token_ids=PROMPT, max_tokens=3, json_schema=json.dumps(SCHEMA))
    assert cut["token_ids"] == reference[:3] and cut["finish_reason"] == "length"


# Keep this test last: it breaks the module's server (pytest runs each server's
# tests together, in file order, so it runs last for each configuration).
@pytest.mark.parametrize("server", [c for c in CONFIGS if CONFIGS[c][0] > 1], indirect=True)
def test_a_rank_dies_under_a_launcher(server, reference):
    """Kill rank 1 mid-stream: the stream fails UNAVAILABLE and the service
    never reports SERVING again (rank 0 reports NOT_SERVING until the launcher,
    which stops every rank once one exits non-zero, stops it). Multi-rank
    servers only: in one process there is no rank to kill."""
    assert server.launcher
    call = server.stub.Generate(pb.GenerateRequest(token_ids=PROMPT, max_tokens=LONG), timeout=120)
    assert next(call).token_ids[0] == reference["token_ids"][0]
    os.kill(server.rank_pid(1), signal.SIGKILL)
    error = rpc_error(list, call)
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    # Then NOT_SERVING, or no answer at all once the launcher has stopped rank 0.
    states = [server.health_status() for _ in range(10)]
    assert SERVING not in states, states
    rpc_error(generate, server.stub, token_ids=PROMPT, max_tokens=4, timeout=30)
