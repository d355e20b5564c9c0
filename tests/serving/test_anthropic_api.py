"""Anthropic's Messages API (serving/anthropic_api.py) with the `anthropic` package against a real
2-rank ring (tests/agent_ring.py), compared with /v1/chat/completions through the `openai`
package: the same greedy text and prompt tokens, events in Anthropic's order, tool use both
ways, forced tools keeping to their schema, stop reasons, count_tokens, the prefix cache in
usage, refused fields (400 in Anthropic's shape), and x-api-key auth (an in-process front end)."""

import http.client
import json

import anthropic
import jsonschema
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from agent_ring import TOOLS, access_line, access_lines, start_agent_ring
from distributed.runtime.scheduler import Scheduler
from distributed.serving.http_api import start_http_server
from distributed.serving.options import ServeOptions
from distributed.serving.chat_format import ModelInfo
from distributed.shard.config import read_config
from stages import in_process_pipeline
from tool_checkpoint import ADDED, CALL

ASK = [{"role": "user", "content": "Weather in Paris?"}]
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]  # Anthropic's form
GREEDY = "".join(ADDED)  # the checkpoint's answer where no tools are given: the call's markup as text


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    ns = start_agent_ring(tmp_path_factory)
    try:
        ns.client = anthropic.Anthropic(base_url=ns.base_url, api_key="none", max_retries=0, timeout=120)
        ns.openai = openai.OpenAI(base_url=f"{ns.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        yield ns
    finally:
        ns.server.stop()


def create(ring, temperature=0, **kwargs):
    """messages.create, greedy unless told (the current SDK has no temperature argument: it goes in the body)."""
    return ring.client.messages.create(**{"model": ring.model, "messages": ASK, "max_tokens": 64,
                                          "extra_body": {"temperature": temperature}, **kwargs})


def stream(ring, **kwargs):
    return ring.client.messages.stream(**{"model": ring.model, "messages": ASK, "max_tokens": 64,
                                          "extra_body": {"temperature": 0}, **kwargs})


def chat(ring, **kwargs):
    return ring.openai.chat.completions.create(**{"model": ring.model, "messages": ASK, "max_tokens": 64,
                                                  "temperature": 0, **kwargs})


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens  # Anthropic's input_tokens leave out cache reads


def post(ring, path, body, headers=None) -> tuple:
    """(status, JSON) of a plain HTTP POST."""
    conn = http.client.HTTPConnection("127.0.0.1", ring.port, timeout=60)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    out = response.status, json.loads(response.read())
    conn.close()
    return out


def test_greedy_text_is_chat_completions_text(ring):
    for system in (None, "Answer briefly."):
        extra = {"system": system} if system else {}
        message = create(ring, **extra)
        reference = chat(ring, messages=[{"role": "system", "content": system}, *ASK] if system else ASK)
        assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
        assert message.model == ring.model
        assert [(b.type, b.text) for b in message.content] == [("text", reference.choices[0].message.content)]
        assert message.content[0].text == GREEDY
        assert message.stop_reason == "end_turn" and message.stop_sequence is None
        assert message.usage.output_tokens == reference.usage.completion_tokens
        assert prompt_tokens(message.usage) == reference.usage.prompt_tokens
        assert message.usage.cache_creation_input_tokens == 0
    blocks = create(ring, system=[{"type": "text", "text": "Answer "}, {"type": "text", "text": "briefly."}])
    assert prompt_tokens(blocks.usage) == prompt_tokens(message.usage)  # text blocks join as one system prompt


def test_stream_events_in_order_and_the_final_message(ring):
    events = list(create(ring, stream=True))
    types = [e.type for e in events]
    deltas = types.count("content_block_delta")
    assert deltas >= 1 and types == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                                     "content_block_stop", "message_delta", "message_stop"]
    assert events[0].message.content == [] and events[0].message.usage.input_tokens > 0
    assert events[1].index == 0 and events[1].content_block.type == "text"
    assert "".join(e.delta.text for e in events[2:2 + deltas]) == GREEDY
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == len(ADDED)

    with stream(ring) as events:
        texts = list(events.text_stream)
        final = events.get_final_message()
    whole = create(ring)
    assert "".join(texts) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)


