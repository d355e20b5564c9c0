"""Ollama's API on the HTTP port, served over chat completions (openai_api.Adapter), so the
`ollama` package works unchanged and a greedy message gets the same text as through
/v1/chat/completions.

Implemented: GET /api/version, GET /api/tags, POST /api/show, GET /api/ps (the one model,
always loaded); POST /api/chat and /api/generate, streamed as NDJSON unless `stream: false`,
the last line (or the whole answer) `done: true` with done_reason and Ollama's counts and
durations (nanoseconds). `options`: temperature, top_p, top_k, min_p, seed, stop,
num_predict (-1, -2: the server's default), repeat_penalty, repeat_last_n, presence_penalty,
frequency_penalty; num_ctx only as the server's context length; typical_p 1, tfs_z 1,
mirostat 0 only; num_keep, mirostat_tau, mirostat_eta, penalize_newline change nothing
here and are taken. `format` ("json" or a JSON schema, strict), `tools`, tool calls and
tool messages, `keep_alive` (no effect: never unloaded), /api/generate's `system` and `raw`.
Where the checkpoint thinks (think tokens), its reasoning comes back in `thinking` (the
message's in chat, the answer's in generate), an assistant message's `thinking` goes back
into the prompt (as reasoning_content), and `think` false tells the chat template
enable_thinking false; elsewhere `think` is only false. Defaults are the server's (as chat
completions'), not Ollama's: no Modelfile sets any.

Accepted with no effect, named in the access log: load-time options, num_ctx other than the
server's context, `think` true or an effort level where the checkpoint has no think tokens
(effort levels anywhere), `thinking` in messages there. Refused by name (400): images, logprobs,
generate's suffix / context / template and image-generation fields, an empty prompt;
unknown fields and options. Another model: 404. Model management (pull, push, create,
copy) and embeddings: 501.
"""

import hashlib
import json
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, List, Optional, Union

from typing_extensions import Required, TypedDict

from ..runtime.request import RequestError
from .openai_api import Adapter, adapted
from .parts import ContentPart, Tool, closed, open_keys
from .protocol import ApiError, FieldPolicy, Reply, ToolCall, Typed, check_fields, ndjson, parse

# Ollama option -> the chat-completions field(s) it becomes (repeat_last_n: llama.cpp's one window for all penalties).
OPTIONS = {"temperature": ("temperature",), "top_p": ("top_p",), "top_k": ("top_k",), "min_p": ("min_p",),
           "seed": ("seed",), "stop": ("stop",), "num_predict": ("max_tokens",),
           "repeat_penalty": ("repetition_penalty",), "presence_penalty": ("presence_penalty",),
           "frequency_penalty": ("frequency_penalty",),
           "repeat_last_n": ("repetition_context_size", "presence_context_size", "frequency_context_size")}
NEUTRAL_OPTIONS = {"typical_p": 1, "tfs_z": 1, "mirostat": 0}  # the values that turn these samplers off
NO_EFFECT = ("num_keep", "mirostat_tau", "mirostat_eta", "penalize_newline")  # context shift, mirostat: never here
LOAD_TIME = ("numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
             "use_mmap", "use_mlock", "embedding_only", "num_thread")
PARAMS = {chat: f"options.{name}" for name, chats in OPTIONS.items() for chat in chats}  # error names back
COMMON = ("model", "stream", "format", "options", "keep_alive", "think")
CHAT_FIELDS = COMMON + ("messages", "tools")
GENERATE_FIELDS = COMMON + ("prompt", "system", "raw")
REFUSED = {"images": "images are not supported (a text-only model)",
           "logprobs": "not implemented in Ollama's API here (/v1/chat/completions has it)",
           "top_logprobs": "not implemented in Ollama's API here (/v1/chat/completions has it)",
           "suffix": "text after the completion (fill-in-the-middle) is not supported",
           "context": "token context from an earlier reply is not supported (send the history as /api/chat messages)",
           "template": "the checkpoint's chat template is the only one",
           "width": "image generation is not supported", "height": "image generation is not supported",
           "steps": "image generation is not supported"}
POLICIES = {chat: FieldPolicy(CHAT_FIELDS if chat else GENERATE_FIELDS, refused=REFUSED, absent=(None, "", [], False))
            for chat in (True, False)}
SHOW_POLICY = FieldPolicy(("model", "name"), refused={"verbose": "not supported (the tokenizer's vocabulary is not listed)"},
                          absent=(None, False))
MANAGEMENT = ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/embed", "/api/embeddings")
NEVER = "9999-12-31T23:59:59Z"  # ps's expires_at: the model is never unloaded


@open_keys
class OllamaFunction(TypedDict, total=False):
    name: Required[str]
    arguments: dict


