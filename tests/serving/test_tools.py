"""Tool calling over the OpenAI chat API (serving/tools.py, the calls split out by
chat_format.py) with the `openai` package: a real front end over an in-process 2-stage
pipeline of a checkpoint whose chat template takes tools and whose weights always answer
with one call (tests/tool_checkpoint.py), in both of the forms mlx-lm parses: json_tools'
and qwen3_coder's."""

import json
from types import SimpleNamespace

import openai
import pytest
from mlx_lm.utils import load_tokenizer

from distributed.runtime.request import RequestError
from distributed.runtime.scheduler import Scheduler
from distributed.serving.http_api import start_http_server
from distributed.serving.options import ServeOptions
from distributed.serving.chat_format import ModelInfo, ReplySplitter
from distributed.serving.tools import chat_messages, request_tools
from distributed.shard.config import read_config
from stages import in_process_pipeline
from tool_checkpoint import CALL, FORMS, make_tool_checkpoint

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
GET_TIME = {"type": "function", "function": {"name": "get_time", "description": "Time in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module", params=sorted(FORMS))
def served(request, tmp_path_factory):
    path = make_tool_checkpoint(tmp_path_factory.mktemp("tool_model"), request.param)
    pipeline, _ = in_process_pipeline(path, (4, 4))
    tokenizer = load_tokenizer(path, eos_token_ids=read_config(path)["eos_token_id"])
    scheduler = Scheduler(pipeline, tokenizer).start()
    front = start_http_server(ServeOptions(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0"))
    front.attach(scheduler, tokenizer, ModelInfo("tools", read_config(path)["vocab_size"], 1024, 1000))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{front.port}/v1", api_key="none", max_retries=0, timeout=60)
    yield SimpleNamespace(client=client, tokenizer=tokenizer, form=request.param, added=FORMS[request.param][0])
    front.stop()
    scheduler.close()


def create(served, **kwargs):
    return served.client.chat.completions.create(**{"model": "tools", "temperature": 0, "max_tokens": 8, **kwargs})


def test_a_tool_call_comes_back_as_tool_calls(served):
    out = create(served, messages=ASK, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == CALL["name"] and json.loads(call.function.arguments) == CALL["arguments"]
    prompt = served.tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(prompt)  # the tools reached the chat template

    chunks = list(create(served, messages=ASK, tools=TOOLS, tool_choice="auto", stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    (streamed,) = [t for d in deltas for t in d.tool_calls or []]
    assert streamed.index == 0 and streamed.function.name == CALL["name"]
    assert json.loads(streamed.function.arguments) == CALL["arguments"]
    assert not "".join(d.content or "" for d in deltas)  # the call's markup is not content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_round_trip(served):
    call = create(served, messages=ASK, tools=TOOLS).choices[0].message
    messages = [*ASK, call.model_dump(exclude_none=False),  # the reply's message, sent back as it came
                {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "18 C, sunny"}]
    out = create(served, messages=messages, tools=TOOLS)
    rendered = served.tokenizer.apply_chat_template(chat_messages(messages), tools=TOOLS, add_generation_prompt=True,
                                                    tokenize=False)
    call_text = {"json_tools": '"city": "Paris"', "qwen3_coder": "<parameter=city>\nParis\n</parameter>"}[served.form]
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in rendered and call_text in rendered
    assert out.usage.prompt_tokens == len(served.tokenizer.encode(rendered))
    assert out.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_answers_in_text(served):
    out = create(served, messages=ASK, tools=TOOLS, tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == "".join(served.added)  # no tools in the prompt, nothing parsed
    without = served.tokenizer.apply_chat_template(ASK, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(without)


def test_a_call_cut_short(served):
    out = create(served, messages=ASK, tools=TOOLS, max_tokens=1)  # only the start marker: dropped, never raw markup
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == ""
    out = create(served, messages=ASK, tools=TOOLS, max_tokens=2)  # a whole call without its end marker
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.tool_calls[0].function.name == CALL["name"]


CALLS_TEXT = {  # two calls, text around them, in each form
    "json_tools": 'Sure. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and <tool_call>{"name": "b"}</tool_call>!',
    "qwen3_coder": "Sure. <tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call> and "
                   "<tool_call>\n<function=b>\n</function>\n</tool_call>!",
}


def test_the_stream_splitter_across_pieces(served):
    """Markers split between pieces, text around calls, two calls, and unparsable markup."""
    stream = ReplySplitter(served.tokenizer, TOOLS)
    text = CALLS_TEXT[served.form]
    content, calls = "", []
    for i in range(0, len(text), 3):
        _, c, k = stream.feed(text[i:i + 3])
        content, calls = content + c, calls + k
    _, c, k = stream.finish()
    assert content + c == "Sure.  and !" and [(x["function"]["name"], x["index"]) for x in calls + k] == [("a", 0), ("b", 1)]
    # qwen3_coder's values are strings unless the tool's schema types them
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1 if served.form == "json_tools" else "1"}
    stream = ReplySplitter(served.tokenizer, TOOLS)
    assert stream.feed("<tool_call>not a call</tool_call>") == ("", "<tool_call>not a call</tool_call>", [])


@pytest.mark.parametrize("messages, field", [
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"type": "custom"}]}], "messages[0].tool_calls[0]"),
    ([], "messages"),
])
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(RequestError) as e:
        chat_messages(messages)
    assert e.value.field == field


def test_reasoning_in_the_history_needs_think_tokens(served):
    """This tokenizer has no think tokens: its template has no place for reasoning, so it is refused, not dropped."""
    history = [*ASK, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."}, *ASK]
    with pytest.raises(openai.BadRequestError) as e:
        create(served, messages=history)
    assert e.value.body["param"] == "messages[1].reasoning_content" and "think tokens" in e.value.body["message"]


def allowed(mode: str, *names) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [
        {"type": "function", "function": {"name": name}} for name in names]}}


def test_allowed_tools(served):
    """Every tool stays in the prompt; under "auto" a call, once opened, is to an allowed one
    (json_tools' added-token markers: a lazy grammar; another form: not held), "required" forces one."""
    tools = [*TOOLS, GET_TIME]
    out = create(served, messages=ASK, tools=tools, tool_choice=allowed("auto", "get_weather"))
    assert [c.function.name for c in out.choices[0].message.tool_calls] == [CALL["name"]]
    prompt = served.tokenizer.apply_chat_template(ASK, tools=tools, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(prompt)
    out = create(served, messages=ASK, tools=tools, tool_choice=allowed("auto", "get_time"))
    names = [c.function.name for c in out.choices[0].message.tool_calls or []]
    assert (CALL["name"] not in names) if served.form == "json_tools" else names == [CALL["name"]], names
    if served.form == "json_tools":  # a forced call needs json_tools' syntax
        out = create(served, messages=ASK, tools=tools, tool_choice=allowed("required", "get_weather"), max_tokens=40)
        assert [c.function.name for c in out.choices[0].message.tool_calls] == [CALL["name"]]
    with pytest.raises(openai.BadRequestError) as e:
        create(served, messages=ASK, tools=tools, tool_choice=allowed("required", "get_weather", "nope"))
    assert e.value.body["param"] == "tool_choice.allowed_tools.tools[1]", e.value.body


@pytest.mark.parametrize("tools, choice, field", [
    ([{"type": "custom", "name": "edit"}], None, "tools[0].name"),  # the Responses API's form
    ([{"type": "custom", "custom": {"name": "edit", "format": {"type": "json"}}}], None, "tools[0].custom.format"),
    ([{"type": "custom", "custom": {"name": "edit", "format": {"type": "grammar", "syntax": "lark", "definition": "x"}}}],
     None, "tools[0].custom.format.grammar"),
    ([{"type": "custom", "custom": {"name": "edit", "format": {"type": "grammar", "grammar": {
        "syntax": "lark", "definition": "start: /(?=a)a/"}}}}], "none", "tools[0].custom.format.grammar.definition"),
])
def test_bad_custom_tools_name_the_field(served, tools, choice, field):
    with pytest.raises(RequestError) as e:
        request_tools(tools, choice, served.tokenizer)
    assert e.value.field == field


def test_a_custom_call_in_the_history_is_its_function_call():
    call = {"id": "call_1", "type": "custom", "custom": {"name": "edit", "input": "a\nb"}}
    (message,) = chat_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    function = {"name": "edit", "arguments": {"input": "a\nb"}}  # an object, as the template takes arguments
    assert message["tool_calls"] == [{"id": "call_1", "type": "function", "function": function}]
