"""Anthropic's Messages API (serving/anthropic_api.py) with the `anthropic` package against a
real 2-rank ring (tests/agent_ring.py), compared with /v1/chat/completions through the
`openai` package on the same ring: the same text and counts, whole and streamed; a tool-use
round trip; forced tool calls that validate; stop reasons; count_tokens; the prefix cache in
usage; bad input in Anthropic's error shape; x-api-key auth on an in-process front end."""

import json
import urllib.request

import anthropic
import jsonschema
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from agent_ring import TOOLS, start_agent_ring
from distributed.runtime.scheduler import Scheduler
from distributed.serving.http_api import start_http_server
from distributed.serving.options import ServeOptions
from distributed.serving.requests import ModelInfo
from distributed.shard.config import read_config
from stages import in_process_pipeline
from tool_checkpoint import CALL

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SYSTEM = "You answer briefly."
GREEDY = {"temperature": 0}
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    ns = start_agent_ring(tmp_path_factory)
    try:
        ns.anthropic = anthropic.Anthropic(base_url=ns.base_url, api_key="none", max_retries=0, timeout=120)
        ns.openai = openai.OpenAI(base_url=f"{ns.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        yield ns
    finally:
        ns.server.stop()


def create(ring, **kwargs):
    # The SDK takes temperature, top_p and top_k only in extra_body (it sends them in the body).
    extra = {k: kwargs.pop(k) for k in ("temperature", "top_p", "top_k") if k in kwargs}
    return ring.anthropic.messages.create(**{"model": ring.model, "max_tokens": 40, "messages": ASK,
                                             "extra_body": {"temperature": 0, **extra}, **kwargs})


def chat(ring, messages, **kwargs):
    return ring.openai.chat.completions.create(**{"model": ring.model, "messages": messages, "max_tokens": 40,
                                                  "temperature": 0, **kwargs})


def test_text_equals_chat_completions_whole_and_streamed(ring):
    for system in (None, SYSTEM):
        extra = {"system": system} if system else {}
        out = create(ring, **extra)
        ref = chat(ring, ([{"role": "system", "content": system}] if system else []) + ASK)
        (block,) = out.content
        assert block.type == "text" and block.text == ref.choices[0].message.content
        assert out.role == "assistant" and out.stop_reason == "end_turn" and out.id.startswith("msg_")
        usage = out.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == ref.usage.prompt_tokens
        assert usage.output_tokens == ref.usage.completion_tokens and usage.cache_creation_input_tokens == 0
        with ring.anthropic.messages.stream(model=ring.model, max_tokens=40, messages=ASK, extra_body=GREEDY, **extra) as s:
            kinds = [event.type for event in s]
            final = s.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
        assert kinds.index("content_block_start") < kinds.index("content_block_stop")
        assert final.content[0].text == block.text and final.stop_reason == "end_turn"
        assert final.usage.output_tokens == usage.output_tokens


def test_a_tool_use_round_trip(ring):
    out = create(ring, tools=A_TOOLS)
    (use,) = out.content
    assert out.stop_reason == "tool_use" and use.type == "tool_use"
    assert use.name == CALL["name"] and use.input == CALL["arguments"]
    history = ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                        "input": use.input}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]}]
    second = create(ring, tools=A_TOOLS, messages=history)
    ref = chat(ring, ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 C, sunny"}], tools=TOOLS)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > \
        out.usage.input_tokens + out.usage.cache_read_input_tokens  # the result reached the prompt


def test_forced_tool_calls_validate_whole_and_streamed(ring):
    schema = A_TOOLS[1]["input_schema"]
    out = create(ring, max_tokens=120, tools=A_TOOLS, tool_choice={"type": "tool", "name": "get_time"})
    (use,) = [b for b in out.content if b.type == "tool_use"]
    assert use.name == "get_time" and out.stop_reason == "tool_use"
    jsonschema.validate(use.input, schema)
    with ring.anthropic.messages.stream(model=ring.model, max_tokens=120, extra_body=GREEDY, messages=ASK, tools=A_TOOLS,
                                        tool_choice={"type": "tool", "name": "get_time"}) as s:
        partial = "".join(e.delta.partial_json for e in s if e.type == "content_block_delta"
                          and e.delta.type == "input_json_delta")
        final = s.get_final_message()
    assert json.loads(partial) == use.input and final.content[-1].input == use.input
    for seed in range(3):  # "any": one call to either tool
        out = create(ring, max_tokens=120, temperature=1.0, top_k=50 + seed, tools=[A_TOOLS[1]],
                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
        (use,) = [b for b in out.content if b.type == "tool_use"]
        jsonschema.validate(use.input, schema)


def test_output_config_format_validates(ring):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "celsius": {"type": "integer", "minimum": -50, "maximum": 50}},
              "required": ["city", "celsius"], "additionalProperties": False}
    out = create(ring, max_tokens=60, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert out.stop_reason == "end_turn"
    jsonschema.validate(json.loads(out.content[0].text), schema)
    ref = chat(ring, ASK, max_tokens=60, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}})
    assert out.content[0].text == ref.choices[0].message.content


