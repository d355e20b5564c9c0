"""A custom (free-form) tool's Lark grammar, held over its input as a call carries it: inside
a JSON string. Codex's apply_patch is such a tool; a call to it is written in the chat
template's JSON syntax, {"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n…"}},
so its grammar must hold of the string's contents once JSON's escapes are read.

quoted_lark(lark) rewrites the grammar's terminals (string literals, character ranges, regular
expressions, and the `common` terminals it imports) to match their text as json.dumps writes it
inside a string: `"`, `\\` and control characters escaped, every other character as it is. The
rules stay as written. Escaping is one text per character and no escape is a prefix of another
character's text, so the quoted grammar takes exactly the escaped texts of what the original
takes. Regular expressions are read with Python's own parser (Lark's are Python's) and written
for llguidance's; anchors, look-arounds and back-references have no equivalent and are refused.
"""

import json
import re
from functools import lru_cache

from re import _constants as sre, _parser as sre_parse  # Python's regex parser: a pattern's structure

from ..runtime.grammar import one_line

# Characters JSON escapes inside a string; every other one stands for itself.
SPECIALS = ['"', "\\"] + [chr(code) for code in range(0x20)]
ORDINARY = r'[^"\\\x00-\x1f]'
CATEGORIES = {sre.CATEGORY_DIGIT: r"\d", sre.CATEGORY_NOT_DIGIT: r"\D", sre.CATEGORY_SPACE: r"\s",
              sre.CATEGORY_NOT_SPACE: r"\S", sre.CATEGORY_WORD: r"\w", sre.CATEGORY_NOT_WORD: r"\W"}
REFUSED = {sre.AT: "anchors (^, $, \\b)", sre.ASSERT: "look-arounds", sre.ASSERT_NOT: "look-arounds",
           sre.GROUPREF: "backreferences", sre.GROUPREF_EXISTS: "conditional groups"}
LARK_FLAGS = {"i": re.I, "m": re.M, "s": re.S, "u": re.U, "x": re.X, "l": 0}
# Lark's common.lark, the terminals a grammar may import, as regular expressions.
COMMON = {
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[a-fA-F0-9]", "INT": r"[0-9]+", "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+",
    "FLOAT": r"[0-9]+[eE][+-]?[0-9]+|(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?",
    "NUMBER": r"[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?",
    "LETTER": r"[a-zA-Z]", "UCASE_LETTER": r"[A-Z]", "LCASE_LETTER": r"[a-z]", "WORD": r"[a-zA-Z]+",
    "CNAME": r"[_a-zA-Z][_a-zA-Z0-9]*", "ESCAPED_STRING": r'"(?:\\.|[^"\\\n])*"',
    "WS_INLINE": r"[ \t]+", "WS": r"[ \t\f\r\n]+", "CR": r"\r", "LF": r"\n", "NEWLINE": r"(?:\r?\n)+",
    "SH_COMMENT": r"#[^\n]*", "CPP_COMMENT": r"//[^\n]*", "C_COMMENT": r"/\*(?:.|\n)*?\*/", "SQL_COMMENT": r"--[^\n]*",
}
COMMON["SIGNED_FLOAT"] = f"[+-]?(?:{COMMON['FLOAT']})"
COMMON["SIGNED_NUMBER"] = f"[+-]?(?:{COMMON['NUMBER']})"
STRING = r'"(?:\\.|[^"\\\n])*"'
LARK_TOKEN = re.compile(rf"""
    (?P<comment>//[^\n]*|\#[^\n]*)
  | (?P<range>{STRING}\s*\.\.\s*{STRING})
  | (?P<string>{STRING})(?P<string_flags>i?)
  | (?P<regex>/(?!/)(?:\\.|[^/\\\n])+/)(?P<regex_flags>[imslux]*)
  | %import[ \t]+common\s*(?:\.\s*(?P<one>\w+)(?:\s*->\s*(?P<as>\w+))?|\((?P<many>[\w\s,]*)\))
  | (?P<other_import>%import\b)
  | (?P<foreign>%json\b|%lark\b|%llguidance\b|%regex\b|<)
  | (?P<alias>->\s*\w+)
  | (?P<modifier>^[ \t]*[?!])
  | (?<![\w%])(?P<name>_?[a-z][_a-z0-9]*)""", re.X | re.M)
