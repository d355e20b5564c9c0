"""Anthropic's Messages API on the HTTP port (POST /v1/messages, POST /v1/messages/count_tokens),
served over chat completions (api_adapter.py), so the `anthropic` package and Claude-style
agents work unchanged and a greedy message gets the same text as through /v1/chat/completions.

Implemented: `model`, `max_tokens` (required), `system` (a string or text blocks), `messages`
(text, `tool_use` and `tool_result` blocks), `tools` (client tools: name, description,
input_schema), `tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`),
`stop_sequences`, `temperature`, `top_p`, `top_k` (the SDK sends them in extra_body), `output_config.format`
(a JSON schema: constrained decoding), `stream` (message_start, content_block_start
/ _delta (text_delta, input_json_delta) / _stop, message_delta with stop_reason and usage,
message_stop); `usage` with `cache_read_input_tokens` from the prefix cache (`input_tokens` is
the rest, as Anthropic counts it). Accepted with no effect: `metadata`, `cache_control` (top level and on
blocks: the prefix cache finds shared prefixes itself), `service_tier` auto / standard_only,
`speed` standard, `thinking` disabled, `inference_geo`, `user_profile_id`, `workspace_id`.
Refused by name (400): thinking enabled, `output_config.effort`, images, documents, server
tools, `container`, `mcp_servers`, `context_management`, `diagnostics`, unknown fields. Errors are Anthropic's shape.
"""

import json
import uuid

from ..runtime.request import RequestError
from .api_adapter import Adapter, sse
from .openai_fields import ApiError
from .requests import chat_ids
from .tools import chat_messages, request_tools

FIELDS = ("model", "max_tokens", "system", "messages", "tools", "tool_choice", "stop_sequences", "temperature",
          "top_p", "top_k", "stream", "metadata", "service_tier", "thinking", "output_config", "speed", "cache_control")
