"""OpenAI's Responses API on the HTTP port (POST /v1/responses), served over chat completions
(openai_api.Adapter), so `client.responses.create` / `.stream` (and Codex-style agents) work
unchanged and a greedy input gets the same text as through /v1/chat/completions.

Implemented: `model`, `input` (a string, or items: messages with text content (system and developer
ones after the first turn stay where they stand: chat_format.place_system), `function_call`
(with its `namespace`) and `function_call_output`, `custom_tool_call` and its output, `reasoning`),
`instructions`, `max_output_tokens`, `temperature`, `top_p`, `tools` (function tools, `strict`
honoured as in chat; `namespace` tools flattened into functions named NAMESPACE__NAME, their calls
mapped back; `custom` free-form tools as a function of one string `input`, a regex or Lark grammar
held over it (tools.custom_function), their calls coming back as custom_tool_call items; hosted tools left out of the prompt),
`tool_choice`, `parallel_tool_calls`, `text.format` (text, json_object, json_schema: constrained
decoding), `stream` with the Responses event sequence, `usage`. Where the checkpoint thinks
(think tokens), its reasoning is a `reasoning` output item (its text a `reasoning_text` part,
streamed as response.reasoning_text.delta events) and usage counts its tokens; with
include ["reasoning.encrypted_content"] the item carries its text sealed (sealed.py), read back
when the client (Codex, store false) returns the item in `input`; a `reasoning` item in `input`
goes back into the prompt as the next assistant turn's reasoning_content (chat_format.py, tools.py).

Codex CLI's default request works unchanged: what changes nothing here is accepted and named in
the access log (openai_api.py's compatibility rule): `reasoning` (effort, summary; effort "none"
turns thinking off where the template can), other `include` values, `client_metadata`, `metadata`,
`user`, `safety_identifier`, `prompt_cache_key`, `store` (nothing is stored), `service_tier`,
`truncation` "auto", `text.verbosity`, hosted tools. Stateless: `previous_response_id`,
`conversation` and `background` are refused by name, as are `prompt`, `top_logprobs`,
`max_tool_calls` and unknown fields (400, OpenAI's error shape).
"""

import json
import time
import uuid
from functools import partial
from typing import Any, List, Optional, Union

from typing_extensions import Required, TypedDict

from ..runtime.request import RequestError
from .chat_format import place_system
from .openai_api import Adapter, Number, adapted
from .parts import closed, open_keys
from .protocol import FieldPolicy, Reply, ToolCall, Typed, check_fields, parse, sse
from .sealed import Sealer
from .tools import CUSTOM_INPUT, custom_function, custom_input

HINTS = ("metadata", "user", "safety_identifier", "prompt_cache_key", "client_metadata", "prompt_cache_retention")
FIELDS = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
          "parallel_tool_calls", "text", "stream", "store", "truncation", "service_tier", "stream_options",
          "reasoning", "include")
REFUSED = {"previous_response_id": "responses are not stored (send the whole conversation as input)",
           "conversation": "conversations are not stored (send the whole conversation as input)",
           "background": "background responses are not supported",
           "prompt": "stored prompt templates are not supported",
           "top_logprobs": "not supported here (/v1/chat/completions has logprobs)",
           "max_tool_calls": "not supported"}
POLICY = FieldPolicy(FIELDS, hints={name: () for name in HINTS}, refused=REFUSED, absent=(None, [], False))
NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input", "stop": "input"}
ENCRYPTED = "reasoning.encrypted_content"
NAMESPACE_SEP = "__"  # a namespace tool's function name: NAMESPACE__NAME (as MCP tools are named)


@open_keys
class Part(TypedDict, total=False):
    """A text part of a message or output (input_text, output_text, text), or of a reasoning item
    (reasoning_text, summary_text)."""

    type: Required[str]
    text: str


