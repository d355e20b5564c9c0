"""A custom tool's Lark grammar through a real 2-rank ring: Codex CLI's apply_patch
(codex_apply_patch.lark) constrains the input of a call the model makes to it, forced and under
tool_choice "auto", so the patch parses; the same weights unconstrained write one that does not.
Both APIs that have custom tools: the Responses API (custom_tool_call items) and chat
completions (tool_calls of type "custom"), each with the real `openai` client.

The checkpoint is a bigram chain (tool_checkpoint.py) whose greedy reply is an apply_patch call
with a hunk no patch has ("*** Frobnicate File: …"); its second choice after the hunk before is
the patch's end. Unconstrained, the reply is the chain; constrained, the grammar forbids the bad
hunk and the model takes its second choice: a whole, valid patch, then the call's close."""

import json
from pathlib import Path

import llguidance
import llguidance.hf
import mlx.core as mx
import openai
import pytest
from mlx_lm.utils import load_tokenizer
from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageCustomToolCall
from tokenizers import Tokenizer

from distributed.serving.tools import chat_messages, request_tools
from grpc_server import SERVER_ARGS, Server
from tool_checkpoint import TOOL_TEMPLATE, _chain_checkpoint

APPLY_PATCH = (Path(__file__).parent / "codex_apply_patch.lark").read_text()
HEAD = '{"name": "apply_patch", "arguments": {"input": "'
# Where the grammar forces text ("*** Begin Patch\\n*** "), llguidance allows the tokens that
# text is tokenized into: so are the links cut.
GOOD = ["*** Begin Patch\\n", "*** ", "Add File: hello.txt\\n", '+Hello, \\"world\\"\\n']
BAD, END = "*** Frobnicate File: x\\n", "*** End Patch\\n"
LINKS = ["\n", "<tool_call>", HEAD, *GOOD, BAD, END, '"}}', "</tool_call>", "<|im_end|>"]
PATCH = json.loads('"' + "".join(GOOD) + END + '"')  # what the constrained call's input is
TOOL = {"type": "custom", "name": "apply_patch", "description": "Edit files",
        "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH}}
CHAT_TOOL = {"type": "custom", "custom": {"name": "apply_patch", "description": "Edit files", "format": {
    "type": "grammar", "grammar": {"syntax": "lark", "definition": APPLY_PATCH}}}}  # chat completions' form
READ = {"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
ASK = [{"role": "user", "content": "Add hello.txt"}]


def make_patch_checkpoint(path) -> Path:
    path = _chain_checkpoint(path, LINKS[1:-1], TOOL_TEMPLATE, LINKS)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    before, after = LINKS.index(GOOD[-1]), tokenizer.token_to_id(END)
    for file in sorted(path.glob("*.safetensors")):
        weights = mx.load(str(file))
        if "lm_head.weight" in weights:  # the chain's row k gives 10 to the link after link k
            head = weights["lm_head.weight"]
            head[after, before] = 5.0  # the second choice after the good hunk: the end
            mx.save_safetensors(str(file), {**weights, "lm_head.weight": head}, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    path = make_patch_checkpoint(tmp_path_factory.mktemp("patch"))
    server = Server(path, 2, [*SERVER_ARGS, "--http", "127.0.0.1:0"])
    try:
        server.tokenizer_wrapper = load_tokenizer(path)
        server.tokenizer = server.tokenizer_wrapper._tokenizer
        server.ll = llguidance.hf.from_tokenizer(server.tokenizer, n_vocab=len(server.tokenizer))
        server.wait_serving()
        host, port = server.http_address()
        server.client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0, timeout=120)
        server.model = server.client.models.list().data[0].id
        yield server
    finally:
        server.stop()


def is_patch(ring, text: str) -> bool:
    """Whether Codex's grammar takes `text` whole (llguidance's matcher, over the checkpoint's tokens)."""
    matcher = llguidance.LLMatcher(ring.ll, APPLY_PATCH, log_level=0)
    return matcher.consume_tokens(ring.tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_the_call_keeps_to_the_grammar_forced_and_under_auto(ring):
    for choice in ({"type": "custom", "name": "apply_patch"}, "auto"):
        out = ring.client.responses.create(model=ring.model, input="Add hello.txt", tools=[TOOL], tool_choice=choice,
                                           temperature=0, max_output_tokens=40)
        (call,) = out.output
        assert call.type == "custom_tool_call" and call.name == "apply_patch", out.output
        assert call.input == PATCH and is_patch(ring, call.input), (choice, call.input)


def test_unconstrained_the_same_weights_write_no_patch(ring):
    """The same prompt's call through chat completions, apply_patch a plain function of one string:
    nothing holds its input, and it is the chain's, with the bad hunk."""
    function = {"type": "function", "function": {"name": "apply_patch", "description": "Edit files", "parameters": {
        "type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}}
    out = ring.client.chat.completions.create(model=ring.model, messages=[{"role": "user", "content": "Add hello.txt"}],
                                              tools=[function], temperature=0, max_tokens=40)
    (call,) = out.choices[0].message.tool_calls
    text = json.loads(call.function.arguments)["input"]
    assert "*** Frobnicate File: x\n" in text and not is_patch(ring, text), text


def test_a_grammar_that_cannot_be_used_is_a_400_naming_the_tool(ring):
    broken = {**TOOL, "name": "edit", "format": {**TOOL["format"], "definition": "start: /^x/"}}
    with pytest.raises(openai.BadRequestError) as e:
        ring.client.responses.create(model=ring.model, input="hi", tools=[broken], max_output_tokens=4)
    assert e.value.body["param"] == "tools[0].format.definition" and "'edit'" in e.value.body["message"], e.value.body


def chat(ring, **kwargs):
    return ring.client.chat.completions.create(**{"model": ring.model, "messages": ASK, "tools": [CHAT_TOOL, READ],
                                                  "temperature": 0, "max_tokens": 40, **kwargs})


FORCED = {"type": "custom", "custom": {"name": "apply_patch"}}


@pytest.mark.parametrize("choice", [FORCED, "auto"])
def test_chat_completions_custom_call_keeps_to_the_grammar(ring, choice):
    out = chat(ring, tool_choice=choice)
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    assert call.type == "custom" and call.custom.name == "apply_patch" and call.id, call
    assert call.custom.input == PATCH and is_patch(ring, call.custom.input), (choice, call.custom.input)

    chunks = list(chat(ring, tool_choice=choice, stream=True))
    (streamed,) = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert streamed.index == 0 and streamed.type == "custom" and streamed.id
    assert streamed.custom == {"name": "apply_patch", "input": PATCH}  # the package keeps it as it came
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_chat_completions_bad_grammar_is_a_400_naming_the_field(ring):
    broken = {"type": "custom", "custom": {"name": "edit", "format": {"type": "grammar", "grammar": {
        "syntax": "lark", "definition": "start: /^x/"}}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(ring, tools=[READ, broken], max_tokens=4)
    assert e.value.body["param"] == "tools[1].custom.format.grammar.definition", e.value.body
    assert "'edit'" in e.value.body["message"], e.value.body


def test_chat_completions_custom_call_and_its_result_go_back_into_the_prompt(ring):
    """An assistant message as the `openai` package dumps a reply's (a tool_calls entry of type custom),
    then the tool's result: the template renders the call as its function's, with {"input": the patch}."""
    call = ChatCompletionMessageCustomToolCall(id="call_1", type="custom", custom={"name": "apply_patch", "input": PATCH})
    message = ChatCompletionMessage(role="assistant", content=None, tool_calls=[call])
    messages = [*ASK, message.model_dump(exclude_none=False), {"role": "tool", "tool_call_id": "call_1", "content": "Done!"}]
    out = chat(ring, messages=messages, max_tokens=2)
    template = ring.tokenizer_wrapper.apply_chat_template
    turns, tools = chat_messages(messages), request_tools([CHAT_TOOL, READ], None, ring.tokenizer_wrapper)
    rendered = template(turns, tools=tools, add_generation_prompt=True, tokenize=False)
    assert '"arguments": ' + json.dumps({"input": PATCH}) in rendered and "Done!" in rendered, rendered
    assert out.usage.prompt_tokens == len(template(turns, tools=tools, add_generation_prompt=True))
