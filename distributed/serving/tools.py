"""OpenAI chat messages and tool calling over the checkpoint's chat template.

Requests: `messages` in OpenAI's form (text parts, assistant `tool_calls`, `tool`
results) become what chat templates take (one string per content, tool-call
arguments as objects, as mlx-lm's server passes them), and `tools` reach the
template. An assistant message's `reasoning_content` (what an earlier reply's
reasoning was) goes to the template under that name, which Qwen3- and
Trinity-Thinking-style templates render inside <think>...</think>; a checkpoint
without think tokens refuses it. Replies are split by chat_format.py.
"""

import json
from typing import List, Optional

from ..runtime.request import RequestError
from .chat_format import check_role
from .constraints import LARK_KEY, custom_grammar

NO_TOOLS = "this model's chat template has no tool support"
# Message keys that must be absent or empty: OpenAI sends them back with earlier replies.
EMPTY_KEYS = ("refusal", "audio", "function_call", "annotations")
CUSTOM_INPUT = "input"  # a custom (free-form) tool's one string parameter, as the template sees it
CUSTOM_FORM = "expected {\"type\": \"text\"} or {\"type\": \"grammar\", \"grammar\": {\"syntax\", \"definition\"}}"


def _text(content, where: str) -> str:
    """A message's content (parts.Message: a string, or text parts joined)."""
    if isinstance(content, str):
        return content
    if content is None:
        raise RequestError(where, "expected a string or a list of text parts")
    other = next((p["type"] for p in content if p["type"] != "text" or not isinstance(p.get("text"), str)), 0)
    if other != 0:
        raise RequestError(where, f"only text parts are supported, got a part of type {other!r}")
    return "".join(p["text"] for p in content)


def _tool_calls(calls: List[dict], where: str) -> List[dict]:
    """An assistant message's tool_calls (parts.CallItem), arguments decoded from JSON for the
    template; a custom tool's call is the template's call of its function with {"input": …}."""
    out = []
    for k, call in enumerate(calls):
        kind = call.get("type", "function")
        if kind == "custom" and "custom" in call:
            custom = call["custom"]
            function = {"name": custom["name"], "arguments": {CUSTOM_INPUT: custom["input"]}}
            out.append({**{key: v for key, v in call.items() if key != "custom"}, "type": "function", "function": function})
            continue
        if kind == "custom":
            raise RequestError(f"{where}[{k}]", "expected {\"type\": \"custom\", \"custom\": {\"name\": …, \"input\": …}}")
        if "function" not in call or kind != "function":
            raise RequestError(f"{where}[{k}]", "expected {\"type\": \"function\", \"function\": {\"name\": …, \"arguments\": …}}")
        function = call["function"]
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError as e:
                raise RequestError(f"{where}[{k}].function.arguments", f"not JSON: {e}") from None
        out.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
    return out


NO_THINKING = "this model's tokenizer has no think tokens, so its chat template has no place for reasoning"


