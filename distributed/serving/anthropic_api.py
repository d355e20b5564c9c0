"""Anthropic's Messages API over chat completions' path (openai_api.Adapter): POST /v1/messages,
whole or streamed as Anthropic's server-sent events, and POST /v1/messages/count_tokens, so
the `anthropic` package works unchanged (headers such as anthropic-version and
anthropic-beta are not read; --auth-token takes `x-api-key` as well as a bearer token).

Implemented: model (required, the served one), max_tokens (required), system (a string or
text blocks; Claude Code's `x-anthropic-billing-header:` block or line, whose suffix changes with
the request, is dropped and named in the access log, so that sessions share their prompts'
prefix), messages (user and assistant turns; content a string or blocks: text,
tool_use in assistant turns -> OpenAI tool_calls, tool_result in user turns -> `tool`
messages, its content a string or text blocks, is_error prefixing it with "Error: "; system
entries among the messages, as Claude Code sends them, stay where they stand, so that each turn's
prompt extends the last: a system message where the template renders one there, else a user
turn), tools (client tools: name,
description, input_schema, strict; server tools are left out of the prompt), tool_choice (auto,
any -> "required", tool -> the named function, none; disable_parallel_tool_use), stop_sequences
(the one that ended the reply in stop_sequence), temperature, top_p, top_k, stream,
output_config.format (json_schema: constrained decoding), context_management (its edits applied
to the turns before templating: clear_thinking_*, clear_tool_uses_*), max_tokens (clamped to the
cap and the context's room, never refused: stop_reason max_tokens tells). thinking: where the
checkpoint thinks (think tokens), enabled (budget_tokens at least 1024 and below max_tokens,
which bounds thinking and text together: the budget is not enforced apart) or adaptive return the
reasoning as a thinking block (MessageReply), disabled tells the chat template
enable_thinking false, and an assistant turn's thinking blocks go back into the prompt
(reasoning_content). Claude Code's default request works unchanged: what changes nothing here is
accepted and named in the access log (openai_api.py's compatibility rule): thinking where the
checkpoint does not think (and its thinking blocks, redacted_thinking blocks), output_config.effort,
metadata, cache_control, inference_geo, service_tier, speed, diagnostics, server tools. Refused by
name (400): image and document blocks, container, mcp_servers, a last assistant turn (prefill);
any other field is unknown (400).

usage follows Anthropic: input_tokens are the prompt tokens computed, cache_read_input_tokens
those the prefix cache restored (their sum is the prompt, count_tokens' input_tokens),
cache_creation_input_tokens 0 (entries are stored without being asked for). Errors are
Anthropic's {"type": "error", "error": {"type", "message"}}, with the status the server
gives (503 while loading or the ring is down: overloaded_error, not Anthropic's 529).

What a client gets back (MessageReply): the Message, or its server-sent events, rendered from
the typed reply of its one choice (protocol.Reply). Where the checkpoint
thinks (think tokens), the reasoning comes first as a `thinking` block (streamed as
thinking_delta; its `signature` is empty: nothing here signs or checks one).
"""

import json
import uuid
from typing import Any, List, Optional, Union

from typing_extensions import Required, TypedDict

from ..runtime.request import RequestError
from .chat_format import chat_ids, place_system
from .openai_api import Adapter, Number, adapted, chat_prompt
from .parts import closed, open_keys
from .protocol import ApiError, FieldPolicy, Reply, ToolCall, Typed, Usage, check_fields, parse, sse
from .tools import chat_messages

PROMPT = ("model", "messages", "system", "tools", "tool_choice", "output_config", "thinking", "context_management")
GENERATE = ("max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream")
# Accepted with no effect (named in the access log): identifiers, caching hints, where and how fast it
# runs -> the JSON types each takes.
HINTS = {"metadata": (dict,), "cache_control": (dict,), "inference_geo": (str,), "service_tier": (),
         "speed": (), "diagnostics": ()}
REFUSED = {
    "container": "code execution containers are not supported",
    "mcp_servers": "MCP servers are not supported (give their tools as client tools)",
}
ONLY_GENERATE = ("metadata", "service_tier", "container", "inference_geo", "diagnostics", "speed")
POLICY = FieldPolicy(PROMPT + GENERATE, hints=HINTS, refused=REFUSED)
COUNT_POLICY = FieldPolicy(PROMPT, hints={k: v for k, v in HINTS.items() if k not in ONLY_GENERATE},
                           refused={k: v for k, v in REFUSED.items() if k not in ONLY_GENERATE})
