"""A custom tool's Lark grammar held over its input inside a call's JSON string
(serving/quoted_grammar.py, constraints.py): Codex CLI 0.171.0's own apply_patch grammar
(codex_apply_patch.lark, as its binary holds it) takes the escaped text of a patch and refuses
what is not one; quoted regular expressions take what Python's take; a recursive grammar is
quoted rule by rule; what cannot be used is a 400 naming the tool. Checked with llguidance's
matcher over a real tokenizer (the tool checkpoint's, whose call markers are added tokens)."""

import json
import re
from pathlib import Path

import llguidance
import llguidance.hf
import pytest
from mlx_lm.utils import load_tokenizer

from distributed.runtime.request import RequestError
from distributed.serving.constraints import strict_calls_grammar, tool_call_grammar
from distributed.serving.quoted_grammar import GrammarError, quoted_lark
from distributed.serving.responses_api import parse_request
from distributed.serving.sealed import Sealer
from tool_checkpoint import make_tool_checkpoint

APPLY_PATCH = (Path(__file__).parent / "codex_apply_patch.lark").read_text()
PATCHES = [
    '*** Begin Patch\n*** Update File: src/app.py\n@@ def greet(name):\n-    return "hi " + name\n'
    '+    return f"hello {name}\\n"\n*** End Patch\n',
    "*** Begin Patch\n*** Add File: notes/\u00e9t\u00e9.txt\n+tab\there \u2713\n+\n"
    "*** Delete File: old.c\n*** End Patch",
    "*** Begin Patch\n*** Update File: a\n*** Move to: b\n@@\n context\n-x\n+y\n*** End of File\n*** End Patch\n",
]
NOT_PATCHES = [
    "*** Begin Patch\n*** Frobnicate File: a.py\n*** End Patch\n",
    "*** Begin Patch\n*** Add File: a.py\nno plus sign\n*** End Patch\n",
    "*** Begin Patch\n*** Update File: a.py\n+x\n",  # never ends
    "*** Begin Patch\n*** End Patch\n",  # no hunk
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tokenizer = load_tokenizer(make_tool_checkpoint(tmp_path_factory.mktemp("tools")))
    hf = tokenizer._tokenizer
    tokenizer.ll = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=sorted(tokenizer.eos_token_ids))
    return tokenizer


def takes(tokenizer, grammar: str, text: str) -> bool:
    """Whether `grammar` takes the whole of `text` (tokenized as the model could write it)."""
    matcher = llguidance.LLMatcher(tokenizer.ll, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer._tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.is_accepting()


def escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def test_codex_apply_patch_grammar_holds_of_the_escaped_input(tokenizer):
    quoted = quoted_lark(APPLY_PATCH)
    for patch in PATCHES:
        assert takes(tokenizer, APPLY_PATCH, patch)  # the patches are patches
        assert takes(tokenizer, quoted, escaped(patch)), patch
        assert not takes(tokenizer, quoted, patch)  # unescaped newlines cannot stand in a JSON string
    for text in NOT_PATCHES:
        assert not takes(tokenizer, APPLY_PATCH, text)
        assert not takes(tokenizer, quoted, escaped(text)), text


@pytest.mark.parametrize("regex, texts", [
    (r"(.+)", ["a", 'say "hi"\\', "\t\x01", "\n", "x\ny", ""]),
    (r"[^a-c\d]+x?", ["zz", "zzx", "a", "\\", "9", '"\n"']),
    (r"(?i)ab[0-9]{2,3}|\s+", ["AB12", "ab1234", "Ab123", " \t\n", ""]),
    (r"[\x00-\x1f\"]*", ["\x00\x1f", '"""', "a"]),
])
def test_quoted_regexes_take_what_pythons_take(tokenizer, regex, texts):
    quoted = quoted_lark(f"start: /{regex}/")
    for text in texts:
        assert takes(tokenizer, quoted, escaped(text)) == bool(re.fullmatch(regex, text)), (regex, text)


def test_literals_ranges_and_common_terminals(tokenizer):
    quoted = quoted_lark('start: "say \\"" WORD ("-" | "\\t") digit+ "\\n"\ndigit: "0".."9"\n%import common.WORD')
    assert takes(tokenizer, quoted, escaped('say "hello\t42\n'))
    assert not takes(tokenizer, quoted, escaped('say "hello\tx\n'))


def test_a_recursive_grammar_is_quoted_rule_by_rule(tokenizer):
    quoted = quoted_lark('start: "(" start ")" | WORD\nWORD: /[a-z"]+/')
    assert takes(tokenizer, quoted, escaped('(("a"))')) and not takes(tokenizer, quoted, escaped('(("a")'))


@pytest.mark.parametrize("lark, says", [
    ("start: undefined_rule", "undefined_rule"),
    ("start: /^x/", "anchors"),
    ("start: /(?=x)x/", "look-around"),
    ("start: /(a)\\1/", "backreferences"),
    ("start: X\n%import other.X", "common"),
    ('start: %json {"type": "string"}', "llguidance"),
])
def test_what_cannot_be_used_is_refused_naming_the_tool(tokenizer, lark, says):
    with pytest.raises(GrammarError, match=re.escape(says)):
        quoted_lark(lark)
    tool = {"type": "custom", "name": "edit", "format": {"type": "grammar", "syntax": "lark", "definition": lark}}
    with pytest.raises(RequestError) as e:
        parse_request({"input": "hi", "tools": [tool]}, None, tokenizer, Sealer())
    assert e.value.field == "tools[0].format.definition" and "'edit'" in str(e.value) and says in str(e.value)


def test_a_call_to_a_custom_tool_keeps_to_its_grammar_forced_and_under_auto(tokenizer):
    """The forced grammar and the lazy one (strict tools under auto) take a call whose input is a
    patch, written as the template writes calls, and mlx-lm's parser reads the patch back; a call
    whose input is no patch, or a function tool's call with other arguments, they refuse."""
    weather = {"type": "function", "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}
    patch = {"type": "custom", "name": "apply_patch", "description": "Edit files",
             "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH}}
    tools = parse_request({"input": "hi", "tools": [patch, weather]}, None, tokenizer, Sealer())[1].tools
    forced, lazy = tool_call_grammar(tokenizer, tools), strict_calls_grammar(tokenizer, tools)

    def call(name, arguments):
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"

    for text in PATCHES:
        assert takes(tokenizer, forced, call("apply_patch", {"input": text}))
        assert takes(tokenizer, lazy, "Let me edit it.\n" + call("apply_patch", {"input": text}))
        body = call("apply_patch", {"input": text})[len("<tool_call>"):-len("</tool_call>")]
        assert tokenizer.tool_parser(body, tools)["arguments"]["input"] == text
    for grammar, before in ((forced, ""), (lazy, "Sure.\n")):
        assert takes(tokenizer, grammar, before + call("get_weather", {"city": "Paris"}))
        assert not takes(tokenizer, grammar, before + call("get_weather", {"town": "Paris"}))
        assert not takes(tokenizer, grammar, before + call("apply_patch", {"input": NOT_PATCHES[0]}))
