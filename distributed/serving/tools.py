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

NO_TOOLS = "this model's chat template has no tool support"
# Message keys that must be absent or empty: OpenAI sends them back with earlier replies.
EMPTY_KEYS = ("refusal", "audio", "function_call", "annotations")


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        other = next((p.get("type") for p in content if p.get("type") != "text" or not isinstance(p.get("text"), str)), 0)
        if other == 0:
            return "".join(p["text"] for p in content)
        raise RequestError(where, f"only text parts are supported, got a part of type {other!r}")
    raise RequestError(where, "expected a string or a list of text parts")


def _tool_calls(calls, where: str) -> List[dict]:
    """An assistant message's tool_calls, arguments decoded from JSON for the template."""
    out = []
    for k, call in enumerate(calls if isinstance(calls, list) else [None]):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or call.get("type", "function") != "function":
            raise RequestError(f"{where}[{k}]", "expected {\"type\": \"function\", \"function\": {\"name\": …, \"arguments\": …}}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError as e:
                raise RequestError(f"{where}[{k}].function.arguments", f"not JSON: {e}") from None
        out.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
    return out


NO_THINKING = "this model's tokenizer has no think tokens, so its chat template has no place for reasoning"


def chat_messages(messages, thinking: bool = False) -> List[dict]:
    """OpenAI messages as chat templates take them; RequestError names what is wrong.
    `thinking`: the tokenizer has think tokens, so assistant messages may carry reasoning_content."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "expected a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"{where}.role", "each message needs a string role")
        check_role(i, m["role"])
        known = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", *EMPTY_KEYS}
        extra = next((k for k in m if k not in known or (k in EMPTY_KEYS and m[k])), None)
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
            reasoning = m["reasoning_content"]
            if m["role"] != "assistant" or not isinstance(reasoning, str):
                raise RequestError(f"{where}.reasoning_content", "only assistant messages carry reasoning, a string")
            if not thinking:
                raise RequestError(f"{where}.reasoning_content", NO_THINKING)
            message["reasoning_content"] = reasoning
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise RequestError(f"{where}.{key}", "expected a string")
                message[key] = m[key]
        if m["role"] == "tool" and "tool_call_id" not in message:
            raise RequestError(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
        out.append(message)
    return out


def request_tools(body: dict, tokenizer) -> Optional[List[dict]]:
    """The tools to give the chat template (None: none, or tool_choice "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not (choice is None or choice in ("none", "auto", "required") or isinstance(choice, dict)):
        raise RequestError("tool_choice", f"expected \"none\", \"auto\", \"required\" or a function, "
                                          f"got {json.dumps(choice)[:60]}")
    if not tools:
        if choice is not None and choice != "none":
            raise RequestError("tool_choice", "needs tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools", "expected a list of tools")
        return None
    if not isinstance(tools, list):
        raise RequestError("tools", "expected a list of tools")
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{k}]", "expected {\"type\": \"function\", \"function\": {\"name\": …}}")
        if not isinstance(function.get("strict", False), (bool, type(None))):
            raise RequestError(f"tools[{k}].function.strict", "expected a boolean")
    if choice == "none":
        return None  # the model answers in text: no tools in its prompt, nothing parsed
    if not tokenizer.has_tool_calling:
        raise RequestError("tools", NO_TOOLS)
    return tools
