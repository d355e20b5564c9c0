"""chat_format.py's ReplySplitter on text: reasoning, content and tool calls split as they stream, markers
cut between pieces, the reasoning state begun by the prompt's open think or by a generated
one, with the thinking tiny checkpoint's tokenizer (tests/tool_checkpoint.py) and, for calls
after reasoning, that tokenizer wrapped by mlx-lm's TokenizerWrapper with each tool parser."""

import importlib
import json

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_tokenizer

from distributed.runtime.request import GenerationRequest
from distributed.serving.chat_format import ReplySplitter, prompt_opens_reasoning, reply_prompt
from tool_checkpoint import make_think_checkpoint, make_tool_checkpoint

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                       "properties": {"x": {"type": "integer"}}}}}]
CALL = {"json_tools": '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
        "qwen3_coder": "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"}


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    return load_tokenizer(make_think_checkpoint(tmp_path_factory.mktemp("think")))


def run(splitter, text: str, step: int = 2):
    """(reasoning, content, calls) of `text` fed `step` characters at a time, then finished."""
    pieces = [splitter.feed(text[i:i + step]) for i in range(0, len(text), step)] + [splitter.finish()]
    return "".join(p.reasoning for p in pieces), "".join(p.content for p in pieces), [c for p in pieces for c in p.calls]


def test_the_prompt_decides_where_the_reply_starts(thinking):
    opened = thinking.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    closed = thinking.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                          enable_thinking=False)
    assert prompt_opens_reasoning(thinking, opened) and not prompt_opens_reasoning(thinking, closed)
    assert not prompt_opens_reasoning(thinking, opened + thinking.encode("x</think>", add_special_tokens=False))
    assert run(ReplySplitter(thinking, None, opened), "Hmm, rain?</think>Sunny.") == ("Hmm, rain?", "Sunny.", [])
    # Without an open think the text is the answer until the model opens one itself.
    assert run(ReplySplitter(thinking, None, closed), "A<think>B</think>C") == ("B", "AC", [])
    splitter = ReplySplitter(thinking, None, opened)
    assert splitter.state == "reasoning" and splitter.feed("ab</th") == ("ab", "", [])  # a marker's start is held
    assert splitter.state == "reasoning" and splitter.feed("ink>c") == ("", "c", []) and splitter.state == "normal"


def test_a_reply_cut_short_inside_its_reasoning(thinking):
    opened = thinking.encode("<think>", add_special_tokens=False)
    splitter = ReplySplitter(thinking, None, opened)
    assert splitter.feed("still thinking </thi") == ("still thinking ", "", [])
    assert splitter.finish() == ("</thi", "", [])  # what was held back is the reasoning's


def test_a_tokenizer_without_think_tokens_splits_nothing(tmp_path):
    plain = load_tokenizer(make_tool_checkpoint(tmp_path / "tools"))
    assert not plain.has_thinking and not prompt_opens_reasoning(plain, [1, 2, 3])
    assert run(ReplySplitter(plain, None, [1, 2]), "<think>x</think>y") == ("", "<think>x</think>y", [])


@pytest.mark.parametrize("form", sorted(CALL))
def test_reasoning_then_a_call_in_each_form(thinking, form):
    """Trinity-Large-Thinking's turn: think, then call. A call's markup inside the reasoning stays reasoning."""
    parser = importlib.import_module(f"mlx_lm.tool_parsers.{form}")
    both = TokenizerWrapper(thinking._tokenizer, tool_parser=parser.parse_tool_call,
                            tool_call_start=parser.tool_call_start, tool_call_end=parser.tool_call_end)
    opened = both.encode("<think>", add_special_tokens=False)
    for step in (1, 3, 7):
        reasoning, content, calls = run(ReplySplitter(both, TOOLS, opened),
                                        f"Use f, not {CALL[form][:11]}.</think>Calling. " + CALL[form], step)
        assert (reasoning, content) == (f"Use f, not {CALL[form][:11]}.", "Calling. ")
        (call,) = calls
        assert call["function"]["name"] == "f" and json.loads(call["function"]["arguments"]) == {"x": 1}


def test_a_constrained_reply_starts_as_the_answer():
    """Its grammar holds from the first token: no prompt, so no reasoning state, whatever the prompt's end."""
    request = GenerationRequest([1, 2], max_tokens=4)
    assert reply_prompt(request) == [1, 2]
    request.grammar = "start: /x/"
    assert reply_prompt(request) is None