@open_keys
class OllamaCall(TypedDict):
    function: OllamaFunction


@closed
class OllamaMessage(TypedDict, total=False):
    role: str
    content: Union[str, List[ContentPart], None]
    tool_calls: Optional[List[OllamaCall]]
    tool_name: Optional[str]  # a tool message: the tool whose call it answers
    images: Optional[list]  # refused where not empty
    thinking: Optional[str]  # an assistant's earlier reasoning


class OllamaRequest(Typed):
    """What /api/chat and /api/generate bodies share, typed."""

    model: Any = None  # the served id (_model)
    stream: bool = True
    format: Union[str, dict, None] = None  # "json" or a JSON schema (_format)
    options: Optional[dict] = None  # _options
    keep_alive: Union[int, float, str, None] = None  # a duration: never unloaded here
    think: Union[bool, str, None] = None  # true, false or an effort level


class OllamaChat(OllamaRequest):
    messages: Optional[List[OllamaMessage]] = None  # _messages
    tools: Optional[List[Tool]] = None  # given as they are (Ollama's are OpenAI's)


class OllamaGenerate(OllamaRequest):
    prompt: Any = None
    system: Optional[str] = None
    raw: bool = False


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _model(name, info, key: str = "model") -> str:
    """The model a body names (its `key`): the server's id, or it with Ollama's default tag; else 404."""
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{key}: required (this server serves '{info.model_id}')")
    if name not in (info.model_id, f"{info.model_id}:latest"):
        raise ApiError(404, f"model '{name[:200]}' not found")
    return name


def _config(tokenizer) -> tuple:
    """(config.json, its path) of the checkpoint the tokenizer came from; ({}, None) where unknown."""
    path = Path(getattr(getattr(tokenizer, "_tokenizer", tokenizer), "name_or_path", "") or ".") / "config.json"
    try:
        return json.loads(path.read_text()), path
    except (OSError, ValueError):
        return {}, None


def _facts(tokenizer, info) -> dict:
    """What tags, show and ps say of the model: weights' bytes (the ranks' shares), details, digest."""
    config, path = _config(tokenizer)
    size = sum(r.get("parameter_bytes", 0) for r in info.ranks)
    quant = config.get("quantization") or {}
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if quant.get("bits"):  # packed weights plus a 16-bit scale and bias per group
        level, per_param = f"Q{quant['bits']}", quant["bits"] / 8 + 4 / quant.get("group_size", 64)
    else:
        level, per_param = {"float32": "F32", "float16": "F16"}.get(dtype, "BF16"), 4 if dtype == "float32" else 2
    count = int(size / per_param)
    details = {"parent_model": "", "format": "safetensors", "family": config.get("model_type", "afmoe"),
               "families": [config.get("model_type", "afmoe")],
               "parameter_size": f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M",
               "quantization_level": level}
    seed = (path.read_bytes() if path else b"") + info.model_id.encode()
    modified = datetime.fromtimestamp(path.stat().st_mtime if path else time.time(), timezone.utc).isoformat()
    return {"name": info.model_id, "model": info.model_id, "modified_at": modified, "size": size,
            "digest": hashlib.sha256(seed).hexdigest(), "details": details, "config": config, "count": count}


def _version(body, scheduler, tokenizer, info):
    return 200, {"version": metadata.version("trinity-pipeline")}


def _tags(body, scheduler, tokenizer, info):
    facts = _facts(tokenizer, info)
    return 200, {"models": [{k: facts[k] for k in ("name", "model", "modified_at", "size", "digest", "details")}]}


def _ps(body, scheduler, tokenizer, info):
    facts = _facts(tokenizer, info)
    model = {k: facts[k] for k in ("name", "model", "size", "digest", "details")}
    return 200, {"models": [{**model, "expires_at": NEVER, "size_vram": facts["size"], "context_length": info.max_context}]}


def _show(body, scheduler, tokenizer, info):
    check_fields(body, SHOW_POLICY)
    key = "name" if "name" in body and "model" not in body else "model"  # "name": Ollama's older spelling
    _model(body.get(key), info, key)
    facts = _facts(tokenizer, info)
    config, arch = facts["config"], facts["details"]["family"]
    keys = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
            "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
            "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok", "vocab_size": "vocab_size"}
    model_info = {"general.architecture": arch, "general.parameter_count": facts["count"],
                  f"{arch}.context_length": info.max_context,
                  **{f"{arch}.{k}": config[c] for k, c in keys.items() if c in config}}
    capabilities = ["completion"] + (["tools"] if tokenizer.has_tool_calling else []) \
        + (["thinking"] if tokenizer.has_thinking else [])
    return 200, {"modelfile": f"FROM {info.model_id}\n", "parameters": "", "template": tokenizer.chat_template or "",
                 "details": facts["details"], "model_info": model_info, "capabilities": capabilities,
                 "modified_at": facts["modified_at"]}