@open_keys
class Item(TypedDict, total=False):
    """An `input` item; its `type` (default message) says which keys it needs (_input)."""

    type: str
    role: str  # message
    content: Union[str, List[Part], None]  # message, reasoning
    summary: Optional[List[Part]]  # reasoning
    encrypted_content: Optional[str]  # reasoning
    call_id: str  # function_call, custom_tool_call and their outputs
    name: str
    namespace: Optional[str]
    arguments: str  # function_call
    input: str  # custom_tool_call
    output: Union[str, List[Part]]  # the outputs


@closed
class ResponsesCustomFormat(TypedDict, total=False):
    type: Required[str]  # text or grammar
    syntax: str
    definition: str


@open_keys
class ResponsesTool(TypedDict, total=False):
    """A function, custom or namespace tool (_tools; a namespace's tools are functions by
    default), or a hosted one (web_search, …: only its type is read)."""

    type: str
    name: str
    description: Optional[str]
    parameters: Optional[dict]
    strict: Optional[bool]
    format: Optional[ResponsesCustomFormat]  # custom
    tools: List["ResponsesTool"]  # namespace


@open_keys
class ResponsesToolChoice(TypedDict, total=False):
    type: Required[str]  # function, custom or allowed_tools
    name: str
    namespace: Optional[str]
    mode: str  # allowed_tools


@closed
class TextFormat(TypedDict, total=False):
    type: Required[str]  # text, json_object or json_schema
    name: str
    schema: dict
    strict: Optional[bool]
    description: Optional[str]


@closed
class TextOptions(TypedDict, total=False):
    format: Optional[TextFormat]
    verbosity: Optional[str]


@closed
class ReasoningOptions(TypedDict, total=False):
    effort: Optional[str]
    summary: Optional[str]
    generate_summary: Optional[str]


@closed
class StreamOptions(TypedDict, total=False):
    include_obfuscation: Optional[bool]


class ResponsesRequest(Typed):
    """A /v1/responses body, typed; the reply repeats some of it (ResponsesReply)."""

    model: Any = None
    input: Union[str, List[Item], None] = None  # _input
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    tools: Optional[List[ResponsesTool]] = None  # _tools
    tool_choice: Union[str, ResponsesToolChoice] = "auto"
    parallel_tool_calls: bool = True
    text: Optional[TextOptions] = None  # _format
    stream: bool = False
    store: Any = None
    truncation: Optional[str] = None
    service_tier: Any = None
    stream_options: Optional[StreamOptions] = None
    reasoning: Optional[ReasoningOptions] = None
    include: Optional[List[str]] = None
    metadata: Any = None


def _content(content, where: str) -> str:
    """A message's content or an output (a string, or its text parts joined)."""
    if content is None:
        raise RequestError(where, "expected a string or a list of text parts")
    if isinstance(content, str):
        return content
    for k, part in enumerate(content):
        if part["type"] not in ("input_text", "output_text", "text") or "text" not in part:
            raise RequestError(f"{where}[{k}]", f"only text parts are supported, got {part['type']!r}")
    return "".join(part["text"] for part in content)


def _reasoning(item: dict, where: str, ignored: list, sealer: Sealer):
    """A reasoning item's text: its reasoning_text parts (else its summary's), joined, or what its
    encrypted_content (one this server sealed) holds; None: nothing this server can read."""
    if item.get("encrypted_content"):
        text = sealer.unseal(item["encrypted_content"])
        if text is not None:
            return text
        ignored.append("input.reasoning.encrypted_content")  # another server's (or key's): left out
    parts = item.get("content") or item.get("summary") or []
    if isinstance(parts, str) or not all(p["type"] in ("reasoning_text", "summary_text", "text") and "text" in p
                                         for p in parts):
        raise RequestError(f"{where}.content", "expected reasoning_text parts")
    return "".join(p["text"] for p in parts) if parts else None