def test_a_tool_use_round_trip(ring):
    message = create(ring, tools=A_TOOLS)
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == CALL["name"] and block.input == CALL["arguments"]
    assert block.id.startswith("toolu_")
    turns = [*ASK, {"role": "assistant", "content": message.content},  # the reply's blocks, sent back as they came
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "is_error": False,
                                           "content": [{"type": "text", "text": "18 C, sunny"}]}]}]
    answer = create(ring, tools=A_TOOLS, messages=turns)
    assert answer.stop_reason == "tool_use" and answer.content[0].type == "tool_use"
    # The same conversation in OpenAI's form prompts the same tokens.
    call = {"id": "call_1", "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}}
    reference = chat(ring, tools=TOOLS, messages=[*ASK, {"role": "assistant", "tool_calls": [call]},
                                                  {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}])
    assert prompt_tokens(answer.usage) == reference.usage.prompt_tokens
    counted = ring.client.messages.count_tokens(model=ring.model, messages=turns, tools=A_TOOLS)
    assert counted.input_tokens == reference.usage.prompt_tokens
    turns[-1]["content"][0].update(is_error=True, content="no network")  # the template has no flag: the text says it
    failed = ring.client.messages.count_tokens(model=ring.model, messages=turns, tools=A_TOOLS)
    reference = chat(ring, tools=TOOLS, max_tokens=1, messages=[
        *ASK, {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Error: no network"}])
    assert failed.input_tokens == reference.usage.prompt_tokens


def test_tool_choice_forces_a_tool_and_its_schema(ring):
    forced = dict(tools=A_TOOLS, tool_choice={"type": "tool", "name": "get_time"}, max_tokens=200)
    for streamed in (False, True):
        if streamed:
            with stream(ring, **forced) as events:
                message = events.get_final_message()
        else:
            message = create(ring, **forced)
        (block,) = message.content
        assert message.stop_reason == "tool_use" and block.name == "get_time"
        jsonschema.validate(block.input, A_TOOLS[1]["input_schema"])
    # "any" with one call at most: one call to some tool (greedy: a sampled one has no seed to fix it)
    message = create(ring, tools=A_TOOLS, max_tokens=200,
                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (block,) = message.content
    assert message.stop_reason == "tool_use" and block.name in ("get_weather", "get_time")
    jsonschema.validate(block.input, next(t["input_schema"] for t in A_TOOLS if t["name"] == block.name))
    none = create(ring, tools=A_TOOLS, tool_choice={"type": "none"})  # no tools in the prompt, nothing parsed
    assert [(b.type, b.text) for b in none.content] == [("text", GREEDY)] and none.stop_reason == "end_turn"


def test_a_streamed_tool_call_is_input_json_deltas(ring):
    events = list(create(ring, tools=A_TOOLS, stream=True))
    (start,) = [e for e in events if e.type == "content_block_start"]
    assert start.content_block.type == "tool_use" and start.content_block.name == CALL["name"]
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == CALL["arguments"]
    assert all(e.delta.type == "input_json_delta" for e in events if e.type == "content_block_delta")
    assert events[-2].delta.stop_reason == "tool_use"
    with stream(ring, tools=A_TOOLS) as events:
        final = events.get_final_message()
    assert final.content[0].input == CALL["arguments"] and final.stop_reason == "tool_use"


def test_structured_output_validates(ring):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    message = create(ring, max_tokens=200, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_stop_reasons_max_tokens_and_stop_sequence(ring):
    short = create(ring, max_tokens=1)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 1 and short.content[0].text == ADDED[0]
    cut = create(ring, stop_sequences=["nowhere", "city"])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "city"
    assert cut.content[0].text == GREEDY[:GREEDY.index("city")]
    assert cut.content[0].text == chat(ring, stop=["nowhere", "city"]).choices[0].message.content
    missed = create(ring, stop_sequences=["nowhere"])  # the reply ended at EOS
    assert missed.stop_reason == "end_turn" and missed.stop_sequence is None and missed.content[0].text == GREEDY
    with stream(ring, stop_sequences=["arguments"]) as events:
        final = events.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "arguments"


def test_count_tokens_is_the_prompt(ring):
    request = dict(messages=ASK, system="Answer briefly.", tools=A_TOOLS)
    counted = ring.client.messages.count_tokens(model=ring.model, **request)
    message = create(ring, **request)
    assert counted.input_tokens == prompt_tokens(message.usage)
    assert counted.input_tokens == chat(ring, messages=[{"role": "system", "content": "Answer briefly."}, *ASK],
                                        tools=TOOLS).usage.prompt_tokens
    bare = ring.client.messages.count_tokens(model=ring.model, messages=ASK)
    unused = ring.client.messages.count_tokens(model=ring.model, messages=ASK, tools=A_TOOLS,
                                               tool_choice={"type": "none"})
    assert bare.input_tokens == unused.input_tokens < counted.input_tokens  # tool_choice none: no tools prompted
    status, body = post(ring, "/v1/messages/count_tokens", {"model": ring.model, "messages": ASK, "max_tokens": 5})
    assert status == 400 and "max_tokens" in body["error"]["message"]  # not a count_tokens field


def test_a_chats_next_turn_reads_the_prefix_cache(ring):
    """The checkpoint's sliding window (16 tokens) wraps on a long prompt: its cache entry serves
    prompts that extend it, as a chat's next turn does."""
    long = [{"role": "user", "content": " ".join(f"item {i} is fine." for i in range(40))}]
    first = create(ring, messages=long)
    turns = [*long, {"role": "assistant", "content": first.content}, {"role": "user", "content": "And then?"}]
    second = create(ring, messages=turns)
    assert second.usage.cache_read_input_tokens >= prompt_tokens(first.usage)
    counted = ring.client.messages.count_tokens(model=ring.model, messages=turns)
    assert prompt_tokens(second.usage) == counted.input_tokens
    assert second.content == first.content


def test_hints_and_neutral_values_change_nothing(ring):
    ephemeral = {"type": "ephemeral"}
    hinted = create(ring, metadata={"user_id": "u1"}, inference_geo="eu", thinking={"type": "disabled"},
                    service_tier="standard_only", cache_control=ephemeral,
                    system=[{"type": "text", "text": "Hi.", "cache_control": ephemeral}])
    plain = create(ring, system="Hi.")
    assert hinted.content == plain.content and prompt_tokens(hinted.usage) == prompt_tokens(plain.usage)


@pytest.mark.parametrize("extra, named", [
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"extra_body": {"context_management": {"edits": [{"type": "clear_tool_uses_20250919", "keep": 3}]}}},
     "context_management.edits[0].keep"),
    ({"extra_body": {"output_config": {"effort": 3}}}, "output_config.effort"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "text", "media_type": "text/plain", "data": "x"}}]}]}, "messages[0].content[0].type"),
    ({"extra_body": {"container": "c1"}}, "container"),
    ({"extra_body": {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}}, "mcp_servers"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"messages": [*ASK, {"role": "assistant", "content": "The weather is"}]}, "messages[1]"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": A_TOOLS}, "tool_choice"),
    ({"temperature": "hot"}, "temperature"),
    ({"extra_body": {"temperature": 0, "top_k": 1.5}}, "top_k"),
])
def test_refused_fields_are_400_naming_them(ring, extra, named):
    with pytest.raises(anthropic.BadRequestError) as e:
        create(ring, **extra)
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith(f"{named}: ")