HINTS = ("inference_geo", "user_profile_id", "workspace_id")  # routing and accounting for Anthropic's service
REFUSED = {"container": "containers (code execution) are not supported",
           "mcp_servers": "MCP servers are not supported (run the tools in the client)",
           "context_management": "context management is not supported",
           "diagnostics": "prompt-cache diagnostics are not reported (usage has cache_read_input_tokens)"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def _text(content, where: str) -> str:
    """A string, or text blocks joined (cache_control on them is a hint)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, "expected a string or a list of content blocks")
    parts = []
    for k, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise RequestError(f"{where}[{k}]", f"only text blocks are supported here, got {kind!r}")
        parts.append(block["text"])
    return "".join(parts)


def _messages(messages) -> list:
    """Anthropic's turns as OpenAI messages: tool_use blocks become an assistant's tool_calls,
    tool_result blocks `tool` messages (before the turn's text, as they answer the calls)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "expected a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise RequestError(f"{where}.role", "expected \"user\" or \"assistant\"")
        extra = next((k for k in m if k not in ("role", "content")), None)
        if extra is not None:
            raise RequestError(f"{where}.{extra}", "unknown field")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise RequestError(f"{where}.content", "expected a string or a list of content blocks")
        text, calls, results = [], [], []
        for k, block in enumerate(blocks):
            at = f"{where}.content[{k}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(_text([block], at))
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                        or not isinstance(block.get("input", {}), dict):
                    raise RequestError(at, "a tool_use block needs an id, a name and an input object")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and m["role"] == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise RequestError(f"{at}.tool_use_id", "expected the id of the tool_use it answers")
                result = _text(block.get("content", ""), f"{at}.content")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": ("Error: " + result) if block.get("is_error") else result})
            elif kind in ("thinking", "redacted_thinking"):
                raise RequestError(at, "thinking blocks are not supported")
            else:
                raise RequestError(at, f"a block of type {kind!r} is not supported in a {m['role']} turn")
        out += results
        if calls:
            out.append({"role": "assistant", "content": "".join(text) or None, "tool_calls": calls})
        elif text or not results:
            out.append({"role": m["role"], "content": "".join(text)})
    return out


def _tools(tools) -> list:
    if not isinstance(tools, list):
        raise RequestError("tools", "expected a list of tools")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise RequestError(f"tools[{k}]", f"server tools ({kind}) are not supported: only client tools")
        extra = next((key for key in tool if key not in ("type", "name", "description", "input_schema", "cache_control")), None)
        if extra is not None or not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise RequestError(f"tools[{k}]" + (f".{extra}" if extra else ""), "expected {name, description, input_schema}")
        out.append({"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                                      "parameters": tool["input_schema"]}})
    return out


def _tool_choice(choice, out: dict) -> None:
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    extra = next((k for k in choice if k not in ("type", "name", "disable_parallel_tool_use")), None) \
        if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none") or extra is not None:
        raise RequestError("tool_choice", "expected {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise RequestError("tool_choice.name", "expected the name of a tool")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False


def to_chat(body: dict, info, tokenizer) -> dict:
    for name in body:
        if name in REFUSED:
            raise RequestError(name, REFUSED[name])
        if name not in FIELDS + HINTS:
            raise RequestError(name, "unknown field")
    if body.get("speed") not in (None, "standard"):
        raise RequestError("speed", "only standard: there is one speed")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") != "disabled"):
        raise RequestError("thinking", "extended thinking is not supported (only {\"type\": \"disabled\"})")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise RequestError("service_tier", "only auto and standard_only: there is one service tier")
    if not isinstance(body.get("metadata", {}), dict):
        raise RequestError("metadata", "expected an object")
    if body.get("max_tokens") is None:
        raise RequestError("max_tokens", "required (the most tokens to generate)")
    system = body.get("system")
    messages = ([{"role": "system", "content": _text(system, "system")}] if system else []) + _messages(body.get("messages"))
    out = {"messages": messages, "max_tokens": body["max_tokens"], "stream": body.get("stream", False)}
    for name, chat in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                       ("stop_sequences", "stop")):
        if body.get(name) is not None:
            out[chat] = body[name]
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    _tool_choice(body.get("tool_choice"), out)
    _output_config(body.get("output_config"), out)
    return out


def _output_config(config, out: dict) -> None:
    """Structured output: {"format": {"type": "json_schema", "schema": …}} (constrained decoding)."""
    if config is None:
        return
    if not isinstance(config, dict) or next((k for k in config if k not in ("format", "effort")), None):
        raise RequestError("output_config", "expected {\"format\": {\"type\": \"json_schema\", \"schema\": {…}}}")
    if config.get("effort") is not None:
        raise RequestError("output_config.effort", "not supported (the chat template decides)")
    form = config.get("format")
    if form is None:
        return
    if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
        raise RequestError("output_config.format", "expected {\"type\": \"json_schema\", \"schema\": {…}}")
    out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"],
                                                                     "strict": True}}


def param(name: str) -> str:
    """The Messages API's name for a chat-completions field an error names."""
    if name.startswith("response_format"):
        return "output_config.format"
    return {"stop": "stop_sequences"}.get(name, name)


def count_tokens(body: dict, scheduler, tokenizer, info):
    """POST /v1/messages/count_tokens: the prompt's tokens (system, messages, tools) as a
    /v1/messages request with the same body would be charged."""
    try:
        chat = to_chat({"max_tokens": 1, **{k: v for k, v in body.items() if k != "max_tokens"}}, info, tokenizer)
        tools = request_tools(chat, tokenizer)
        ids = chat_ids(tokenizer, chat_messages(chat["messages"]), tools)
    except RequestError as e:
        raise ApiError(400, str(e), param=e.field) from None
    return 200, {"input_tokens": len(ids)}


class MessagesReply:
    """What an Anthropic client gets, made from the OpenAI reply of the one choice."""

    content_type = "text/event-stream"

    def __init__(self, reply, body: dict):
        self.reply, self.model = reply, body.get("model") or reply.model
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.blocks = 0  # content blocks started
        self.text_open = False  # a text block is open

    def _usage(self, usage: dict) -> dict:
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def _stop(self, finish) -> tuple:
        choice = self.reply.choices[0]
        if finish == "stop" and choice.stop_sequence is not None:
            return "stop_sequence", choice.stop_sequence
        return STOP_REASONS.get(finish, "end_turn"), None

    def _message(self, content: list, stop_reason, stop_sequence, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def opening(self, chunks) -> list:
        usage = {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
        return [sse("message_start", {"type": "message_start", "message": self._message([], None, None, usage)})]

    def _close_text(self) -> list:
        if not self.text_open:
            return []
        self.text_open = False
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]

    def add(self, chunks) -> list:
        frames = []
        for chunk in chunks:
            delta = chunk["choices"][0]["delta"]
            if delta.get("content"):
                if not self.text_open:
                    frames.append(sse("content_block_start", {"type": "content_block_start", "index": self.blocks,
                                                              "content_block": {"type": "text", "text": ""}}))
                    self.blocks, self.text_open = self.blocks + 1, True
                frames.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1,
                                                          "delta": {"type": "text_delta", "text": delta["content"]}}))
            for call in delta.get("tool_calls") or []:
                frames += self._close_text()
                index, self.blocks = self.blocks, self.blocks + 1
                block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
                frames += [sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": block}),
                           sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                               "type": "input_json_delta", "partial_json": call["function"]["arguments"]}}),
                           sse("content_block_stop", {"type": "content_block_stop", "index": index})]
        return frames

    def closing(self) -> list:
        usage = self._usage(self.reply.usage())
        stop_reason, stop_sequence = self._stop(self.reply.choices[0].finish)
        return self._close_text() + [
            sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                  "usage": {"output_tokens": usage["output_tokens"], "input_tokens": usage["input_tokens"],
                                            "cache_read_input_tokens": usage["cache_read_input_tokens"]}}),
            sse("message_stop", {"type": "message_stop"})]

    def failure(self, error_body: dict) -> bytes:
        return sse("error", error_body)

    def whole(self, openai_whole: dict) -> dict:
        choice = openai_whole["choices"][0]
        message = choice["message"]
        content = [{"type": "text", "text": message["content"]}] if message.get("content") else []
        for call in message.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": _arguments(call["function"]["arguments"])})
        stop_reason, stop_sequence = self._stop(choice["finish_reason"])
        return self._message(content, stop_reason, stop_sequence, self._usage(openai_whole["usage"]))


def _arguments(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def error_body(e: ApiError) -> dict:
    kind = ERROR_TYPES.get(e.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": str(e)}}


ADAPTERS = {("POST", "/v1/messages"): Adapter(to_chat, MessagesReply, param)}
ROUTES = {("POST", "/v1/messages/count_tokens"): count_tokens}
ERROR_BODIES = {"/v1/messages": error_body, "/v1/messages/count_tokens": error_body}