BLOCK_KEYS = {"text": ("text", "citations"), "tool_use": ("id", "name", "input", "caller"),
              "thinking": ("thinking", "signature"), "redacted_thinking": ("data",),
              "tool_result": ("tool_use_id", "content", "is_error")}
TOOL_KEYS = ("type", "name", "description", "input_schema", "cache_control", "strict", "defer_loading",
             "eager_input_streaming", "input_examples", "allowed_callers")
BILLING = "x-anthropic-billing-header:"  # Claude Code's first system block (_unbilled)
CLEARED = "[cleared to save context]"  # what a cleared tool result (or input) says, as Anthropic's placeholder does
DEFAULT_TRIGGER = 100_000  # clear_tool_uses: input tokens above which it clears (Anthropic's default)
DEFAULT_KEEP_TOOL_USES = 3
CHOICES = {"auto": "auto", "any": "required", "none": "none"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}


@open_keys
class Block(TypedDict, total=False):
    """A content block: its type says which keys it may carry (BLOCK_KEYS, _blocks); null is absent."""

    type: Required[str]
    cache_control: Optional[dict]
    text: str  # text
    citations: Any
    id: str  # tool_use
    name: str
    input: dict
    caller: Any
    thinking: str  # thinking
    signature: Optional[str]
    data: Optional[str]  # redacted_thinking
    tool_use_id: str  # tool_result
    content: Union[str, List["Block"]]
    is_error: Optional[bool]


Content = Union[str, List[Block]]


@closed
class Turn(TypedDict):
    role: str  # user, assistant or system (_turn)
    content: Content


@open_keys
class MessagesTool(TypedDict, total=False):
    """A client tool (no type, or "custom"), or a server tool (only its type is read); TOOL_KEYS."""

    type: Optional[str]
    name: str
    description: Optional[str]
    input_schema: dict
    strict: Optional[bool]


@closed
class MessagesToolChoice(TypedDict, total=False):
    type: Required[str]  # auto, any, tool or none
    name: str
    disable_parallel_tool_use: Optional[bool]


@closed
class OutputFormat(TypedDict):
    type: str  # json_schema
    schema: dict


@closed
class OutputConfig(TypedDict, total=False):
    format: Optional[OutputFormat]
    effort: Optional[str]


@closed
class Thinking(TypedDict, total=False):
    type: Required[str]  # enabled, adaptive or disabled
    budget_tokens: int


@open_keys
class Edit(TypedDict, total=False):
    """A context_management edit: clear_thinking_* (keep) or clear_tool_uses_* (keep, trigger,
    exclude_tools, clear_tool_inputs); _context_edits."""

    type: Required[str]
    keep: Union[str, dict]
    trigger: Optional[dict]
    exclude_tools: Optional[List[str]]
    clear_tool_inputs: Optional[bool]


@closed
class ContextManagement(TypedDict, total=False):
    edits: List[Edit]


class MessagesRequest(Typed):
    """A /v1/messages (or count_tokens) body, typed."""

    model: Any = None  # required
    messages: Optional[List[Turn]] = None  # _turn
    system: Optional[Content] = None  # a string or text blocks
    tools: Optional[List[MessagesTool]] = None  # _tools
    tool_choice: Optional[MessagesToolChoice] = None
    output_config: Optional[OutputConfig] = None
    thinking: Optional[Thinking] = None
    context_management: Optional[ContextManagement] = None
    max_tokens: Optional[int] = None  # required by /v1/messages
    stop_sequences: Optional[List[str]] = None
    temperature: Number = None
    top_p: Number = None
    top_k: Optional[int] = None
    stream: bool = False


def _parse(body: dict, generate: bool) -> tuple:
    """(the typed request, the hints it carries); unknown and refused fields are errors naming them."""
    ignored = check_fields(body, POLICY if generate else COUNT_POLICY)
    for name in ("model",) + (("max_tokens",) if generate else ()):
        if body.get(name) is None:
            raise RequestError(name, "required")
    return parse(MessagesRequest, body), ignored


