"""Ollama's API (serving/ollama_api.py) with the `ollama` package against a real 2-rank ring
(tests/agent_ring.py), compared with /v1/chat/completions (and /v1/completions for raw
generate) through the `openai` package on the same ring: the same request gives the same
text and counts; schemas validate; tool calls come back in Ollama's shape; bad input is a
400 {"error": …} naming the field, another model a 404."""

import json
import re
import urllib.error
import urllib.request

import jsonschema
import ollama
import openai
import pytest

from agent_ring import TOOLS, start_agent_ring

ASK = "What is the weather in Paris?"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    ns = start_agent_ring(tmp_path_factory)
    try:
        ns.ollama = ollama.Client(host=ns.base_url, timeout=120)
        ns.openai = openai.OpenAI(base_url=f"{ns.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        yield ns
    finally:
        ns.server.stop()


def post(ring, path, body=None):
    """(status, parsed body) of a plain HTTP request (GET without a body)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(ring.base_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def openai_chat(ring, messages, **kwargs):
    return ring.openai.chat.completions.create(model=ring.model, messages=messages, temperature=0, **kwargs)


def test_tags_show_ps_and_version(ring):
    (model,) = ring.ollama.list().models
    assert model.model == ring.model and re.fullmatch("[0-9a-f]{64}", model.digest)
    assert model.size > 0 and model.modified_at is not None  # the ranks' parameter bytes
    assert model.details.family == "afmoe" and model.details.format == "safetensors"
    assert model.details.quantization_level == "F32" and model.details.parameter_size.endswith("M")
    for name in (ring.model, f"{ring.model}:latest"):
        shown = ring.ollama.show(name)
        assert shown.capabilities == ["completion", "tools"]  # the checkpoint's template takes tools
        assert shown.modelinfo["general.architecture"] == "afmoe"
        assert shown.modelinfo["afmoe.context_length"] == 2048  # the ring's --max-context
        assert shown.modelinfo["afmoe.block_count"] == 8 and "<tool_call>" in shown.template
    (loaded,) = ring.ollama.ps().models
    assert loaded.model == ring.model and loaded.context_length == 2048 and loaded.size == model.size
    assert loaded.digest == model.digest and loaded.expires_at.year == 9999  # never unloaded
    assert post(ring, "/api/version") == (200, {"version": "0.1.0"})  # the client has no call for it


def test_chat_equals_chat_completions_whole_and_streamed(ring):
    messages = [{"role": "user", "content": ASK}]
    want = openai_chat(ring, messages)
    got = ring.ollama.chat(ring.model, messages, options=GREEDY, keep_alive="5m")
    assert got.message.role == "assistant" and got.message.content == want.choices[0].message.content
    assert got.done and got.done_reason == "stop" and got.model == ring.model
    assert got.prompt_eval_count == want.usage.prompt_tokens and got.eval_count == want.usage.completion_tokens
    assert got.load_duration == 0 and all(d >= 0 for d in (got.total_duration, got.prompt_eval_duration,
                                                              got.eval_duration))
    chunks = list(ring.ollama.chat(f"{ring.model}:latest", messages, options=GREEDY, stream=True, keep_alive=-1))
    assert all(not c.done for c in chunks[:-1]) and len(chunks) > 2
    assert "".join(c.message.content for c in chunks) == got.message.content
    last = chunks[-1]
    assert last.done and last.done_reason == "stop" and last.model == f"{ring.model}:latest"
    assert (last.prompt_eval_count, last.eval_count) == (got.prompt_eval_count, got.eval_count)
    assert last.total_duration >= last.eval_duration >= 0


def test_options_map_to_the_chat_fields(ring):
    messages = [{"role": "user", "content": "Tell me a story."}]
    sampled = {"temperature": 1.5, "top_p": 0.9, "top_k": 50, "seed": 7, "num_predict": 12, "repeat_penalty": 1.2,
               "repeat_last_n": 8, "presence_penalty": 0.5, "num_ctx": 2048, "mirostat": 0, "num_keep": 4}
    want = ring.openai.chat.completions.create(
        model=ring.model, messages=messages, temperature=1.5, top_p=0.9, seed=7, max_tokens=12, presence_penalty=0.5,
        extra_body={"top_k": 50, "repetition_penalty": 1.2, "repetition_context_size": 8,
                    "presence_context_size": 8, "frequency_context_size": 8})
    got = ring.ollama.chat(ring.model, messages, options=sampled)
    assert got.message.content == want.choices[0].message.content and got.eval_count == want.usage.completion_tokens
    short = ring.ollama.chat(ring.model, messages, options={**GREEDY, "num_predict": 2})
    assert short.done_reason == "length" and short.eval_count == 2
    stopped = ring.ollama.chat(ring.model, messages, options={**GREEDY, "stop": ['"city"']})
    assert stopped.done_reason == "stop" and stopped.message.content == \
        openai_chat(ring, messages, stop=['"city"']).choices[0].message.content
    default = openai_chat(ring, messages).usage.completion_tokens  # chat's default length: the context's rest
    for unlimited in (-1, -2):
        assert ring.ollama.chat(ring.model, messages, options={**GREEDY, "num_predict": unlimited}).eval_count == default


def test_generate_equals_chat_of_one_user_message(ring):
    chat = ring.ollama.chat(ring.model, [{"role": "user", "content": ASK}], options=GREEDY)
    got = ring.ollama.generate(ring.model, ASK, options=GREEDY)
    assert got.response == chat.message.content and got.done_reason == "stop"
    assert (got.prompt_eval_count, got.eval_count) == (chat.prompt_eval_count, chat.eval_count)
    chunks = list(ring.ollama.generate(ring.model, ASK, options=GREEDY, stream=True))
    assert "".join(c.response for c in chunks) == got.response and chunks[-1].done and not chunks[0].done
    system = "You are terse."
    with_system = ring.ollama.generate(ring.model, ASK, system=system, options=GREEDY)
    want = openai_chat(ring, [{"role": "system", "content": system}, {"role": "user", "content": ASK}])
    assert with_system.response == want.choices[0].message.content
    assert with_system.prompt_eval_count == want.usage.prompt_tokens > got.prompt_eval_count


def test_raw_generate_is_a_completion_of_the_prompt_as_is(ring):
    prompt = "Once upon a time"
    want = ring.openai.completions.create(model=ring.model, prompt=prompt, temperature=0, max_tokens=10)
    got = ring.ollama.generate(ring.model, prompt, raw=True, options={**GREEDY, "num_predict": 10})
    assert got.response == want.choices[0].text and got.prompt_eval_count == want.usage.prompt_tokens
    assert got.done_reason == ("length" if want.choices[0].finish_reason == "length" else "stop")
    chunks = list(ring.ollama.generate(ring.model, prompt, raw=True, stream=True, options={**GREEDY, "num_predict": 10}))
    assert "".join(c.response for c in chunks) == got.response


def test_format_schema_validates_and_json_is_an_object(ring):
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    whole = ring.ollama.chat(ring.model, messages, format=PERSON, options=GREEDY)
    assert whole.done_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), PERSON)
    chunks = list(ring.ollama.chat(ring.model, messages, format=PERSON, options=GREEDY, stream=True))
    assert "".join(c.message.content for c in chunks) == whole.message.content
    generated = ring.ollama.generate(ring.model, "Describe a person as JSON.", format=PERSON,
                                     options={"temperature": 1.0, "seed": 3})
    jsonschema.validate(json.loads(generated.response), PERSON)
    json_mode = ring.ollama.chat(ring.model, messages, format="json", options={**GREEDY, "num_predict": 300})
    want = openai_chat(ring, messages, response_format={"type": "json_object"}, max_tokens=300)
    assert json_mode.message.content == want.choices[0].message.content
    if json_mode.done_reason == "stop":
        assert isinstance(json.loads(json_mode.message.content), dict)
    else:  # random weights may write one long string; it is cut as the OpenAI one is
        assert json_mode.message.content.startswith("{")


def test_tool_calls_in_ollamas_shape_and_tool_results_in_history(ring):
    messages = [{"role": "user", "content": ASK}]
    got = ring.ollama.chat(ring.model, messages, tools=TOOLS, options=GREEDY)
    (call,) = got.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert got.done_reason == "stop" and got.message.content == ""
    chunks = list(ring.ollama.chat(ring.model, messages, tools=TOOLS, options=GREEDY, stream=True))
    calls = [t for c in chunks for t in c.message.tool_calls or []]
    assert [(t.function.name, dict(t.function.arguments)) for t in calls] == [("get_weather", {"city": "Paris"})]
    history = messages + [{"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                          {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"}]
    after = ring.ollama.chat(ring.model, history, tools=TOOLS, options=GREEDY)
    # The client sends its own Tool model of each (which drops what it has no field for, as additionalProperties).
    sent = [ollama.Tool.model_validate(t).model_dump(exclude_none=True) for t in TOOLS]
    want = openai_chat(ring, messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "c1"}], tools=sent)
    assert after.prompt_eval_count == want.usage.prompt_tokens  # the same prompt
    assert after.message.content == (want.choices[0].message.content or "")
    assert [(c.function.name, dict(c.function.arguments)) for c in after.message.tool_calls or []] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in want.choices[0].message.tool_calls or []]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": False}
BAD = [
    ("/api/chat", {"options": {"mirostat": 2}}, "options.mirostat"),
    ("/api/chat", {"options": {"num_ctx": "big"}}, "options.num_ctx"),
    ("/api/chat", {"options": {"warp": 1}}, "options.warp"),
    ("/api/chat", {"options": {"num_predict": "many"}}, "options.num_predict"),
    ("/api/chat", {"options": {"temperature": "hot"}}, "options.temperature"),
    ("/api/chat", {"options": {"repeat_last_n": 0}}, "options.repeat_last_n"),
    ("/api/chat", {"think": "max"}, "think"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "thinking": "hm"}, {"role": "user", "content": "y"}]},
     "messages[0].thinking"),
    ("/api/chat", {"format": 3}, "format"),
    ("/api/chat", {"format": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "format"),
    ("/api/chat", {"logprobs": True}, "logprobs"),
    ("/api/chat", {"stream": "yes"}, "stream"),
    ("/api/chat", {"colour": "red"}, "colour"),
    ("/api/chat", {"messages": []}, "messages"),
    ("/api/chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "messages[0].images"),
    ("/api/chat", {"tools": [{"type": "function"}]}, "tools[0]"),
    ("/api/generate", {"prompt": ""}, "prompt"),
    ("/api/generate", {"images": ["aGk="]}, "images"),
    ("/api/generate", {"suffix": "end"}, "suffix"),
    ("/api/generate", {"context": [1, 2]}, "context"),
    ("/api/generate", {"template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"raw": True, "system": "be brief"}, "system"),
    ("/api/generate", {"options": {"num_predict": -5}}, "options.num_predict"),
    ("/api/generate", {"options": {"num_predict": 0}}, "options.num_predict"),
    ("/api/generate", {"keep_alive": {"minutes": 5}}, "keep_alive"),
    ("/api/generate", {"raw": True, "format": "json"}, "format"),
]


@pytest.mark.parametrize("path, fields, name", BAD, ids=[f"{p[5:]}-{n}" for p, _, n in BAD])
def test_bad_input_is_400_naming_the_field(ring, path, fields, name):
    body = {"model": ring.model, "stream": False, **({"prompt": "hi"} if path == "/api/generate" else CHAT), **fields}
    status, answer = post(ring, path, body)
    assert status == 400 and list(answer) == ["error"] and answer["error"].startswith(f"{name}: ")


def test_errors_through_the_client_and_the_server_keeps_serving(ring):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ollama.ResponseError) as e:
        ring.ollama.chat(ring.model, messages, options={"warp": 1})
    assert e.value.status_code == 400 and e.value.error.startswith("options.warp: ")
    # What changes nothing here is taken (and named in the access log): load-time options, another
    # num_ctx, think where the checkpoint does not think.
    answer = ring.ollama.chat(ring.model, messages, options={"num_gpu": 1, "num_ctx": 4096, "num_predict": 2}, think=True)
    assert answer.done and not answer.message.thinking
    for call in (lambda: ring.ollama.chat("llama3.2", messages), lambda: ring.ollama.show("llama3.2:latest"),
                 lambda: ring.ollama.generate(f"{ring.model}:v2", "hi")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404 and re.fullmatch(r"model '.+' not found", e.value.error)
    assert post(ring, "/api/chat", {**CHAT, "model": "nope"}) == (404, {"error": "model 'nope' not found"})
    status, answer = post(ring, "/api/chat", CHAT)
    assert status == 400 and answer["error"].startswith("model: ")
    status, answer = post(ring, "/api/pull", {"model": "llama3.2"})
    assert status == 501 and "/api/pull" in answer["error"]
    assert post(ring, "/api/show", {"name": ring.model})[0] == 200  # Ollama's older spelling
    status, answer = post(ring, "/api/show", {"model": ring.model, "verbose": True})
    assert status == 400 and answer["error"].startswith("verbose: ")
    assert ring.ollama.chat(ring.model, messages, options={**GREEDY, "num_predict": 3}).eval_count == 3