def _not_here(path: str):
    def answer(body, scheduler, tokenizer, info):
        raise ApiError(501, f"{path} is not supported: this server serves one model, loaded at its start"
                       + (", and does not embed" if "embed" in path else ""))
    return answer


# ---- requests: an Ollama body as a chat-completions (or, raw, a completions) body


def _options(options: Optional[dict], info, ignored: list) -> dict:
    if options is None:
        return {}
    out = {}
    for name, value in options.items():
        where = f"options.{name}"
        if value is None:
            continue
        if name in OPTIONS:
            out.update({field: value for field in OPTIONS[name]})
        elif name in NEUTRAL_OPTIONS:
            if isinstance(value, bool) or value != NEUTRAL_OPTIONS[name]:
                raise RequestError(where, f"only {NEUTRAL_OPTIONS[name]} (off) is supported")
        elif name == "num_ctx":
            if not isinstance(value, int) or isinstance(value, bool):
                raise RequestError(where, "expected an integer")
            if value != info.max_context:
                ignored.append(where)  # the context is the server's (see /api/show); a longer prompt is refused
        elif name in LOAD_TIME or name in NO_EFFECT:
            ignored.append(where)  # load-time options (the model is loaded once), or samplers never used here
        else:
            raise RequestError(where, "unknown option")
    if out.get("max_tokens") in (-1, -2):  # Ollama's "unlimited" and "fill the context": the server's default
        del out["max_tokens"]
    if isinstance(out.get("repetition_context_size"), int) and out["repetition_context_size"] < 1:
        raise RequestError("options.repeat_last_n", "must be at least 1 here")
    return out


def _format(value):
    """Ollama's `format` as response_format."""
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value, "strict": True}}
    raise RequestError("format", f"expected \"json\" or a JSON schema object, got {json.dumps(value)[:60]}")


def _parse(body: dict, chat: bool, info, thinking: bool, ignored: list):
    """The typed request; refused and unknown fields are errors naming them, another model 404."""
    ignored += check_fields(body, POLICIES[chat])
    request = parse(OllamaChat if chat else OllamaGenerate, body)
    think = request.think
    if isinstance(think, str) and think not in ("low", "medium", "high"):
        raise RequestError("think", "expected true, false, \"low\", \"medium\" or \"high\"")
    if isinstance(think, str) or (think and not thinking):
        ignored.append("think")  # effort levels: the template has no knob; where the model does not think: none
    if request.keep_alive is not None:
        ignored.append("keep_alive")  # never unloaded
    _model(request.model, info)
    return request


def _common(request: OllamaRequest, info, thinking: bool, ignored: list) -> dict:
    """The chat fields every Ollama request gives: stream, options, the template's variables."""
    return {"stream": request.stream, **_options(request.options, info, ignored),
            **({"chat_template_kwargs": {"enable_thinking": False}} if thinking and request.think is False else {})}


def _messages(messages, thinking: bool, ignored: list) -> list:
    """Ollama messages as OpenAI's: tool calls get ids, and tool results the id of the call they answer."""
    if not messages:
        raise RequestError("messages", "expected a non-empty list of messages")
    out, pending = [], []  # pending: (id, name) of calls not answered yet
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.get("images"):
            raise RequestError(f"{where}.images", REFUSED["images"])
        calls = m.get("tool_calls") or []
        message = {"role": m.get("role"), "content": m.get("content", None if calls else "")}
        if m.get("thinking"):
            if m.get("role") != "assistant":
                raise RequestError(f"{where}.thinking", "only assistant messages carry thinking")
            if thinking:
                message["reasoning_content"] = m["thinking"]
            else:
                ignored.append("messages.thinking")  # the template has no place for it
        for k, call in enumerate(calls):
            function = call["function"]
            pending.append((f"call_{i}_{k}", function["name"]))
            message.setdefault("tool_calls", []).append({"id": pending[-1][0], "type": "function", "function": {
                "name": function["name"], "arguments": function.get("arguments", {})}})
        if m.get("role") == "tool":
            name = m.get("tool_name")
            match = next((c for c in pending if name is None or c[1] == name), None)
            if match:
                pending.remove(match)
            message.update({"tool_call_id": match[0] if match else f"call_{i}", **({"name": name} if name else {})})
        out.append(message)
    return out


