"""What a request's structured-output fields constrain its generation to, as an
llguidance grammar (runtime/grammar.py): OpenAI's `response_format` (json_object,
json_schema) and `tool_choice` ("required" or a named function: a call in the chat
template's own tool-call syntax whose arguments keep to the tool's parameter schema,
read back by mlx-lm's tool parser like any other call); and strict tools under "auto", whose
calls keep to their schemas once the model opens one (strict_calls_grammar: a lazy grammar,
free text until the tool-call start token). The other APIs' fields
(Responses' text.format, Messages' tool_choice, Ollama's format) are translated into
these first.
"""

import json
from typing import List, Optional

from ..runtime.grammar import json_schema_grammar, lark_grammar
from ..runtime.request import RequestError

# Tool-call syntaxes a call can be constrained to, by mlx-lm tool parser (its module's name).
JSON_CALLS = ("json_tools",)  # {"name": ..., "arguments": {...}} between the start and end strings


def response_grammar(response_format) -> Optional[str]:
    """`response_format`'s grammar; None for text (or absent)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise RequestError("response_format", "expected {\"type\": \"text\" | \"json_object\" | \"json_schema\", …}")
    kind = response_format["type"]
    extra = next((k for k in response_format if k not in ("type", "json_schema")), None)
    if extra is not None:
        raise RequestError(f"response_format.{extra}", "not supported")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind != "json_schema":
        raise RequestError("response_format.type", f"expected text, json_object or json_schema, got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise RequestError("response_format.json_schema", "expected {\"name\": …, \"schema\": {…}, \"strict\": …}")
    unknown = next((k for k in spec if k not in ("name", "schema", "strict", "description")), None)
    if unknown is not None:
        raise RequestError(f"response_format.json_schema.{unknown}", "not supported")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise RequestError("response_format.json_schema.schema", "expected a JSON schema object")
    strict = spec.get("strict")
    if not isinstance(strict, (bool, type(None))):
        raise RequestError("response_format.json_schema.strict", "expected a boolean")
    return schema_grammar(schema, bool(strict), "response_format.json_schema.schema")


def schema_grammar(schema: dict, strict: bool, field: str) -> str:
    try:
        return json_schema_grammar(schema, strict)
    except (ValueError, TypeError) as e:
        raise RequestError(field, f"not a JSON schema llguidance takes: {e}") from None


def forced_tools(tools: List[dict], choice) -> Optional[List[dict]]:
    """The tools a call is forced among: all for "required", the named one for
    {"type": "function", "function": {"name": …}}; None where the model may answer in text."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return tools
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise RequestError("tool_choice", "expected \"none\", \"auto\", \"required\" or "
                                          "{\"type\": \"function\", \"function\": {\"name\": …}}")
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise RequestError("tool_choice", f"no tool named {name!r} in tools")
    return named


def _literal(tokenizer, text: str) -> str:
    """`text` in Lark: a token the tokenizer added (llguidance matches those as special
    tokens, by id, not as bytes), or a string literal (which takes JSON's escapes)."""
    added = getattr(tokenizer, "_tokenizer", tokenizer).get_added_vocab()
    return f"<[{added[text]}]>" if text in added else json.dumps(text)


def _calls_schema(tools: List[dict], free_unless_strict: bool = False) -> dict:
    """{"name": …, "arguments": …} of a call to one of `tools`, its arguments keeping to the tool's
    parameters (with `free_unless_strict`, only a strict tool's: another's are any JSON object)."""
    calls = []
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise RequestError("tools", f"{function['name']}: parameters must be a JSON schema object")
        if free_unless_strict and not function.get("strict"):
            parameters = {"type": "object"}
        calls.append({"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    # Compact JSON, as in response_format (by default %json lets whitespace run on).
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def _parser(tokenizer) -> str:
    return getattr(tokenizer.tool_parser, "__module__", "").rsplit(".", 1)[-1]


def tool_call_grammar(tokenizer, tools: List[dict], parallel: bool = True) -> str:
    """One or more calls (one if not `parallel`) to `tools`, nothing else, in the syntax of
    the checkpoint's tool parser."""
    parser = _parser(tokenizer)
    if parser not in JSON_CALLS:
        raise RequestError("tool_choice", f"forcing a call is not supported for this model's tool-call format "
                                          f"({parser or 'unknown'}); use \"auto\"")
    body = json.dumps(_calls_schema(tools))
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    lark = (f"start: call{'+' if parallel else ''}\n"
            f"call: {_literal(tokenizer, start)} \"\\n\"? body \"\\n\"? {_literal(tokenizer, end)} \"\\n\"?\n"
            f"body: %json {body}\n")
    return lark_grammar(lark)


def strict_calls_grammar(tokenizer, tools: List[dict]) -> Optional[str]:
    """Under tool_choice "auto", where a tool is strict: free text, and once the model opens a call
    (the tool-call start token) the call keeps to the template's syntax and a strict tool's arguments
    to its schema (a lazy grammar: it binds only from the trigger). None where it cannot be built:
    no strict tool, a tool-call format other than json_tools, or call markers that are no added
    tokens (free text could not be told from the trigger); the calls are then not constrained."""
    if not any(t["function"].get("strict") for t in tools) or _parser(tokenizer) not in JSON_CALLS:
        return None
    added = getattr(tokenizer, "_tokenizer", tokenizer).get_added_vocab()
    start, end = added.get(tokenizer.tool_call_start), added.get(tokenizer.tool_call_end)
    if start is None or end is None:
        return None
    body = json.dumps(_calls_schema(tools, free_unless_strict=True))
    lark = (f"start: text (call text)*\n"
            f"text: <[^{start}]>*\n"
            f"call: <[{start}]> \"\\n\"? body \"\\n\"? <[{end}]>\n"
            f"body: %json {body}\n")
    return lark_grammar(lark)