RULE_TERMINAL = "Q_"  # a rule's name as a terminal: Q_NAME
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "\\": "\\", '"': '"', "/": "/"}


class GrammarError(ValueError):
    """What in a grammar cannot be quoted (or compiled)."""


def _escaped(ch: str) -> str:
    """`ch` as json.dumps writes it inside a string."""
    return json.dumps(ch, ensure_ascii=False)[1:-1]


def _char(code: int) -> str:
    """One character in llguidance's regex syntax, whatever it is."""
    ch = chr(code)
    return ch if ch.isascii() and ch.isalnum() else f"\\x{{{code:x}}}"


def _text(text: str) -> str:
    return "".join(_char(ord(c)) for c in text)


def _member(items, ch: str) -> bool:
    """Whether the character class `items` (the parser's) holds `ch`."""
    negate = hit = False
    for op, value in items:
        if op is sre.NEGATE:
            negate = True
        elif op is sre.LITERAL:
            hit |= ord(ch) == value
        elif op is sre.RANGE:
            hit |= value[0] <= ord(ch) <= value[1]
        elif op is sre.CATEGORY:
            hit |= re.fullmatch(CATEGORIES[value], ch) is not None
    return hit != negate


def _class(items) -> str:
    parts, negate = [], ""
    for op, value in items:
        if op is sre.NEGATE:
            negate = "^"
        elif op is sre.LITERAL:
            parts.append(_char(value))
        elif op is sre.RANGE:
            parts.append(f"{_char(value[0])}-{_char(value[1])}")
        elif op is sre.CATEGORY:
            parts.append(CATEGORIES[value])
        else:
            raise GrammarError(f"a character class holds {op}")
    return f"[{negate}{''.join(parts)}]"


def _set(items, flags: int) -> str:
    """A character of the class `items`, escaped: an ordinary one as it is, a special one as its escape."""
    ordinary = f"[{_class(items)}&&{ORDINARY}]"
    alternatives = [f"(?i:{ordinary})" if flags & re.I else ordinary]
    alternatives += [_text(_escaped(c)) for c in SPECIALS if _member(items, c)]
    return "(?:" + "|".join(alternatives) + ")"


def _literal(code: int, flags: int) -> str:
    ch = chr(code)
    if ch in SPECIALS:
        return _text(_escaped(ch))
    return f"(?i:{_char(code)})" if flags & re.I and ch.lower() != ch.upper() else _char(code)


def _repeat(body: str, low: int, high) -> str:
    high = "" if high == sre.MAXREPEAT else high
    return f"(?:{body}){{{low},{high}}}"


def _quoted_regex(nodes, flags: int) -> str:
    """The parsed pattern `nodes` as a pattern of its matches' escaped texts."""
    out = []
    for op, value in nodes:
        if op is sre.LITERAL:
            out.append(_literal(value, flags))
        elif op is sre.NOT_LITERAL:
            out.append(_set([(sre.NEGATE, None), (sre.LITERAL, value)], flags))
        elif op is sre.ANY:
            out.append(_set([(sre.NEGATE, None)] + ([] if flags & re.S else [(sre.LITERAL, 10)]), flags))
        elif op is sre.IN:
            out.append(_set(value, flags))
        elif op is sre.BRANCH:
            out.append("(?:" + "|".join(_quoted_regex(branch, flags) for branch in value[1]) + ")")
        elif op is sre.SUBPATTERN:
            _, add, remove, inner = value
            out.append("(?:" + _quoted_regex(inner, (flags | add) & ~remove) + ")")
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT):  # lazy or greedy: the same texts
            out.append(_repeat(_quoted_regex(value[2], flags), value[0], value[1]))
        else:
            raise GrammarError(f"{REFUSED.get(op, str(op).lower())} cannot be used in a tool's grammar")
    return "".join(out)


