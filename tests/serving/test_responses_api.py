"""OpenAI's Responses API (serving/responses_api.py) with the `openai` package's
`client.responses` against a real 2-rank ring (tests/agent_ring.py), compared with
/v1/chat/completions on the same ring: the same text and counts, whole and streamed (the
event sequence in order); text.format that validates; a function-call round trip; forced
calls; max_output_tokens as "incomplete"; what is not implemented refused by name."""

import json
import re
import urllib.request

import jsonschema
import openai
import pytest

from agent_ring import TOOLS, access_line, access_lines, start_agent_ring
from tool_checkpoint import CALL

ASK = "What is the weather in Paris?"
R_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
            "parameters": t["function"]["parameters"], "strict": False} for t in TOOLS]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    ns = start_agent_ring(tmp_path_factory)
    try:
        ns.client = openai.OpenAI(base_url=f"{ns.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        yield ns
    finally:
        ns.server.stop()


def respond(ring, **kwargs):
    return ring.client.responses.create(**{"model": ring.model, "input": ASK, "temperature": 0,
                                           "max_output_tokens": 40, **kwargs})


def chat(ring, messages, **kwargs):
    return ring.client.chat.completions.create(**{"model": ring.model, "messages": messages, "temperature": 0,
                                                  "max_tokens": 40, **kwargs})


def test_text_equals_chat_completions_whole_and_streamed(ring):
    out = respond(ring, instructions="Be brief.")
    ref = chat(ring, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}])
    assert out.status == "completed" and out.output_text == ref.choices[0].message.content
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert out.usage.input_tokens == ref.usage.prompt_tokens and out.usage.output_tokens == ref.usage.completion_tokens
    assert out.usage.total_tokens == ref.usage.total_tokens and out.id.startswith("resp_")
    with ring.client.responses.stream(model=ring.model, input=ASK, instructions="Be brief.", temperature=0,
                                      max_output_tokens=40) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    order = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
             "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [kinds.index(k) for k in order] == sorted(kinds.index(k) for k in order)
    assert final.output_text == out.output_text and final.usage.output_tokens == out.usage.output_tokens


def test_items_as_input_equal_messages(ring):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    ref = chat(ring, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": ASK}])
    assert respond(ring, input=items).output_text == ref.choices[0].message.content


def test_text_format_json_schema_validates_whole_and_streamed(ring):
    form = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    out = respond(ring, text=form, max_output_tokens=80)
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), PERSON)
    with ring.client.responses.stream(model=ring.model, input=ASK, temperature=0, max_output_tokens=80, text=form) as s:
        final = s.get_final_response()
    assert final.output_text == out.output_text
    obj = respond(ring, text={"format": {"type": "json_object"}}, max_output_tokens=300, temperature=0.7)
    assert obj.output_text.startswith("{")


def test_a_function_call_round_trip_and_forced_calls(ring):
    out = respond(ring, tools=R_TOOLS)
    (call,) = out.output
    assert call.type == "function_call" and call.name == CALL["name"] and json.loads(call.arguments) == CALL["arguments"]
    history = [{"role": "user", "content": ASK},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    second = respond(ring, tools=R_TOOLS, input=history)
    ref = chat(ring, [{"role": "user", "content": ASK},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": call.call_id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}]},
                      {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}], tools=TOOLS)
    assert second.usage.input_tokens == ref.usage.prompt_tokens > out.usage.input_tokens
    forced = dict(tools=[{**t, "strict": True} for t in R_TOOLS], tool_choice={"type": "function", "name": "get_time"},
                  max_output_tokens=120)
    out = respond(ring, **forced)
    (call,) = out.output
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TOOLS[1]["function"]["parameters"])
    with ring.client.responses.stream(model=ring.model, input=ASK, temperature=0, **forced) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and final.output[0].arguments == call.arguments


