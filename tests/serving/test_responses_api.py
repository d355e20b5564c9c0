"""OpenAI's Responses API (serving/responses_api.py) with the `openai` package's
`client.responses` against a real 2-rank ring (tests/agent_ring.py), compared with
/v1/chat/completions on the same ring: the same text and counts, whole and streamed (the
event sequence in order); text.format that validates; a function-call round trip; forced
calls; max_output_tokens as "incomplete"; what is not implemented refused by name."""

import json

import jsonschema
import openai
import pytest

from agent_ring import TOOLS, start_agent_ring
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
    ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wat"}}}}, "text.format"),
    ({"input": [{"type": "image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "reasoning", "id": "rs_1", "summary": [],  # no think tokens
                                                  "content": [{"type": "reasoning_text", "text": "hm"}]}]}, "input[1].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_is_not_implemented_is_refused_by_name(ring, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        respond(ring, **fields)
    assert e.value.body["message"].startswith(param) and e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        respond(ring, extra_body={"frobnicate": 1})
    assert e.value.body["param"] == "frobnicate"