def parse_chat(body: dict, info, tokenizer) -> tuple:
    """(the typed request, the ChatRequest it becomes); RequestError names the Ollama field."""
    ignored, thinking = [], tokenizer.has_thinking
    request = _parse(body, True, info, thinking, ignored)
    out = {"messages": _messages(request.messages, thinking, ignored), **_common(request, info, thinking, ignored)}
    if request.tools:
        out["tools"] = request.tools
    if _format(request.format):
        out["response_format"] = _format(request.format)
    return request, adapted(out, info, ignored, _param(False))


def parse_generate(body: dict, info, tokenizer) -> tuple:
    """A user message (after `system`), or with `raw` the prompt as is (a completions request)."""
    ignored, thinking = [], tokenizer.has_thinking
    request = _parse(body, False, info, thinking, ignored)
    prompt, system = request.prompt, request.system
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("prompt", "expected a non-empty string (the model is always loaded: no need to load it)")
    out = _common(request, info, thinking, ignored)
    if request.raw:
        for name in ("system", "format"):
            if getattr(request, name):
                raise RequestError(name, "not taken with raw (the prompt goes as is, without the template)")
        out.pop("chat_template_kwargs", None)
        ids = list(tokenizer.encode(prompt))  # tokenized once: the prompt goes on as its ids
        # completions' default is 16 tokens; Ollama's, the context's rest
        out = {"prompt": ids, "max_tokens": max(1, min(info.max_tokens_cap, info.max_context - len(ids))), **out}
        return request, adapted(out, info, ignored, _param(True), chat=False)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    response_format = _format(request.format)
    out = {"messages": messages, **out, **({"response_format": response_format} if response_format else {})}
    return request, adapted(out, info, ignored, _param(True))


def _param(generate: bool):
    def param(name: str) -> str:
        if name.startswith("response_format"):
            return "format"
        if generate and name.startswith(("messages", "prompt")):
            return "prompt"
        return PARAMS.get(name, name)
    return param


# ---- replies


class OllamaReply:
    """What an Ollama client gets, rendered from the typed reply (protocol.Reply) of its one choice."""

    content_type = "application/x-ndjson"

    def __init__(self, reply: Reply, request: OllamaRequest, chat: bool):
        self.reply, self.model, self.chat = reply, request.model, chat
        self.start = time.perf_counter_ns()

    def _line(self, text: str, calls=(), thinking: str = "", **done) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text, **({"thinking": thinking} if thinking else {}),
                       **({"tool_calls": [_call(c) for c in calls]} if calls else {})}
            return {"model": self.model, "created_at": _now(), "message": message, **done}
        return {"model": self.model, "created_at": _now(), "response": text,
                **({"thinking": thinking} if thinking else {}), **done}

    def _done(self) -> dict:
        choice, usage = self.reply.choices[0], self.reply.usage()
        first, last = choice.first_ns or self.start, choice.last_ns or self.start  # its events' times
        return {"done": True, "done_reason": "length" if choice.finish == "length" else "stop",
                "total_duration": time.perf_counter_ns() - self.start, "load_duration": 0,
                "prompt_eval_count": usage.prompt, "prompt_eval_duration": first - self.start,
                "eval_count": usage.completion, "eval_duration": last - first}

    def opening(self) -> list:
        return []  # Ollama's stream has no opening line (the role comes with each message)

    def add(self, deltas) -> list:
        return [ndjson(self._line(d.text, d.calls, d.reasoning, done=False)) for d in deltas
                if d.text or d.calls or d.reasoning]

    def closing(self) -> list:
        return [ndjson(self._line("", **self._done()))]

    def failure(self, error_body: dict) -> bytes:
        return ndjson(error_body)  # the `ollama` package raises ResponseError on a line with "error"

    def whole(self) -> dict:
        d = self.reply.choices[0].whole()
        return self._line(d.text, d.calls, d.reasoning, **self._done())


def _call(call: ToolCall) -> dict:
    """A tool call as Ollama shapes it: arguments an object, no id."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}  # the parser's calls are JSON; this keeps Ollama's type if one is not
    return {"function": {"name": call.name, "arguments": arguments}}


def _error(e: ApiError) -> dict:
    return {"error": str(e)}


ADAPTERS = {
    ("POST", "/api/chat"): Adapter(parse_chat, lambda reply, request: OllamaReply(reply, request, True), _param(False)),
    ("POST", "/api/generate"): Adapter(parse_generate, lambda reply, request: OllamaReply(reply, request, False),
                                       _param(True)),
}
ROUTES = {("GET", "/api/version"): _version, ("GET", "/api/tags"): _tags, ("POST", "/api/show"): _show,
          ("GET", "/api/ps"): _ps, **{("POST", path): _not_here(path) for path in MANAGEMENT}}
ERROR_BODIES = {path: _error for path in ("/api/version", "/api/tags", "/api/show", "/api/ps", "/api/chat",
                                          "/api/generate", *MANAGEMENT)}