def _blocks(content: Content, where: str) -> list:
    """A turn's content as blocks (a string is one text block), their keys checked."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    for j, block in enumerate(content):
        kind = block["type"]
        if kind not in BLOCK_KEYS:
            raise RequestError(f"{where}[{j}].type", f"{json.dumps(kind)[:40]} blocks are not supported "
                                            "(text, thinking, tool_use and tool_result only)")
        extra = next((k for k, v in block.items() if k not in ("type", "cache_control", *BLOCK_KEYS[kind])
                      and v is not None), None)  # null: absent (a reply's blocks sent back carry some)
        if extra is not None or block.get("citations"):
            raise RequestError(f"{where}[{j}].{extra or 'citations'}", "not supported in a block")
    return content


def _texts(content, where: str) -> list:
    """The texts of text blocks (or a string)."""
    parts = []
    for j, block in enumerate(_blocks(content, where)):
        if block["type"] != "text" or "text" not in block:
            raise RequestError(f"{where}[{j}]", "expected a text block")
        parts.append(block["text"])
    return parts


def _text(content, where: str) -> str:
    """Text blocks (or a string) joined, as OpenAI's text parts are."""
    return "".join(_texts(content, where))


def _unbilled(texts: list, where: str, ignored: list):
    """System text (its blocks' texts, joined) without Claude Code's billing header: a block, or
    a line of a string, beginning `x-anthropic-billing-header:` (`cc_version=2.1.197.1c0;
    cc_entrypoint=sdk-cli;`, with a `cch=` hash in other releases) is request metadata whose
    suffix changes with the request, so that no two sessions' prompts would share more than the
    tokens before it. Dropped, and named in the access log (`WHERE.x-anthropic-billing-header`).
    None: nothing was left but the header."""
    kept, dropped = [], False
    for text in texts:
        lines = text.splitlines(keepends=True)
        rest = [line for line in lines if not line.startswith(BILLING)]
        if len(rest) == len(lines):
            kept.append(text)
            continue
        dropped = True
        if rest:  # a block (or the string) that held more than the header keeps the rest as it was
            kept.append("".join(rest))
    if not dropped:
        return "".join(texts)
    ignored.append(f"{where}.{BILLING[:-1]}")
    return "".join(kept) if kept else None