def _regex_terminal(pattern: str, flags: int) -> str:
    try:
        parsed = sre_parse.parse(pattern, flags)
    except re.error as e:
        raise GrammarError(f"/{pattern}/: {e}") from None
    return "/" + _quoted_regex(parsed, parsed.state.flags).replace("/", "\\/") + "/"


def _unquote(literal: str) -> str:
    """A Lark string literal's text (its escapes read as Python reads them)."""
    def one(m):
        code = m.group(1)
        if code[0] in "ux" and len(code) > 1:
            return chr(int(code[1:], 16))
        return ESCAPES.get(code, "\\" + code)
    return re.sub(r"\\(u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|.)", one, literal[1:-1])


def _string_terminal(literal: str, case_insensitive: bool) -> str:
    text = "".join(_escaped(c) for c in _unquote(literal))
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\x7f") + ("i" if case_insensitive else "")


def _range_terminal(span: str) -> str:
    low, high = (_unquote(s.strip()) for s in span.split(".."))
    if len(low) != 1 or len(high) != 1:
        raise GrammarError(f"{span}: a range's ends are single characters")
    return "/" + _set([(sre.RANGE, (ord(low), ord(high)))], 0) + "/"


def _imports(names, alias=None) -> list:
    lines = []
    for name in names:
        if name not in COMMON:
            raise GrammarError(f"common.{name} is not a terminal of Lark's common grammar")
        lines.append(f"{alias or name}: {_regex_terminal(COMMON[name], 0)}")
    return lines


def _quote(lark: str, one_lexeme: bool) -> str:
    """`lark` with its terminals quoted; `one_lexeme`: its rules made terminals too (a grammar
    without recursion), so the whole input is one lexeme."""
    out, defined, end = [], [], 0
    for m in LARK_TOKEN.finditer(lark):
        out.append(lark[end:m.start()])
        end = m.end()
        if m.group("comment") is not None:
            continue
        if m.group("name") is not None or m.group("alias") is not None or m.group("modifier") is not None:
            if not one_lexeme:
                out.append(m.group())
            elif m.group("name") is not None:
                out.append(RULE_TERMINAL + m.group("name").upper())
        elif m.group("range") is not None:
            out.append(_range_terminal(m.group("range")))
        elif m.group("string") is not None:
            out.append(_string_terminal(m.group("string"), m.group("string_flags") == "i"))
        elif m.group("regex") is not None:
            flags = sum(LARK_FLAGS[f] for f in m.group("regex_flags"))
            out.append(_regex_terminal(m.group("regex")[1:-1].replace("\\/", "/"), flags))
        elif m.group("one") is not None:
            defined += _imports([m.group("one")], m.group("as"))
        elif m.group("many") is not None:
            defined += _imports([n for n in re.split(r"[\s,]+", m.group("many")) if n])
        elif m.group("other_import") is not None:
            raise GrammarError("only Lark's common terminals can be imported")
        else:
            raise GrammarError(f"{m.group('foreign')!r} is llguidance's syntax, not Lark's")
    head = f"start: {RULE_TERMINAL}START\n" if one_lexeme else ""
    return head + "".join(out) + lark[end:] + "\n" + "\n".join(defined) + "\n"


@lru_cache(maxsize=64)
def quoted_lark(lark: str) -> str:
    """The Lark grammar of the escaped texts of what `lark` takes (see the module's docstring);
    GrammarError says what in `lark` is wrong, or cannot be quoted. A grammar without recursion
    or %ignore becomes one lexeme: llguidance's lexer takes the longest match and never goes
    back, and where one lexeme may go on with a backslash (`.*` and its escapes) and the next
    begins with one (an escaped newline), two lexemes would end the first too late."""
    import llguidance

    def check(grammar: str):
        return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar))

    error = check(lark)
    if error:
        raise GrammarError(one_line(error))
    if "%ignore" not in lark:
        whole = _quote(lark, one_lexeme=True)
        if not check(whole):
            return whole
    quoted = _quote(lark, one_lexeme=False)
    error = check(quoted)
    if error:
        raise GrammarError(f"once quoted: {one_line(error)}")
    return quoted