def test_bad_bodies_over_plain_http(ring):
    body = {"model": ring.model, "messages": ASK}
    status, out = post(ring, "/v1/messages", body)
    assert status == 400 and out == {"type": "error", "error": {"type": "invalid_request_error",
                                                                "message": "max_tokens: required"}}
    status, out = post(ring, "/v1/messages", {**body, "max_tokens": 8, "model": "claude-nope"})
    assert status == 404 and out["error"]["type"] == "not_found_error" and "claude-nope" in out["error"]["message"]
    status, out = post(ring, "/v1/messages", b"{not json")
    assert status == 400 and out["type"] == "error" and "JSON" in out["error"]["message"]
    status, out = post(ring, "/v1/messages/count_tokens", {"model": ring.model, "messages": "hi"})
    assert status == 400 and out["error"]["message"].startswith("messages: ")
    assert create(ring).content[0].text == GREEDY  # still serving


@pytest.fixture(scope="module")
def guarded(ring):
    """A front end with --auth-token over an in-process pipeline of the ring's checkpoint."""
    pipeline, _ = in_process_pipeline(ring.path, (4, 4))
    tokenizer = load_tokenizer(ring.path, eos_token_ids=read_config(ring.path)["eos_token_id"])
    scheduler = Scheduler(pipeline, tokenizer).start()
    front = start_http_server(ServeOptions(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0",
                                           auth_token="sekret"))
    try:
        front.attach(scheduler, tokenizer, ModelInfo("tools", read_config(ring.path)["vocab_size"], 1024, 1000))
        yield f"http://127.0.0.1:{front.port}"
    finally:
        front.stop()
        scheduler.close()