def _turn(m, i: int, last: bool, thinking: bool, ignored: list) -> list:
    """One Anthropic turn as OpenAI messages: an assistant's tool_use blocks become its
    tool_calls, its thinking blocks its reasoning_content (where the checkpoint thinks; else
    they are left out, named in the access log); a user's tool_result blocks become `tool`
    messages, in their order; a system entry (as Claude Code sends reminders) a system message."""
    where = f"messages[{i}]"
    if m["role"] not in ("user", "assistant", "system"):
        raise RequestError(f"{where}.role", "expected \"user\", \"assistant\" or \"system\"")
    if m["role"] == "system":
        text = _unbilled(_texts(m["content"], f"{where}.content"), "messages.system", ignored)
        return [{"role": "system", "content": text}] if text is not None else []
    if m["role"] == "assistant" and last:
        raise RequestError(where, "a last assistant turn (prefill) is not supported")
    out, text, calls, reasoning = [], [], [], []
    for j, block in enumerate(_blocks(m["content"], f"{where}.content")):
        at = f"{where}.content[{j}]"
        if block["type"] == "text":
            if "text" not in block:
                raise RequestError(f"{at}.text", "required")
            text.append(block["text"])
        elif m["role"] == "assistant" and block["type"] == "tool_use":
            if not all(key in block for key in ("id", "name", "input")):
                raise RequestError(at, "a tool_use block needs a string id and name and an input object")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
        elif m["role"] == "assistant" and block["type"] == "redacted_thinking":
            ignored.append("messages.redacted_thinking")  # another model's, unreadable: left out
        elif m["role"] == "assistant" and block["type"] == "thinking":
            if "thinking" not in block:
                raise RequestError(f"{at}.thinking", "required")
            if not thinking:
                ignored.append("messages.thinking")  # the template has no place for it
                continue
            reasoning.append(block["thinking"])  # its signature is not checked: nothing here signs
        elif m["role"] == "user" and block["type"] == "tool_result":
            if "tool_use_id" not in block:
                raise RequestError(at, "a tool_result block needs a string tool_use_id")
            if text:  # text before a result stays before it
                out.append({"role": "user", "content": "".join(text)})
                text = []
            result = _text(block.get("content", ""), f"{at}.content")
            # the chat template has no place for is_error: the result's text says it
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": f"Error: {result}" if block.get("is_error") else result})
        else:
            raise RequestError(f"{at}.type", f"{block['type']} blocks belong in "
                                    f"{'user' if block['type'] == 'tool_result' else 'assistant'} turns")
    if m["role"] == "assistant":
        out.append({"role": "assistant", **({"content": "".join(text)} if text or not calls else {}),
                    **({"tool_calls": calls} if calls else {}),
                    **({"reasoning_content": "".join(reasoning)} if reasoning else {})})
    elif text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _tools(tools: List[MessagesTool], ignored: list) -> list:
    """Client tools as function tools; server tools (web_search, bash, …: none runs here) are left
    out of the prompt and named in the access log."""
    out = []
    for k, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            ignored.append(f"tools.{kind}")
            continue
        extra = next((key for key, v in tool.items() if key not in TOOL_KEYS and v is not None), None)
        if extra is not None:
            raise RequestError(f"tools[{k}].{extra}", "not supported in a tool")
        if "name" not in tool or "input_schema" not in tool:
            raise RequestError(f"tools[{k}]", "a tool needs a string name and an input_schema object")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("strict"):
            function["strict"] = True
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: MessagesToolChoice, chat: dict) -> None:
    kind = choice["type"]
    if kind not in ("auto", "any", "tool", "none"):
        raise RequestError("tool_choice", "expected {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")
    if kind != "tool" and "name" in choice:
        raise RequestError("tool_choice.name", f"not supported with type {kind!r}")
    if kind == "tool" and "name" not in choice:
        raise RequestError("tool_choice.name", "the tool to use, a string")
    named = {"type": "function", "function": {"name": choice.get("name")}}
    chat["tool_choice"] = named if kind == "tool" else CHOICES[kind]
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _output_config(config: OutputConfig, chat: dict, ignored: list) -> None:
    if config.get("effort") is not None:
        ignored.append("output_config.effort")  # the chat template has no effort knob
    form = config.get("format")
    if form is not None:
        if form["type"] != "json_schema":
            raise RequestError("output_config.format", "expected {\"type\": \"json_schema\", \"schema\": {…}}")
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": form["schema"], "strict": True}}


def _thinking(config: Thinking, thinking: bool, chat: dict, ignored: list, max_tokens=None) -> None:
    """`thinking`: where the checkpoint thinks, enabled or adaptive (its thinking blocks come
    back) or disabled (the chat template is told enable_thinking false); elsewhere it changes
    nothing (the model does not think: no thinking blocks come back) and is named in the log."""
    kind = config["type"]
    if kind not in ("enabled", "adaptive", "disabled"):
        raise RequestError("thinking", "expected {\"type\": \"enabled\" | \"adaptive\" | \"disabled\"}")
    if kind != "enabled" and "budget_tokens" in config:
        raise RequestError("thinking.budget_tokens", f"not supported with type {kind!r}")
    if kind == "enabled":
        budget = config.get("budget_tokens", 0)
        if budget < 1024 or (max_tokens is not None and budget >= max_tokens):
            raise RequestError("thinking.budget_tokens", "expected an integer of at least 1024, below max_tokens")
    if not thinking:
        if kind != "disabled":
            ignored.append("thinking")
        return
    if kind == "disabled":
        chat["chat_template_kwargs"] = {"enable_thinking": False}


def _keep(edit: dict, where: str, unit: str, default):
    """An edit's `keep`: {"type": unit, "value": N} -> N, "all" -> None (keep everything)."""
    keep = edit.get("keep", default)
    if keep == "all":
        return None
    if isinstance(keep, dict) and keep.get("type") == unit and isinstance(keep.get("value"), int) \
            and not isinstance(keep["value"], bool) and keep["value"] >= 0:
        return keep["value"]
    raise RequestError(f"{where}.keep", f"expected {{\"type\": \"{unit}\", \"value\": N}} or \"all\"")