def test_max_output_tokens_is_incomplete(ring):
    out = respond(ring, max_output_tokens=2)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 2


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort"),
    ({"reasoning": {"frobnicate": "x"}}, "reasoning.frobnicate"),
    ({"include": "reasoning.encrypted_content"}, "include"),
    ({"background": True}, "background"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wat"}}}}, "text.format"),
    ({"input": [{"type": "image", "image_url": "x"}]}, "input[0].type"),
    ({"tools": [{"type": "custom", "name": "patch", "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}}]},
     "tools[0].format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_is_not_implemented_is_refused_by_name(ring, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        respond(ring, **fields)
    assert e.value.body["message"].startswith(param) and e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        respond(ring, extra_body={"frobnicate": 1})
    assert e.value.body["param"] == "frobnicate"


# Codex CLI's first request (wire_api "responses", `codex exec "say hello"`), trimmed: what it sends by default.
CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Runs a shell command", "strict": False,
     "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                    "required": ["command"], "additionalProperties": False}},
    {"type": "namespace", "name": "mcp__weather", "description": "An MCP server's tools",
     "tools": [{**R_TOOLS[0], "strict": False, "parameters": {  # bounded: the tiny model spells it byte by byte
         "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
         "additionalProperties": False}}]},
    {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch",
     "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/ "*** End Patch"'}},
    {"type": "web_search", "external_web_access": False},
]
CODEX = dict(instructions="You are Codex.", tools=CODEX_TOOLS, tool_choice="auto", parallel_tool_calls=False,
             reasoning={"effort": "medium", "summary": "auto"}, store=False, stream=True,
             include=["reasoning.encrypted_content"], prompt_cache_key="thread-1", text={"verbosity": "low"},
             client_metadata={"x-codex-installation-id": "abc"})


def test_codex_request_is_served_and_its_ignored_fields_logged(ring):
    """Codex's request as it comes: accepted; what changes nothing here is named in the access log."""
    before = len(access_lines(ring, "/v1/responses"))
    with ring.client.responses.stream(model=ring.model, input=[{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": ASK}]}], temperature=0, max_output_tokens=40,
            **{k: v for k, v in CODEX.items() if k not in ("stream", "client_metadata")},
            extra_body={"client_metadata": CODEX["client_metadata"]}) as stream:
        final = list(stream)[-1].response
    # A call the model opens keeps to its tool (apply_patch's grammar makes a lazy one): it may not close
    # in 40 tokens, and a call cut short is left out.
    assert final.status == "incomplete" or final.status == "completed" and final.output, final
    line = access_line(ring, "/v1/responses", before)
    for name in ("reasoning.effort", "reasoning.summary", "tools.web_search", "text.verbosity", "client_metadata",
                 "prompt_cache_key"):
        assert name in line, line
    with urllib.request.urlopen(f"{ring.base_url}/metrics", timeout=30) as r:
        scrape = r.read().decode()
    assert 'trinity_ignored_fields_total{field="tools.web_search"}' in scrape


def test_namespace_and_custom_tools_map_back(ring):
    """A namespace's tool is called by its flattened name and comes back with its namespace; a custom
    (free-form) tool's call is a custom_tool_call whose input keeps to a regex grammar."""
    out = respond(ring, tools=CODEX_TOOLS[1:2], tool_choice="required", max_output_tokens=120)
    (call,) = out.output
    assert call.type == "function_call" and call.name == "get_weather" and call.to_dict()["namespace"] == "mcp__weather"
    history = [{"role": "user", "content": ASK}, call.to_dict(),
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]
    assert respond(ring, tools=CODEX_TOOLS[1:2], input=history).status == "completed"
    custom = {"type": "custom", "name": "count", "description": "Counts",
              "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{1,3} items"}}
    out = respond(ring, tools=[custom], tool_choice={"type": "custom", "name": "count"}, max_output_tokens=120)
    (call,) = out.output
    assert call.type == "custom_tool_call" and call.name == "count" and re.fullmatch("[0-9]{1,3} items", call.input), call
    history = [{"role": "user", "content": ASK}, call.to_dict(),
               {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "done"}]
    # taken back as input (a call it opens now keeps to the grammar: it may not close within 40 tokens)
    assert respond(ring, tools=[custom], input=history).status in ("completed", "incomplete")
    with ring.client.responses.stream(model=ring.model, input=ASK, temperature=0, max_output_tokens=120,
                                      tools=[custom], tool_choice={"type": "custom", "name": "count"}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.custom_tool_call_input.done" in kinds and final.output[0].input == call.input


def test_a_forced_call_has_no_stray_message_item(ring):
    for stream in (False, True):
        forced = dict(tools=R_TOOLS, tool_choice="required", max_output_tokens=120)
        if stream:
            with ring.client.responses.stream(model=ring.model, input=ASK, temperature=0, **forced) as s:
                out = s.get_final_response()
        else:
            out = respond(ring, **forced)
        assert [item.type for item in out.output] == ["function_call"], out.output