def _call_message(out: list, call: dict) -> None:
    """A tool call joins the assistant message before it, or begins one."""
    if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
        out[-1]["tool_calls"].append(call)
    elif out and out[-1]["role"] == "assistant":
        out[-1]["tool_calls"] = [call]
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _input(items, thinking: bool, ignored: list, sealer: Sealer) -> list:
    """`input` as chat messages: function_call (and custom_tool_call) items join an assistant
    message's tool_calls, their outputs become tool messages, a reasoning item begins an assistant
    message (its reasoning_content) that the next message or calls complete."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise RequestError("input", "expected a string or a non-empty list of items")
    out = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{where}.role", "expected user, assistant, system or developer")
            content = _content(item.get("content"), f"{where}.content")
            if item["role"] == "assistant" and out and _reasoning_only(out[-1]):
                out[-1]["content"] = content
            else:
                out.append({"role": item["role"], "content": content})
        elif kind == "reasoning":
            text = _reasoning(item, where, ignored, sealer)
            if not thinking or text is None:  # the template has no place for it (or nothing to place)
                ignored.append("input.reasoning")
                continue
            out.append({"role": "assistant", "content": None, "reasoning_content": text})
        elif kind in ("function_call", "custom_tool_call"):
            value = "arguments" if kind == "function_call" else "input"
            if not all(k in item for k in ("call_id", "name", value)):
                raise RequestError(where, f"a {kind} item needs call_id, name and {value} (strings)")
            name = item["name"]
            if item.get("namespace"):
                name = item["namespace"] + NAMESPACE_SEP + name
            arguments = item["arguments"] if kind == "function_call" else json.dumps({CUSTOM_INPUT: item["input"]})
            _call_message(out, {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if "call_id" not in item:
                raise RequestError(f"{where}.call_id", "expected the call_id of the call it answers")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _content(item.get("output", ""), f"{where}.output")})
        else:
            raise RequestError(f"{where}.type", f"items of type {kind!r} are not supported")
    for message in out:
        if _reasoning_only(message):
            message["content"] = ""  # reasoning and nothing after it
    return out


def _reasoning_only(message: dict) -> bool:
    return message["role"] == "assistant" and message.get("content") is None and "tool_calls" not in message


def _function(tool: dict, where: str, forced: bool, name=None) -> dict:
    extra = next((key for key in tool if key not in ("type", "name", "description", "parameters", "strict",
                                                        "defer_loading")), None)
    if extra is not None or "name" not in tool:
        raise RequestError(where + (f".{extra}" if extra else ""), "expected {type, name, description, parameters}")
    function = {"name": name or tool["name"], "description": tool.get("description") or "",
                "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    return {"type": "function", "function": {**function, **({"strict": True} if tool.get("strict") else {})}}


def _custom(tool: dict, where: str) -> dict:
    """A custom (free-form) tool as its function of one string (tools.custom_function)."""
    extra = next((key for key in tool if key not in ("type", "name", "description", "format")), None)
    if extra is not None or "name" not in tool:
        raise RequestError(where + (f".{extra}" if extra else ""), "expected {type, name, description, format}")
    form = tool.get("format") or {"type": "text"}
    if form["type"] not in ("text", "grammar"):
        raise RequestError(f"{where}.format", "expected {\"type\": \"text\"} or {\"type\": \"grammar\", \"syntax\", \"definition\"}")
    grammar = None
    if form["type"] == "grammar":
        grammar = form.get("syntax"), form.get("definition")
        if grammar[0] not in ("lark", "regex") or grammar[1] is None:
            raise RequestError(f"{where}.format", "a grammar needs syntax \"lark\" or \"regex\" and a string definition")
    return custom_function(tool["name"], tool.get("description") or "", grammar, f"{where}.format.definition")


def _tools(tools, forced: bool, ignored: list) -> tuple:
    """(function tools for the chat template, how their calls map back: function name -> (kind,
    namespace, name)). Namespaces are flattened (NAMESPACE__NAME); hosted tools this server cannot
    run (web_search, file_search, …) are left out of the prompt and named in the access log."""
    out, names = [], {}
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool, where, forced))
            names[tool["name"]] = ("function", None, tool["name"])
        elif kind == "custom":
            out.append(_custom(tool, where))
            names[tool["name"]] = ("custom", None, tool["name"])
        elif kind == "namespace":
            if "name" not in tool or "tools" not in tool:
                raise RequestError(where, "a namespace needs a name and a list of tools")
            for j, inner in enumerate(tool["tools"]):
                inner_kind = inner.get("type", "function")
                if inner_kind != "function":
                    ignored.append(f"tools.namespace.{inner_kind}")
                    continue
                flat = tool["name"] + NAMESPACE_SEP + str(inner.get("name"))
                out.append(_function(inner, f"{where}.tools[{j}]", forced, flat))
                names[flat] = ("function", tool["name"], inner["name"])
        elif kind is not None:
            ignored.append(f"tools.{kind}")  # a hosted tool: none runs here
        else:
            raise RequestError(f"{where}.type", "expected a tool type")
    return out, names


def _tool_choice(choice, names: dict):
    if choice in (None, "auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice["type"] in ("function", "custom") and "name" in choice:
        name = choice["name"]
        if choice.get("namespace"):
            name = f"{choice['namespace']}{NAMESPACE_SEP}{name}"
        return {"type": "function", "function": {"name": name}}
    if isinstance(choice, dict) and choice["type"] == "allowed_tools" and choice.get("mode") in ("auto", "required"):
        return choice["mode"]  # every tool given stays allowed (the template shows them all)
    raise RequestError("tool_choice", "expected \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": …}")


def _format(text: Optional[dict], ignored: list):
    """`text` {format, verbosity} (TextOptions): its format as chat's response_format."""
    if text is None:
        return None
    if text.get("verbosity") is not None:
        if text["verbosity"] not in ("low", "medium", "high"):
            raise RequestError("text.verbosity", "expected low, medium or high")
        ignored.append("text.verbosity")  # the chat template has no knob for it
    form = text.get("format")
    if form is None or form == {"type": "text"}:
        return None
    if form["type"] not in ("json_object", "json_schema"):
        raise RequestError("text.format", "expected text, json_object or json_schema")
    if form["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}}


def _reasoning_options(reasoning: Optional[dict], tokenizer, ignored: list, out: dict) -> None:
    """`reasoning` {effort, summary}: where the checkpoint thinks, effort "none" tells the chat
    template enable_thinking false; every other value changes nothing here (the template has no
    effort knob, and the reasoning comes whole, not summarised)."""
    for key, value in (reasoning or {}).items():
        if value is None:
            continue
        if key == "effort" and value == "none" and tokenizer.has_thinking:
            out["chat_template_kwargs"] = {"enable_thinking": False}
        else:
            ignored.append(f"reasoning.{key}")


def _include(include: Optional[List[str]], ignored: list) -> set:
    for name in include or []:
        if name != ENCRYPTED:
            ignored.append(f"include.{name}")  # data of tools that never run here, or logprobs (chat has them)
    return set(include or [])


def _hints(request: ResponsesRequest, ignored: list) -> None:
    """store, truncation "auto", service_tier and stream_options' obfuscation change nothing here."""
    if request.store:
        ignored.append("store")  # nothing is stored: previous_response_id stays refused
    if request.truncation not in (None, "disabled"):
        if request.truncation != "auto":
            raise RequestError("truncation", "expected \"auto\" or \"disabled\"")
        ignored.append("truncation")  # a request that does not fit is refused rather than cut
    if request.service_tier is not None:
        ignored.append("service_tier")
    if (request.stream_options or {}).get("include_obfuscation"):
        ignored.append("stream_options.include_obfuscation")


def parse_request(body: dict, info, tokenizer, sealer: Sealer) -> tuple:
    """(the typed request, the ChatRequest it becomes); RequestError names the Responses field."""
    ignored = check_fields(body, POLICY)
    request = parse(ResponsesRequest, body)
    _hints(request, ignored)
    tools, names = _tools(request.tools, False, ignored) if request.tools else ([], {})
    choice = _tool_choice(request.tool_choice, names)
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else []) \
        + _input(request.input, tokenizer.has_thinking, ignored, sealer)
    messages = place_system(messages, tokenizer)  # developer messages after the first turn stay there
    out = {"messages": messages, "stream": request.stream}
    _reasoning_options(request.reasoning, tokenizer, ignored, out)
    _include(request.include, ignored)
    for name, chat in (("model", "model"), ("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                       ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls")):
        if getattr(request, name) is not None:
            out[chat] = getattr(request, name)
    if tools:
        out["tools"] = tools
        if choice is not None:
            out["tool_choice"] = choice
    elif choice not in (None, "auto", "none"):
        out["tool_choice"] = choice  # chat refuses it: no tools
    response_format = _format(request.text, ignored)
    if response_format:
        out["response_format"] = response_format
    return request, adapted(out, info, ignored, param)


