"""One meaning on every path: through the launcher's router (`python -m launch run --single-host 2
-- run_trinity.py --serve … --http …`) a constrained request is constrained as on rank 0's own
port: response_format json_schema and json_object, tool_choice "required", the Responses API's
text.format. The router forwards the request's grammar to rank 0 (serving/wire.py)."""

import json

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


def test_a_bad_schema_is_a_400_naming_the_field_through_the_router(router):
    with pytest.raises(openai.BadRequestError) as e:
        chat(router, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}})
    assert e.value.body["param"].startswith("response_format"), e.value.body
    assert chat(router, max_tokens=2).usage.completion_tokens == 2  # and the router serves on