def test_stop_reasons_max_tokens_and_stop_sequence(ring):
    short = create(ring, max_tokens=2)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    text = create(ring).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = create(ring, stop_sequences=["zzz-never", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_count_tokens_and_the_prefix_cache_in_usage(ring):
    long = [{"role": "user", "content": "Tell me about rings and pipelines. " * 12}]
    count = ring.anthropic.messages.count_tokens(model=ring.model, messages=long, system=SYSTEM, tools=A_TOOLS)
    first = create(ring, messages=long, system=SYSTEM, tools=A_TOOLS, max_tokens=3)
    assert count.input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens
    # The next turn extends the first's prompt and answer: restored from the prefix cache.
    text = create(ring, messages=long, max_tokens=3).content[0].text
    turn = long + [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    again = create(ring, messages=turn, max_tokens=3)
    assert again.usage.cache_read_input_tokens > 0
    count = ring.anthropic.messages.count_tokens(model=ring.model, messages=turn)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == count.input_tokens


@pytest.mark.parametrize("fields, param", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                           "data": "AA=="}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ({"tool_choice": {"type": "tool", "name": "get_time"}}, "tool_choice"),  # no tools
    ({"max_tokens": 0}, "max_tokens"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "wat"}}}}, "output_config.format"),
    ({"speed": "fast"}, "speed"),
])
def test_bad_input_is_a_400_in_anthropics_shape(ring, fields, param):
    known = {"thinking", "tools", "messages", "tool_choice", "max_tokens", "output_config", "speed"}
    with pytest.raises(anthropic.BadRequestError) as e:  # what the SDK does not take goes in extra_body
        create(ring, **{k: v for k, v in fields.items() if k in known},
               extra_body={"temperature": 0, **{k: v for k, v in fields.items() if k not in known}})
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"].startswith(param), body


def test_plain_http_without_max_tokens_and_another_model(ring):
    def post(body):
        request = urllib.request.Request(f"{ring.base_url}/v1/messages", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, body = post({"model": ring.model, "messages": ASK})
    assert status == 400 and body["error"]["message"].startswith("max_tokens: required"), body
    status, body = post({"model": "claude-other", "max_tokens": 5, "messages": ASK})
    assert status == 404 and body["error"]["type"] == "not_found_error", body
    assert create(ring, max_tokens=2).stop_reason == "max_tokens"  # still serving


def test_x_api_key_and_bearer_auth(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (8,))
    tokenizer = load_tokenizer(hf_checkpoint)
    scheduler = Scheduler(pipeline, tokenizer).start()
    front = start_http_server(ServeOptions(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", auth_token="sesame"))
    try:
        front.attach(scheduler, tokenizer, ModelInfo("tiny", read_config(hf_checkpoint)["vocab_size"], 1024, 1000))
        base = f"http://127.0.0.1:{front.port}"
        ok = anthropic.Anthropic(base_url=base, api_key="sesame", max_retries=0, timeout=60)
        out = ok.messages.create(model="tiny", max_tokens=2, messages=ASK)
        assert out.usage.output_tokens <= 2
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0, timeout=60).messages.create(
                model="tiny", max_tokens=2, messages=ASK)
        assert e.value.body["error"]["type"] == "authentication_error"
        bearer = anthropic.Anthropic(base_url=base, auth_token="sesame", max_retries=0, timeout=60)
        assert bearer.messages.count_tokens(model="tiny", messages=ASK).input_tokens > 0
    finally:
        front.stop()
        scheduler.close()