def _context_edits(config, messages: list, count, ignored: list) -> None:
    """`context_management.edits` applied to the turns before templating, as Anthropic documents
    them: clear_thinking_* drops the thinking of all but the last `keep` assistant turns that have
    some (default 1; "all": none dropped); clear_tool_uses_* once the prompt is over its `trigger`
    (input tokens, default 100,000) replaces the results (and with clear_tool_inputs the inputs) of
    all but the last `keep` tool uses (default 3) with a placeholder, tools in exclude_tools kept.
    `count(messages)`: the prompt's tokens."""
    for k, edit in enumerate(config.get("edits", [])):
        where = f"context_management.edits[{k}]"
        kind = edit["type"]
        if kind.startswith("clear_thinking_"):
            keep = _keep(edit, where, "thinking_turns", {"type": "thinking_turns", "value": 1})
            thought = [m for m in messages if m["role"] == "assistant" and m.get("reasoning_content")]
            for m in thought[: len(thought) - keep] if keep is not None else []:
                del m["reasoning_content"]
        elif kind.startswith("clear_tool_uses_"):
            keep = _keep(edit, where, "tool_uses", {"type": "tool_uses", "value": DEFAULT_KEEP_TOOL_USES})
            trigger = edit.get("trigger") or {"type": "input_tokens", "value": DEFAULT_TRIGGER}
            if not isinstance(trigger, dict) or trigger.get("type") not in ("input_tokens", "tool_uses") \
                    or not isinstance(trigger.get("value"), int):
                raise RequestError(f"{where}.trigger", "expected {\"type\": \"input_tokens\" | \"tool_uses\", \"value\": N}")
            excluded = set(edit.get("exclude_tools") or [])
            calls = [(m, c) for m in messages if m["role"] == "assistant" for c in m.get("tool_calls", [])]
            size = len(calls) if trigger["type"] == "tool_uses" else count(messages)
            if keep is None or size <= trigger["value"]:
                continue
            cleared = {c["id"] for _, c in calls[: max(0, len(calls) - keep)] if c["function"]["name"] not in excluded}
            for m in messages:
                if m["role"] == "tool" and m.get("tool_call_id") in cleared:
                    m["content"] = CLEARED
            if edit.get("clear_tool_inputs"):
                for _, c in calls:
                    if c["id"] in cleared:
                        c["function"]["arguments"] = {}
        else:
            ignored.append(f"context_management.{kind}")  # an edit this server does not know: none applied


def _prompt(request: MessagesRequest, tokenizer, max_tokens=None, ignored=None) -> dict:
    """The fields that make the prompt (and its constraint), as chat completions names them."""
    thinking = tokenizer.has_thinking
    ignored = [] if ignored is None else ignored
    messages = request.messages
    if not messages:
        raise RequestError("messages", "expected a non-empty list of turns")
    out = []
    if request.system is not None:
        text = _unbilled(_texts(request.system, "system"), "system", ignored)
        if text is not None:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        out += _turn(m, i, i == len(messages) - 1, thinking, ignored)
    chat = {"model": request.model, "messages": out}
    if request.thinking is not None:
        _thinking(request.thinking, thinking, chat, ignored, max_tokens)
    if request.tools is not None:
        tools = _tools(request.tools, ignored)
        if tools:
            chat["tools"] = tools
    choice = request.tool_choice
    if choice is not None and (chat.get("tools") or choice["type"] != "auto"):
        _tool_choice(choice, chat)  # "auto" with only server tools left: nothing to choose; "any": a 400 (no tools)
    if request.output_config is not None:
        _output_config(request.output_config, chat, ignored)
    if request.context_management is not None:
        def count(messages):
            try:
                return len(chat_ids(tokenizer, chat_messages(messages, thinking), chat.get("tools")))
            except RequestError:
                return 0
        _context_edits(request.context_management, out, count, ignored)
    chat["messages"] = place_system(out, tokenizer)
    return chat


