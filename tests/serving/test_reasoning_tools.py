"""Trinity-Large-Thinking's agent turn, reasoning and then a tool call, through every API,
streamed and not, in both tool-call forms mlx-lm parses (json_tools, qwen3_coder): an
in-process 2-stage pipeline of the thinking tiny checkpoint whose template also takes tools
(tests/tool_checkpoint.py: after REASONING and </think> it calls get_weather). What a client
sends back (the reasoning and the call, then the result) is what the template renders."""

from types import SimpleNamespace

import anthropic
import ollama
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from distributed.runtime.scheduler import Scheduler
from distributed.serving.http_api import start_http_server
from distributed.serving.options import ServeOptions
from distributed.serving.chat_format import ModelInfo
from distributed.shard.config import read_config
from stages import in_process_pipeline
from tool_checkpoint import CALL, FORMS, REASONING, make_think_checkpoint

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT = "".join(REASONING)


@pytest.fixture(scope="module", params=sorted(FORMS))
def served(request, tmp_path_factory):
    path = make_think_checkpoint(tmp_path_factory.mktemp("think_tools"), request.param)
    pipeline, _ = in_process_pipeline(path, (4, 4))
    tokenizer = load_tokenizer(path, eos_token_ids=read_config(path)["eos_token_id"])
    scheduler = Scheduler(pipeline, tokenizer).start()
    front = start_http_server(ServeOptions(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0"))
    front.attach(scheduler, tokenizer, ModelInfo("think", read_config(path)["vocab_size"], 4096, 4000))
    base = f"http://127.0.0.1:{front.port}"
    yield SimpleNamespace(
        tokenizer=tokenizer,
        openai=openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60),
        anthropic=anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=60),
        ollama=ollama.Client(host=base, timeout=60))
    front.stop()
    scheduler.close()


def after_the_call(served, call_id: str) -> int:
    """The prompt's length once the client sends back the reasoning, the call and its result."""
    messages = [*ASK, {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": CALL["name"], "arguments": CALL["arguments"]}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "18 C"}]
    return len(served.tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True))


def test_chat(served):
    create = served.openai.chat.completions.create
    out = create(model="think", messages=ASK, tools=TOOLS, temperature=0, max_tokens=16)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == THOUGHT
    (call,) = choice.message.tool_calls
    assert call.function.name == CALL["name"] and choice.message.content is None
    assert out.usage.completion_tokens_details.reasoning_tokens == 3

    chunks = list(create(model="think", messages=ASK, tools=TOOLS, temperature=0, max_tokens=16, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)] == REASONING
    assert [t.function.name for d in deltas for t in d.tool_calls or []] == [CALL["name"]]
    assert not "".join(d.content or "" for d in deltas) and chunks[-1].choices[0].finish_reason == "tool_calls"

    history = [*ASK, choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    again = create(model="think", messages=history, tools=TOOLS, temperature=0, max_tokens=16)
    assert again.usage.prompt_tokens == after_the_call(served, call.id)


def test_responses(served):
    client = served.openai
    args = dict(model="think", input="Weather in Paris?", tools=[{"type": "function", **TOOLS[0]["function"]}],
                temperature=0, max_output_tokens=16)
    out = client.responses.create(**args)
    assert [item.type for item in out.output] == ["reasoning", "function_call"]
    assert out.output[0].content[0].text == THOUGHT and out.output[1].name == CALL["name"]
    with client.responses.stream(**args) as s:
        kinds = [(e.type, getattr(getattr(e, "item", None), "type", None)) for e in s]
    done = [item for kind, item in kinds if kind == "response.output_item.done"]
    assert done == ["reasoning", "function_call"]

    call = out.output[1]
    again = client.responses.create(**{**args, "input": [
        *ASK, *[item.model_dump(exclude_none=True) for item in out.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]})
    assert again.usage.input_tokens == after_the_call(served, call.call_id)


def test_messages(served):
    client = served.anthropic
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": TOOLS[0]["function"]["parameters"]}]
    args = dict(model="think", max_tokens=16, messages=ASK, tools=tools, extra_body={"temperature": 0})
    out = client.messages.create(**args)
    assert [b.type for b in out.content] == ["thinking", "tool_use"] and out.stop_reason == "tool_use"
    assert out.content[0].thinking == THOUGHT and out.content[1].input == CALL["arguments"]
    with client.messages.stream(**args) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.content[0].thinking == THOUGHT

    use = out.content[1]
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in out.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
    counted = client.messages.count_tokens(model="think", messages=history, tools=tools)
    assert counted.input_tokens == after_the_call(served, use.id)


def test_ollama(served):
    out = served.ollama.chat("think", messages=ASK, tools=TOOLS, options={"temperature": 0, "num_predict": 16})
    assert out.message.thinking == THOUGHT and not out.message.content
    assert [(c.function.name, dict(c.function.arguments)) for c in out.message.tool_calls] == [(CALL["name"], CALL["arguments"])]
    lines = list(served.ollama.chat("think", messages=ASK, tools=TOOLS, stream=True,
                                    options={"temperature": 0, "num_predict": 16}))
    assert [x.message.thinking for x in lines if x.message.thinking] == REASONING
    assert [c.function.name for x in lines for c in x.message.tool_calls or []] == [CALL["name"]]
