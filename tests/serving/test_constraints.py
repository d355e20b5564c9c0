"""Structured output over the OpenAI chat API (serving/constraints.py, runtime/grammar.py)
with the `openai` package against a real 2-rank ring (tests/agent_ring.py): every
schema-constrained reply validates, streamed or not, with n > 1 and sampling; forced tool
calls keep to the named tool's schema and come back as tool_calls; a schema the library
rejects is a 400 naming response_format; max_tokens before the JSON closes is "length"."""

import json

import jsonschema
import openai
import pytest

from agent_ring import TOOLS, start_agent_ring

ASK = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    ns = start_agent_ring(tmp_path_factory)
    ns.client = openai.OpenAI(base_url=f"{ns.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    yield ns
    ns.server.stop()


def chat(ring, **kwargs):
    return ring.client.chat.completions.create(**{"model": ring.model, "messages": ASK, "max_tokens": 120, **kwargs})


def test_json_schema_replies_validate_whole_streamed_and_sampled(ring):
    greedy = chat(ring, temperature=0, response_format=FORMAT)
    assert greedy.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(greedy.choices[0].message.content), PERSON)
    chunks = list(chat(ring, temperature=0, response_format=FORMAT, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == greedy.choices[0].message.content
    sampled = chat(ring, temperature=1.2, seed=3, n=4, response_format=FORMAT)
    assert len(sampled.choices) == 4
    for choice in sampled.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    # Unconstrained, the same message gets the checkpoint's tool-call text, not JSON.
    plain = chat(ring, temperature=0).choices[0].message.content
    assert plain != greedy.choices[0].message.content


def test_json_object_is_an_object_and_length_cuts_it(ring):
    out = chat(ring, temperature=0.8, seed=1, response_format={"type": "json_object"}, max_tokens=400)
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # a random-weight model may write a long string; then it is cut, as OpenAI's is
        assert out.choices[0].message.content.startswith("{")
    short = chat(ring, temperature=0, response_format=FORMAT, max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(short.choices[0].message.content)


def test_forced_tool_calls_keep_to_the_tools_schema(ring):
    named = {"type": "function", "function": {"name": "get_time"}}
    for stream in (False, True):
        if stream:
            chunks = list(chat(ring, temperature=0, tools=TOOLS, tool_choice=named, stream=True))
            (call,) = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
            name, arguments, finish = call.function.name, call.function.arguments, chunks[-1].choices[0].finish_reason
        else:
            choice = chat(ring, temperature=0, tools=TOOLS, tool_choice=named).choices[0]
            assert choice.message.tool_calls, choice
            (call,) = choice.message.tool_calls
            name, arguments, finish = call.function.name, call.function.arguments, choice.finish_reason
        assert name == "get_time" and finish == "tool_calls"
        jsonschema.validate(json.loads(arguments), TOOLS[1]["function"]["parameters"])
    # "required": a call to one of the tools, sampled (a city of at most 12 characters, so
    # that random weights close the string within max_tokens).
    bounded = json.loads(json.dumps(TOOLS))
    bounded[0]["function"]["parameters"]["properties"]["city"]["maxLength"] = 12
    bounded[0]["function"]["parameters"]["additionalProperties"] = False
    for seed in range(4):
        choice = chat(ring, temperature=1.0, seed=seed, tools=bounded, tool_choice="required",
                      parallel_tool_calls=False).choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        call = choice.message.tool_calls[0].function
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in bounded}[call.name]
        jsonschema.validate(json.loads(call.arguments), schema)


def test_strict_tools_under_auto_keep_to_their_schema_once_a_call_opens(ring):
    """openai.pydantic_function_tool() and LangChain's bind_tools(strict=True) send strict tools with
    tool_choice "auto": taken, and a call the model opens keeps to the tool's schema (a lazy grammar:
    free text until <tool_call>). The checkpoint's greedy call is one token, get_weather for Paris;
    here the schema allows only Rome or Oslo, so the grammar has to write the call another way."""
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "strict": True, "parameters": {
            "type": "object", "properties": {"city": {"enum": ["Rome", "Oslo"]}}, "required": ["city"],
            "additionalProperties": False}}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for stream in (False, True):
        out = chat(ring, messages=ask, temperature=0, tools=[weather], tool_choice="auto", stream=stream)
        if stream:
            chunks = list(out)
            calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            calls, content = out.choices[0].message.tool_calls, out.choices[0].message.content
        assert len(calls) == 1 and calls[0].function.name == "get_weather" and not content, (calls, content)
        jsonschema.validate(json.loads(calls[0].function.arguments), weather["function"]["parameters"])
        assert json.loads(calls[0].function.arguments) != {"city": "Paris"}
    free = chat(ring, messages=ask, temperature=0, tools=TOOLS, tool_choice="auto")  # not strict: not constrained
    assert json.loads(free.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "nope"}, "strict": True}}},
     "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_what_cannot_be_constrained_is_a_400_naming_it(ring, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(ring, temperature=0, **fields)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(param), e.value.body
    assert chat(ring, temperature=0, max_tokens=2).choices[0].finish_reason == "length"  # still serving