def parse_request(body: dict, info, tokenizer) -> tuple:
    """(the typed request, the ChatRequest it becomes); RequestError names the Messages field."""
    request, ignored = _parse(body, generate=True)
    chat = _prompt(request, tokenizer, request.max_tokens, ignored)
    chat.update({"max_tokens": request.max_tokens, "stream": request.stream})
    for name in ("temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            chat[name] = getattr(request, name)
    stops = request.stop_sequences
    if stops:
        if not all(stops):
            raise RequestError("stop_sequences", "expected a list of non-empty strings")
        chat["stop"] = stops
    return request, adapted(chat, info, ignored, param)


def param(name: str) -> str:
    """The Anthropic field a chat-completions error is about."""
    if name.startswith("messages"):
        return "messages"  # the chat body's indices are not the request's
    if name == "stop":
        return "stop_sequences"
    if name == "parallel_tool_calls":
        return "tool_choice.disable_parallel_tool_use"
    if name.startswith("response_format"):
        return "output_config.format"
    return name.replace(".function.", ".")  # tools[k].function.strict -> tools[k].strict


def count_tokens(body: dict, scheduler, tokenizer, info):
    """{"input_tokens": N}: the chat template's tokens for system, messages and tools, as
    /v1/messages prompts them."""
    request, ignored = _parse(body, generate=False)
    chat = adapted(_prompt(request, tokenizer, ignored=ignored), info, ignored, param)  # another model: 404
    try:
        ids = chat_prompt(chat, tokenizer)[0]
    except RequestError as e:
        name = param(e.field)
        raise ApiError(400, e.as_named(name), param=name) from None
    return 200, {"input_tokens": len(ids)}


def _usage(usage: Usage) -> dict:
    return {"input_tokens": usage.prompt - usage.cached, "output_tokens": usage.completion,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached}


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments) if call.arguments else {}}


def _thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


class MessageReply:
    """The Message (or its events) made from the reply of its one choice."""

    content_type = "text/event-stream"

    def __init__(self, reply: Reply, request: MessagesRequest):
        self.reply = reply
        self.id = "msg_" + uuid.uuid4().hex
        self.blocks = 0  # blocks started
        self.open = None  # the type of the last one while it is not stopped

    def _message(self, content: list, stop_reason, stop_sequence, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.reply.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def _stop_reason(self) -> tuple:
        """(stop_reason, stop_sequence) of the choice's finish."""
        choice = self.reply.choices[0]
        if choice.finish == "tool_calls":
            return "tool_use", None
        if choice.finish == "length":
            return "max_tokens", None
        hit = choice.stop_sequence  # the runtime names the stop string that ended it
        return ("stop_sequence", hit) if hit else ("end_turn", None)

    def whole(self) -> dict:
        d = self.reply.choices[0].whole()
        content = [_thinking_block(d.reasoning)] if d.reasoning else []
        content += [{"type": "text", "text": d.text}] if d.text else []
        content += [_tool_use(call) for call in d.calls]
        return self._message(content, *self._stop_reason(), _usage(self.reply.usage()))

    def _start(self, block: dict) -> list:
        frames = self._stop()
        frames.append(sse("content_block_start", {"type": "content_block_start", "index": self.blocks,
                                                  "content_block": block}))
        self.blocks, self.open = self.blocks + 1, block["type"]
        return frames

    def _delta(self, delta: dict) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})

    def _stop(self) -> list:
        if not self.open:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]

    def opening(self) -> list:
        """message_start (the prompt's tokens; what the cache restored comes in message_delta) and a ping."""
        usage = {"input_tokens": len(self.reply.plan.requests[0].prompt_ids), "output_tokens": 0,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        return [sse("message_start", {"type": "message_start", "message": self._message([], None, None, usage)}),
                sse("ping", {"type": "ping"})]

    def add(self, deltas) -> list:
        frames = []
        for d in deltas:
            if d.reasoning:
                if self.open != "thinking":
                    frames += self._start(_thinking_block(""))
                frames.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
            if d.text:
                if self.open != "text":
                    frames += self._start({"type": "text", "text": ""})
                frames.append(self._delta({"type": "text_delta", "text": d.text}))
            for call in d.calls:  # each call comes whole
                block = _tool_use(call)
                frames += self._start({**block, "input": {}})
                frames.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])}))
                frames += self._stop()
        return frames

    def closing(self) -> list:
        stop_reason, stop_sequence = self._stop_reason()
        return self._stop() + [
            sse("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                  "usage": _usage(self.reply.usage())}),
            sse("message_stop", {"type": "message_stop"})]

    def failure(self, error_body: dict) -> bytes:
        return sse("error", error_body)



def error_body(e: ApiError) -> dict:
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": str(e)}}


ADAPTERS = {("POST", "/v1/messages"): Adapter(parse_request, MessageReply, param)}
ROUTES = {("POST", "/v1/messages/count_tokens"): count_tokens}
ERROR_BODIES = {"/v1/messages": error_body, "/v1/messages/count_tokens": error_body}