def test_x_api_key_auth(guarded):
    def client(key):
        return anthropic.Anthropic(base_url=guarded, api_key=key, max_retries=0, timeout=60)

    message = client("sekret").messages.create(model="tools", messages=ASK, max_tokens=8,
                                               extra_body={"temperature": 0})
    assert message.content[0].text == GREEDY
    for call in (lambda c: c.messages.create(model="tools", messages=ASK, max_tokens=8),
                 lambda c: c.messages.count_tokens(model="tools", messages=ASK)):
        with pytest.raises(anthropic.AuthenticationError) as e:
            call(client("wrong"))
        assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    assert client("sekret").messages.count_tokens(model="tools", messages=ASK).input_tokens > 0


def test_claude_code_request_is_served(ring):
    """Claude Code's request as it comes (trimmed): context_management, adaptive thinking, effort,
    a system entry among the messages, max_tokens far above the cap: served, the max_tokens clamped
    (stop_reason max_tokens where the clamp ends it) and what changes nothing named in the access log."""
    body = {"model": ring.model, "max_tokens": 32000, "stream": True, "temperature": 1,
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "say hello"}]},
                         {"role": "system", "content": "<system-reminder>be brief</system-reminder>"},
                         {"role": "user", "content": "Weather in Paris?"}],
            "tools": [{**A_TOOLS[0], "cache_control": {"type": "ephemeral"}}],
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "medium"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "user_abc_account_def_session_1"}}
    before = len(access_lines(ring, "/v1/messages"))
    with ring.client.messages.stream(**{k: v for k, v in body.items() if k in ("model", "max_tokens", "system",
                                                                               "messages", "tools", "metadata")},
                                     extra_body={k: v for k, v in body.items() if k in (
                                         "thinking", "output_config", "context_management", "temperature")}) as s:
        message = s.get_final_message()
    assert message.stop_reason in ("tool_use", "end_turn", "max_tokens"), message
    line = access_line(ring, "/v1/messages", before)
    assert "status=200" in line and "clamped=max_tokens" in line, line
    for name in ("thinking", "output_config.effort", "metadata"):
        assert name in line.split("ignored=")[1], line
    status, out = post(ring, "/v1/messages", {**body, "stream": False, "temperature": 0, "tools": [],
                                              "messages": [{"role": "user", "content": "Tell me a long story."}]})
    assert status == 200 and out["stop_reason"] in ("max_tokens", "end_turn"), out


def test_system_entries_and_context_edits_shape_the_prompt(ring):
    """A system entry inside messages reaches the template where it stands (this template takes it);
    clear_tool_uses replaces old tool results as Anthropic documents it."""
    middle = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
              {"role": "system", "content": "note"}, {"role": "user", "content": "c"}]
    status, out = post(ring, "/v1/messages/count_tokens", {"model": ring.model, "messages": middle})
    reference = chat(ring, messages=middle, max_tokens=1)
    assert status == 200 and out["input_tokens"] == reference.usage.prompt_tokens

    def turns(result_one):
        return [{"role": "user", "content": "Weather in Paris and Rome?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": result_one}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "get_weather",
                                                   "input": {"city": "Rome"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "20 C"}]}]

    edits = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
                        "keep": {"type": "tool_uses", "value": 1}}]}
    base = {"model": ring.model, "tools": A_TOOLS}
    _, cleared = post(ring, "/v1/messages/count_tokens", {**base, "messages": turns("18 C, sunny, a long report " * 20),
                                                          "context_management": edits})
    _, by_hand = post(ring, "/v1/messages/count_tokens", {**base, "messages": turns("[cleared to save context]")})
    _, kept = post(ring, "/v1/messages/count_tokens", {**base, "messages": turns("18 C, sunny, a long report " * 20)})
    assert cleared == by_hand and kept["input_tokens"] > cleared["input_tokens"], (cleared, by_hand, kept)