def tool_names(tools) -> dict:
    """How the calls of a request's flattened tools map back (function name -> (kind, namespace, name))."""
    try:
        return _tools(tools, False, [])[1] if isinstance(tools, list) else {}
    except RequestError:
        return {}


def param(name: str) -> str:
    head, dot, rest = name.partition(".")
    return NAMES.get(head, head) + dot + rest if head in NAMES else name


class ResponsesReply:
    """What a Responses client gets, rendered from the typed reply (protocol.Reply) of its one choice."""

    content_type = "text/event-stream"

    def __init__(self, reply: Reply, request: ResponsesRequest, sealer: Sealer):
        self.reply, self.request, self.sealer = reply, request, sealer
        self.id, self.created = "resp_" + uuid.uuid4().hex, int(time.time())
        self.sequence = 0
        self.output = []  # items so far
        self.text = None  # the open message item's text, or None
        self.reasoning = None  # the open reasoning item's text, or None
        self.names = tool_names(request.tools)  # flattened tools' calls -> their own kind, namespace and name
        include = request.include
        self.encrypt = isinstance(include, list) and ENCRYPTED in include  # reasoning items carry it sealed

    def _response(self, status: str, usage=None) -> dict:
        r = self.request
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": r.model or self.reply.model, "output": self.output, "error": None,
                "incomplete_details": incomplete, "instructions": r.instructions,
                "max_output_tokens": r.max_output_tokens, "temperature": r.temperature,
                "top_p": r.top_p, "tools": r.tools or [], "tool_choice": r.tool_choice,
                "parallel_tool_calls": r.parallel_tool_calls, "text": r.text or {"format": {"type": "text"}},
                "truncation": "disabled", "store": False, "metadata": r.metadata or {}, "usage": usage}

    def _usage(self) -> dict:
        usage = self.reply.usage()
        return {"input_tokens": usage.prompt, "input_tokens_details": {"cached_tokens": usage.cached},
                "output_tokens": usage.completion, "output_tokens_details": {"reasoning_tokens": usage.reasoning or 0},
                "total_tokens": usage.prompt + usage.completion}

    def _event(self, kind: str, **data) -> bytes:
        self.sequence += 1
        return sse(kind, {"type": kind, "sequence_number": self.sequence - 1, **data})

    @staticmethod
    def _message(text: str, status: str) -> dict:
        return {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed"
                or text else []}

    def _reasoning(self, text: str, status: str) -> dict:
        item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}] if status == "completed" or text else []}
        if self.encrypt and status == "completed":
            item["encrypted_content"] = self.sealer.seal(text)  # read back when the client returns it in input
        return item

    def _call(self, call: ToolCall) -> dict:
        """A call as its tool's kind: a function_call (with its namespace, where the tool had one)
        or a custom tool's custom_tool_call, whose input is the string argument."""
        name, arguments = call.name, call.arguments
        kind, namespace, own = self.names.get(name, ("function", None, name))
        if kind == "custom":
            return {"type": "custom_tool_call", "id": "ctc_" + uuid.uuid4().hex[:24], "call_id": call.id,
                    "name": own, "input": custom_input(arguments), "status": "completed"}
        return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": call.id,
                **({"namespace": namespace} if namespace else {}), "name": own, "arguments": arguments,
                "status": "completed"}

    def opening(self) -> list:
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    def _open_text(self) -> list:
        item = self._message("", "in_progress")
        self.output.append(item)
        self.text = []
        index = len(self.output) - 1
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})]

    def _open_reasoning(self) -> list:
        frames = self._close_text()
        item = self._reasoning("", "in_progress")
        self.output.append(item)
        self.reasoning = []
        index = len(self.output) - 1
        return frames + [self._event("response.output_item.added", output_index=index, item=item),
                         self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part={"type": "reasoning_text", "text": ""})]

    def _close_reasoning(self) -> list:
        if self.reasoning is None:
            return []
        index, text = len(self.output) - 1, "".join(self.reasoning)
        item = self.output[index] = {**self._reasoning(text, "completed"), "id": self.output[index]["id"]}
        self.reasoning = None
        return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=item["content"][0]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _close_text(self) -> list:
        if self.text is None:
            return []
        index, text = len(self.output) - 1, "".join(self.text)
        item = self.output[index] = {**self.output[index], **self._message(text, "completed"), "id": self.output[index]["id"]}
        part = item["content"][0]
        self.text = None
        return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def add(self, deltas) -> list:
        frames = []
        for d in deltas:
            if d.reasoning:
                if self.reasoning is None:
                    frames += self._open_reasoning()
                self.reasoning.append(d.reasoning)
                frames.append(self._event("response.reasoning_text.delta", item_id=self.output[-1]["id"],
                                          output_index=len(self.output) - 1, content_index=0, delta=d.reasoning))
            if d.text:
                frames += self._close_reasoning()
                if self.text is None:
                    frames += self._open_text()
                self.text.append(d.text)
                frames.append(self._event("response.output_text.delta", item_id=self.output[-1]["id"],
                                          output_index=len(self.output) - 1, content_index=0, delta=d.text,
                                          logprobs=[]))
            for call in d.calls:
                frames += self._close_reasoning() + self._close_text()
                item = self._call(call)
                self.output.append(item)
                index = len(self.output) - 1
                if item["type"] == "custom_tool_call":
                    frames += [self._event("response.output_item.added", output_index=index,
                                           item={**item, "input": "", "status": "in_progress"}),
                               self._event("response.custom_tool_call_input.delta", item_id=item["id"],
                                           output_index=index, delta=item["input"]),
                               self._event("response.custom_tool_call_input.done", item_id=item["id"],
                                           output_index=index, input=item["input"])]
                else:
                    frames += [self._event("response.output_item.added", output_index=index,
                                           item={**item, "arguments": "", "status": "in_progress"}),
                               self._event("response.function_call_arguments.delta", item_id=item["id"],
                                           output_index=index, delta=item["arguments"]),
                               self._event("response.function_call_arguments.done", item_id=item["id"],
                                           output_index=index, arguments=item["arguments"], name=item["name"])]
                frames.append(self._event("response.output_item.done", output_index=index, item=item))
        return frames

    def _status(self, finish) -> str:
        return "incomplete" if finish == "length" else "completed"

    def closing(self) -> list:
        frames = self._close_reasoning() + self._close_text()
        status = self._status(self.reply.choices[0].finish)
        return frames + [self._event(f"response.{status}", response=self._response(status, self._usage()))]

    def failure(self, error_body: dict) -> bytes:
        error = error_body["error"]
        return self._event("error", code=error.get("code") or error.get("type"), message=error["message"],
                           param=error.get("param"))

    def whole(self) -> dict:
        d = self.reply.choices[0].whole()
        if d.reasoning:
            self.output.append(self._reasoning(d.reasoning, "completed"))
        if d.text or not (d.calls or d.reasoning):
            self.output.append(self._message(d.text, "completed"))
        self.output += [self._call(call) for call in d.calls]
        return self._response(self._status(d.finish), self._usage())


ROUTE = ("POST", "/v1/responses")


def adapters(sealer: Sealer) -> dict:
    """The Responses route's Adapter, sealing reasoning with the front end's `sealer`."""
    return {ROUTE: Adapter(partial(parse_request, sealer=sealer), partial(ResponsesReply, sealer=sealer), param)}
ROUTES, ERROR_BODIES = {}, {}
