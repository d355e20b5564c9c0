"""What a request's structured-output fields constrain its generation to, as an
llguidance grammar (runtime/grammar.py): OpenAI's `response_format` (json_object,
json_schema) and `tool_choice` ("required" or a named function: a call in the chat
template's own tool-call syntax whose arguments keep to the tool's parameter schema,
read back by mlx-lm's tool parser like any other call); and strict tools under "auto", whose
calls keep to their schemas once the model opens one (strict_calls_grammar: a lazy grammar,
free text until the tool-call start token). A custom tool's call (OpenAI's free-form tools: a
function of one string carrying a Lark grammar under LARK_KEY, tools.custom_function) keeps its
input to that grammar inside the call's JSON string (quoted_grammar.py). tool_choice may also
name a custom tool, or list the allowed tools (allowed_tools: "required" forces a call among
them; "auto" holds a call, once opened, to them). The other APIs' fields
(Responses' text.format, Messages' tool_choice, Ollama's format) are translated into
these first.
"""

import json
from typing import List, Optional

from ..runtime.grammar import json_schema_grammar, lark_grammar
from ..runtime.request import RequestError
from .quoted_grammar import GrammarError, quoted_lark

# Tool-call syntaxes a call can be constrained to, by mlx-lm tool parser (its module's name).
JSON_CALLS = ("json_tools",)  # {"name": ..., "arguments": {...}} between the start and end strings
LARK_KEY = "x-lark-grammar"  # in a custom tool's one string parameter: the Lark grammar its input keeps to


def response_grammar(response_format: Optional[dict]) -> Optional[str]:
    """`response_format`'s grammar (parts.ResponseFormat); None for text (or absent)."""
    if response_format is None or response_format["type"] == "text":
        return None
    kind = response_format["type"]
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind != "json_schema":
        raise RequestError("response_format.type", f"expected text, json_object or json_schema, got {kind!r}")
    spec = response_format.get("json_schema")
    if spec is None:
        raise RequestError("response_format.json_schema", "expected {\"name\": …, \"schema\": {…}, \"strict\": …}")
    return schema_grammar(spec.get("schema", {}), bool(spec.get("strict")), "response_format.json_schema.schema")


def schema_grammar(schema: dict, strict: bool, field: str) -> str:
    try:
        return json_schema_grammar(schema, strict)
    except (ValueError, TypeError) as e:
        raise RequestError(field, f"not a JSON schema llguidance takes: {e}") from None


CHOICE = "expected \"none\", \"auto\", \"required\", {\"type\": \"function\", \"function\": {\"name\": …}}, " \
         "{\"type\": \"custom\", \"custom\": {\"name\": …}} or {\"type\": \"allowed_tools\", …}"
NAMED = "expected {\"type\": \"function\", \"function\": {\"name\": …}} or {\"type\": \"custom\", \"custom\": {\"name\": …}}"


def _name(entry) -> Optional[str]:
    """The tool {"type": "function", "function": {"name": …}} or {"type": "custom", "custom": {…}} names."""
    kind = entry.get("type") if isinstance(entry, dict) else None
    named = entry.get(kind) if kind in ("function", "custom") else None
    return named.get("name") if isinstance(named, dict) and isinstance(named.get("name"), str) else None


def _named(tools: List[dict], name: Optional[str], field: str) -> List[dict]:
    if name is None:
        raise RequestError(field, NAMED if field != "tool_choice" else CHOICE)
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise RequestError(field, f"no tool named {name!r} in tools")
    return named


def allowed_tools(tools: List[dict], choice) -> Optional[List[dict]]:
    """The tools {"type": "allowed_tools", "allowed_tools": {"mode", "tools": [tool names as
    tool_choice names one, …]}} lets the model call; None for another tool_choice. Every tool
    stays in the prompt (so that it stays cached)."""
    if not (isinstance(choice, dict) and choice.get("type") == "allowed_tools"):
        return None
    allowed = choice.get("allowed_tools")
    if not isinstance(allowed, dict) or allowed.get("mode") not in ("auto", "required") \
            or not isinstance(allowed.get("tools"), list) or not allowed["tools"]:
        raise RequestError("tool_choice.allowed_tools", "expected {\"mode\": \"auto\" or \"required\", \"tools\": […]}")
    out = []
    for k, entry in enumerate(allowed["tools"]):
        out += [t for t in _named(tools, _name(entry), f"tool_choice.allowed_tools.tools[{k}]") if t not in out]
    return out