def chat_messages(messages: Optional[List[dict]], thinking: bool = False) -> List[dict]:
    """Messages (parts.Message, typed where the body was parsed) as chat templates take them;
    RequestError names what is wrong. `thinking`: the tokenizer has think tokens, so assistant
    messages may carry reasoning_content."""
    if not messages:
        raise RequestError("messages", "expected a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        check_role(i, m["role"])
        extra = next((k for k in EMPTY_KEYS if m.get(k)), None)
        if extra is not None:
            raise RequestError(f"{where}.{extra}", "not supported in a message")
        message = {"role": m["role"]}
        if m.get("tool_calls"):
            if m["role"] != "assistant":
                raise RequestError(f"{where}.tool_calls", "only assistant messages carry tool calls")
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if m.get("content") is not None or "tool_calls" not in message:
            message["content"] = _text(m.get("content"), f"{where}.content")
        if m.get("reasoning_content"):
            if m["role"] != "assistant":
                raise RequestError(f"{where}.reasoning_content", "only assistant messages carry reasoning")
            if not thinking:
                raise RequestError(f"{where}.reasoning_content", NO_THINKING)
            message["reasoning_content"] = m["reasoning_content"]
        message.update({key: m[key] for key in ("name", "tool_call_id") if m.get(key) is not None})
        if m["role"] == "tool" and "tool_call_id" not in message:
            raise RequestError(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
        out.append(message)
    return out


def custom_function(name: str, description: str, grammar, field: str) -> dict:
    """A custom (free-form) tool as the function the template sees: one string, `input`.
    `grammar`: (syntax, definition) or None (free text). A regex becomes the string's pattern, a
    Lark grammar goes under constraints.LARK_KEY (both enforced where the call is constrained:
    constraints.py); a Lark grammar llguidance cannot take is a 400 on `field`, whatever tool_choice is."""
    string = {"type": "string", "description": "the tool's free-form input, as is"}
    if grammar is not None:
        syntax, definition = grammar
        if syntax == "regex":
            string["pattern"] = f"^(?:{definition})$"  # the whole input (a JSON schema's pattern matches anywhere)
            description += f"\n\nThe input follows this regular expression:\n{definition}"
        else:
            custom_grammar(name, definition, field)
            string[LARK_KEY] = definition  # the model sees it in the schema
    parameters = {"type": "object", "properties": {CUSTOM_INPUT: string}, "required": [CUSTOM_INPUT],
                  "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters,
                                             **({"strict": True} if grammar is not None else {})}}


def custom_input(arguments: str) -> str:
    """A custom tool's input from its call's arguments ({"input": …}); the arguments as they came
    where they are not that (a call the model wrote unconstrained)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value[CUSTOM_INPUT] if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str) else arguments


def _custom_tool(tool: dict, where: str) -> dict:
    """Chat completions' {"type": "custom", "custom": {name, description, format}} (parts.CustomSpec)
    as its function."""
    extra = next((key for key in tool if key not in ("type", "custom")), None)
    if extra is not None or "custom" not in tool:
        raise RequestError(where + (f".{extra}" if extra else ""), "expected {\"type\": \"custom\", \"custom\": {\"name\": …}}")
    custom = tool["custom"]
    form = custom.get("format") or {"type": "text"}
    if form["type"] not in ("text", "grammar"):
        raise RequestError(f"{where}.custom.format", CUSTOM_FORM)
    grammar = form.get("grammar") if form["type"] == "grammar" else None
    if form["type"] == "grammar" and (grammar is None or grammar["syntax"] not in ("lark", "regex")):
        raise RequestError(f"{where}.custom.format.grammar", "expected {\"syntax\": \"lark\" or \"regex\", "
                                                            "\"definition\": …}")
    return custom_function(custom["name"], custom.get("description") or "",
                           grammar and (grammar["syntax"], grammar["definition"]),
                           f"{where}.custom.format.grammar.definition")


def custom_names(tools: Optional[List[dict]]) -> frozenset:
    """The names of a (valid) request's custom tools, whose calls come back as custom calls."""
    return frozenset(t["custom"]["name"] for t in tools or [] if t["type"] == "custom")


def request_tools(tools: Optional[List[dict]], choice, tokenizer) -> Optional[List[dict]]:
    """A request's `tools` (parts.Tool) to give the chat template, custom ones as their functions
    (None: none, or `choice`, its tool_choice, "none")."""
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise RequestError("tool_choice", f"expected \"none\", \"auto\", \"required\" or a function, "
                                          f"got {json.dumps(choice)[:60]}")
    if not tools:
        if choice is not None and choice != "none":
            raise RequestError("tool_choice", "needs tools")
        return None
    out = []
    for k, tool in enumerate(tools):
        if tool["type"] == "custom":
            out.append(_custom_tool(tool, f"tools[{k}]"))
            continue
        if tool["type"] != "function" or "function" not in tool:
            raise RequestError(f"tools[{k}]", "expected {\"type\": \"function\", \"function\": {\"name\": …}} "
                                              "or {\"type\": \"custom\", \"custom\": {\"name\": …}}")
        out.append(tool)
    if choice == "none":
        return None  # the model answers in text: no tools in its prompt, nothing parsed
    if not tokenizer.has_tool_calling:
        raise RequestError("tools", NO_TOOLS)
    return out
