"""One meaning on every path: through the launcher's router (`python -m launch run --single-host 2
-- run_trinity.py --serve … --http …`) a constrained request is constrained as on rank 0's own
port: response_format json_schema and json_object, tool_choice "required", the Responses API's
text.format. The router forwards the request's grammar to rank 0 (serving/wire.py)."""

import json
import re

import jsonschema
import openai
import pytest

from agent_ring import TOOLS
from router_launcher import Launcher, serving
from tool_checkpoint import make_tool_checkpoint

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
BOUNDED = [{"type": "function", "function": {  # its arguments bounded: the tiny model spells them byte by byte
    "name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}}, TOOLS[1]]


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    model = make_tool_checkpoint(tmp_path_factory.mktemp("agent_model"))
    with serving(Launcher(model, tmp_path_factory.mktemp("router") / "launch.log", 2)) as la:
        la.model = str(model)
        la.client = openai.OpenAI(base_url=f"http://{la.http}/v1", api_key="none", max_retries=0, timeout=120)
        yield la


def chat(router, **kwargs):
    return router.client.chat.completions.create(**{"model": router.model, "messages": ASK, "temperature": 0,
                                                    "max_tokens": 120, **kwargs})


def test_response_format_is_constrained_through_the_router(router):
    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out = chat(router, response_format=form)
    assert out.choices[0].finish_reason == "stop", out
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    out = chat(router, response_format={"type": "json_object"}, max_tokens=300, temperature=0.7, seed=3)
    assert out.choices[0].message.content.startswith("{")
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(router, response_format=form, stream=True)
                       if c.choices)
    jsonschema.validate(json.loads(streamed), PERSON)
    response = router.client.responses.create(model=router.model, input=ASK[0]["content"], temperature=0,
                                              max_output_tokens=120, text={"format": {"type": "json_schema",
                                                                                      "name": "p", "schema": PERSON}})
    jsonschema.validate(json.loads(response.output_text), PERSON)


def test_tool_choice_required_is_constrained_through_the_router(router):
    for choice, name in (("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")):
        out = chat(router, tools=BOUNDED, tool_choice=choice, parallel_tool_calls=False)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1, out
        tool = next(t["function"] for t in BOUNDED if t["function"]["name"] == calls[0].function.name)
        assert name in (None, tool["name"])
        jsonschema.validate(json.loads(calls[0].function.arguments), tool["parameters"])
        assert not out.choices[0].message.content  # no stray newline beside the call


def test_bad_input_is_a_400_naming_the_field_through_the_router(router):
    with pytest.raises(openai.BadRequestError) as e:
        chat(router, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}})
    assert e.value.body["param"].startswith("response_format"), e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # a nested part of the wrong type (parts.py), however deep
        chat(router, messages=[{"role": "user", "content": [{"type": "text", "text": 7}]}])
    assert e.value.body["param"] == "messages[0].content[0].text", e.value.body
    assert chat(router, max_tokens=2).usage.completion_tokens == 2  # and the router serves on


def test_a_custom_tools_grammar_holds_through_the_router(router):
    """OpenAI's free-form (custom) tool on chat completions, its regex grammar over the call's input:
    forced, the call comes back as a custom call whose input the grammar takes, as on rank 0's port."""
    zone = {"type": "custom", "custom": {"name": "set_zone", "description": "Set the time zone", "format": {
        "type": "grammar", "grammar": {"syntax": "regex", "definition": "(UTC|CET|PST)[+-][0-9]"}}}}
    for stream in (False, True):
        kwargs = dict(tools=[*BOUNDED, zone], tool_choice={"type": "custom", "custom": {"name": "set_zone"}})
        if stream:
            chunks = list(chat(router, stream=True, **kwargs))
            (call,) = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
            assert call.type == "custom" and chunks[-1].choices[0].finish_reason == "tool_calls", chunks
            assert call.custom == {"name": "set_zone", "input": whole.input}  # (a dict: the package's delta type)
            continue
        out = chat(router, **kwargs)
        (whole,) = [c.custom for c in out.choices[0].message.tool_calls if c.type == "custom"]
        assert out.choices[0].finish_reason == "tool_calls" and whole.name == "set_zone", out
        assert re.fullmatch("(UTC|CET|PST)[+-][0-9]", whole.input), whole.input