def forced_tools(tools: List[dict], choice) -> Optional[List[dict]]:
    """The tools a call is forced among: all for "required", the named one for
    {"type": "function", "function": {"name": …}} (or a custom tool's {"type": "custom", "custom":
    {"name": …}}), the allowed ones for allowed_tools in mode "required"; None where the model may
    answer in text."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return tools
    allowed = allowed_tools(tools, choice)
    if allowed is not None:
        return allowed if choice["allowed_tools"]["mode"] == "required" else None
    return _named(tools, _name(choice), "tool_choice")


def _literal(tokenizer, text: str) -> str:
    """`text` in Lark: a token the tokenizer added (llguidance matches those as special
    tokens, by id, not as bytes), or a string literal (which takes JSON's escapes)."""
    added = getattr(tokenizer, "_tokenizer", tokenizer).get_added_vocab()
    return f"<[{added[text]}]>" if text in added else json.dumps(text)


def _arguments_schema(function: dict, free: bool = False) -> dict:
    """A call's arguments: the tool's parameters (`free`: any JSON object), written as the
    template writes its own calls ({{ arguments | tojson }}: no whitespace but after , and :;
    by default %json lets it run on), so a model writes a call as it learned to."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise RequestError("tools", f"{function['name']}: parameters must be a JSON schema object")
    if free:
        parameters = {"type": "object"}
    return {**parameters, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


def lark_input(function: dict) -> Optional[tuple]:
    """(parameter, Lark grammar) of a custom tool (a function of one string whose schema carries
    its grammar under LARK_KEY), or None."""
    properties = (function.get("parameters") or {}).get("properties")
    if isinstance(properties, dict) and len(properties) == 1:
        (name, schema), = properties.items()
        if isinstance(schema, dict) and isinstance(schema.get(LARK_KEY), str):
            return name, schema[LARK_KEY]
    return None


def custom_grammar(name: str, lark: str, field: str = "tools") -> str:
    """A custom tool's Lark grammar as the grammar of its input inside a call's JSON string;
    RequestError (a 400 on `field`) naming the tool where it cannot be used."""
    try:
        return quoted_lark(lark)
    except GrammarError as e:
        raise RequestError(field, f"tool {name!r}: its Lark grammar cannot be used: {e}") from None


def _call_bodies(tools: List[dict], free_unless_strict: bool = False) -> str:
    """Lark: `body`, the JSON of one call to one of `tools`, {"name": …, "arguments": …}: a custom
    tool's input (a JSON string) keeps to its Lark grammar, another tool's arguments to its
    parameters (with `free_unless_strict`, only a strict tool's: another's are any JSON object).
    Each call is its name's literal, then its arguments' grammar: alternatives that part at the name."""
    rules = []
    for tool in tools:
        function = tool["function"]
        custom = lark_input(function)
        if custom is not None:
            head = json.dumps({"name": function["name"], "arguments": {custom[0]: ""}})[:-3]  # to the string's quote
            rules.append(f"{json.dumps(head)} %lark {{\n{custom_grammar(function['name'], custom[1])}\n}} \"\\\"}}}}\"")
        else:
            head = json.dumps({"name": function["name"], "arguments": ""})[:-3]
            free = free_unless_strict and not function.get("strict")
            rules.append(f"{json.dumps(head)} %json {json.dumps(_arguments_schema(function, free))} \"}}\"")
    return "body: " + "\n    | ".join(rules) + "\n"


def _parser(tokenizer) -> str:
    return getattr(tokenizer.tool_parser, "__module__", "").rsplit(".", 1)[-1]


def tool_call_grammar(tokenizer, tools: List[dict], parallel: bool = True) -> str:
    """One or more calls (one if not `parallel`) to `tools`, nothing else, in the syntax of
    the checkpoint's tool parser."""
    parser = _parser(tokenizer)
    if parser not in JSON_CALLS:
        raise RequestError("tool_choice", f"forcing a call is not supported for this model's tool-call format "
                                          f"({parser or 'unknown'}); use \"auto\"")
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    lark = (f"start: call{'+' if parallel else ''}\n"
            f"call: {_literal(tokenizer, start)} \"\\n\"? body \"\\n\"? {_literal(tokenizer, end)} \"\\n\"?\n"
            + _call_bodies(tools))
    return lark_grammar(lark)


def strict_calls_grammar(tokenizer, tools: List[dict], allowed: Optional[List[dict]] = None) -> Optional[str]:
    """Under tool_choice "auto", where a tool is strict (or `allowed`, allowed_tools' subset, limits
    the calls): free text, and once the model opens a call (the tool-call start token) the call
    keeps to the template's syntax, to one of the allowed tools, and a strict tool's arguments to
    its schema (a lazy grammar: it binds only from the trigger). None where it cannot be built:
    nothing to hold, a tool-call format other than json_tools, or call markers that are no added
    tokens (free text could not be told from the trigger); the calls are then not constrained."""
    callable_tools = tools if allowed is None else allowed
    limited = len(callable_tools) < len(tools)
    if not (limited or any(t["function"].get("strict") for t in callable_tools)) or _parser(tokenizer) not in JSON_CALLS:
        return None
    added = getattr(tokenizer, "_tokenizer", tokenizer).get_added_vocab()
    start, end = added.get(tokenizer.tool_call_start), added.get(tokenizer.tool_call_end)
    if start is None or end is None:
        return None
    lark = (f"start: text (call text)*\n"
            f"text: <[^{start}]>*\n"
            f"call: <[{start}]> \"\\n\"? body \"\\n\"? <[{end}]>\n"
            + _call_bodies(callable_tools, free_unless_strict=True))
    return lark_grammar(lark)
