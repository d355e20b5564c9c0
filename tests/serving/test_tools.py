"""Tool calling over the OpenAI chat API (serving/tools.py) with the `openai` package: a real
front end over an in-process 2-stage pipeline of a checkpoint whose chat template takes
tools and whose weights always answer with one call (tests/tool_checkpoint.py)."""

import json
from types import SimpleNamespace

import openai
import pytest
from mlx_lm.utils import load_tokenizer

from distributed.runtime.request import RequestError
from distributed.runtime.scheduler import Scheduler
from distributed.serving.http_api import start_http_server
from distributed.serving.options import ServeOptions
from distributed.serving.requests import ModelInfo
from distributed.serving.tools import ToolCallStream, chat_messages
from distributed.shard.config import read_config
from stages import in_process_pipeline
from tool_checkpoint import ADDED, CALL, make_tool_checkpoint

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tool_checkpoint(tmp_path_factory.mktemp("tool_model"))
    pipeline, _ = in_process_pipeline(path, (4, 4))
    tokenizer = load_tokenizer(path, eos_token_ids=read_config(path)["eos_token_id"])
    scheduler = Scheduler(pipeline, tokenizer).start()
    front = start_http_server(ServeOptions(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0"))
    front.attach(scheduler, tokenizer, ModelInfo("tools", read_config(path)["vocab_size"], 1024, 1000))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{front.port}/v1", api_key="none", max_retries=0, timeout=60)
    yield SimpleNamespace(client=client, tokenizer=tokenizer)
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
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in rendered and '"city": "Paris"' in rendered
    assert out.usage.prompt_tokens == len(served.tokenizer.encode(rendered))
    assert out.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_answers_in_text(served):
    out = create(served, messages=ASK, tools=TOOLS, tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == "".join(ADDED)  # no tools in the prompt, nothing parsed
    without = served.tokenizer.apply_chat_template(ASK, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(without)


def test_a_call_cut_short(served):
    out = create(served, messages=ASK, tools=TOOLS, max_tokens=1)  # only the start marker: text
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content == ADDED[0]
    out = create(served, messages=ASK, tools=TOOLS, max_tokens=2)  # a whole call without its end marker
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.tool_calls[0].function.name == CALL["name"]


def test_the_stream_splitter_across_pieces(served):
    """Markers split between pieces, text around calls, two calls, and unparsable markup."""
    stream = ToolCallStream(served.tokenizer, TOOLS)
    text = 'Sure. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and <tool_call>{"name": "b"}</tool_call>!'
    content, calls = "", []
    for i in range(0, len(text), 3):
        c, k = stream.feed(text[i:i + 3])
        content, calls = content + c, calls + k
    c, k = stream.finish()
    assert content + c == "Sure.  and !" and [(x["function"]["name"], x["index"]) for x in calls + k] == [("a", 0), ("b", 1)]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    stream = ToolCallStream(served.tokenizer, TOOLS)
    assert stream.feed("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


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
