"""What every HTTP API here shares. At its door: its errors (ApiError), its field policy (one
FieldPolicy table per API, applied by check_fields), a body parsed into the API's typed model
(parse: pydantic, an error naming the field). On the way back: the typed reply every API renders
(openai_api.py, responses_api.py, anthropic_api.py, ollama_api.py) and the access log reads
(request_log.py): each choice's scheduler events (PromptEvent, TokenEvent, FinishEvent) become
Deltas (reasoning, text, tool calls, logprobs, the finish), the Reply's tokens a Usage; and the
frames of a stream (sse, ndjson).

The compatibility rule (docs/serving.md, "OpenAI fields"): what a real client sends by default
works. A field whose value changes nothing for this server and model is accepted and named in the
access log (`ignored=…`, and the metric trinity_ignored_fields); a limit is clamped; only a field
whose loss would change the reply's meaning and that cannot be honoured is refused by name. A
FieldPolicy says which is which for one API's top-level fields; any other name is unknown (400).

Plain pydantic, not FastAPI: the transport (http_server.py, http_api.py) answers before a body is
read (411, 413, 415, closing the connection), streams byte for byte, and gives each API its own
error shape with a 400 naming the field, where FastAPI answers bad input 422 in its own shape; its
routing and dependency layers would also add modules to every request's path.
"""

import json
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from pydantic import BaseModel, ConfigDict, ValidationError

from ..runtime.request import PromptEvent, RequestError, TokenEvent
from .chat_format import ReplySplitter, reply_prompt
from .tools import custom_input


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class FieldPolicy:
    """One API's top-level fields: honoured (`accepted`), accepted with no effect and named in the
    access log (`hints`: name -> the JSON types it takes), accepted only with values that change
    nothing (`neutral`: name -> (values, why)), refused by name (`refused`: name -> why). A value in
    `absent` is as if the field were not sent (null: the API's default)."""

    accepted: Tuple[str, ...]
    hints: Dict[str, tuple] = field(default_factory=dict)
    neutral: Dict[str, tuple] = field(default_factory=dict)
    refused: Dict[str, str] = field(default_factory=dict)
    absent: tuple = (None,)


def check_fields(body: dict, policy: FieldPolicy) -> List[str]:
    """Unknown and refused fields, and neutral ones with another value, are RequestErrors naming
    them; returns the hints the body carries (accepted, ignored: the access log names them)."""
    ignored = []
    for name, value in body.items():
        known = name in policy.accepted or name in policy.hints or name in policy.neutral or name in policy.refused
        if not known:
            raise RequestError(name, "unknown field")
        if _same(value, policy.absent):
            continue
        if name in policy.refused:
            raise RequestError(name, policy.refused[name])
        if name in policy.neutral and not _same(value, policy.neutral[name][0]):
            raise RequestError(name, f"{json.dumps(value)[:60]} is not supported: {policy.neutral[name][1]}")
        if name in policy.hints:
            kinds = policy.hints[name]
            if kinds and not isinstance(value, kinds):
                raise RequestError(name, f"expected {_names(kinds)}, got {json.dumps(value)[:40]}")
            ignored.append(name)
    return ignored


def _same(value, allowed) -> bool:
    return any(type(value) is type(a) and value == a for a in allowed)


class Typed(BaseModel):
    """A body's typed model: JSON types as they are (strict: a bool is no number, a string no
    int); fields the policy accepted with no effect are not kept."""

    model_config = ConfigDict(strict=True, extra="ignore")


def parse(model: type, body: dict, **extra):
    """`body` as `model` (a Typed), with `extra` fields set by the server; a value of the wrong
    JSON type is a RequestError naming where it is: "messages[2].content: expected a string or a
    list, got 5". Null is a top-level field's default."""
    given = {k: v for k, v in body.items() if v is not None and k in model.model_fields}
    try:
        return model.model_validate({**given, **extra})
    except ValidationError as e:
        raise _failure(e.errors()) from None


# pydantic's error types -> what the value should have been
_EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
             "list_type": "a list", "dict_type": "an object", "model_type": "an object", "none_required": "null"}


def _failure(errors: List[dict]) -> RequestError:
    """pydantic's errors as one RequestError naming a place. In a union (a string or a list, say)
    each branch fails apart: the one that took the value's JSON kind got deepest, so the deepest
    place is named; where none went deeper, what each branch takes."""
    deepest = max(errors, key=lambda e: len(_place(e["loc"])))
    place = _place(deepest["loc"])
    same = [e for e in errors if _place(e["loc"]) == place]
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in place).lstrip(".")
    kind, got = deepest["type"], json.dumps(deepest.get("input"), default=str)[:40]
    if kind == "missing":
        return RequestError(field, "required")
    if kind == "extra_forbidden":
        return RequestError(field, "not supported here")
    if kind == "literal_error":
        return RequestError(field, f"expected {deepest['ctx']['expected']}, got {got}")
    words = list(dict.fromkeys(_EXPECTED[e["type"]] for e in same if e["type"] in _EXPECTED))
    return RequestError(field, f"expected {' or '.join(words)}, got {got}" if words else deepest["msg"])


def _place(loc: tuple) -> tuple:
    """An error's location without pydantic's union branch labels (str, list[Part], Part)."""
    return tuple(p for p in loc if isinstance(p, int) or not ("[" in p or p[:1].isupper() or p in _LABELS))


_LABELS = ("str", "int", "float", "bool", "dict", "list", "none")


def _names(kinds: tuple) -> str:
    return " or ".join("number" if k is float else k.__name__ for k in kinds)


# ---- the reply


@dataclass(frozen=True)
class ToolCall:
    """A call the reply makes: `arguments` is its JSON text, or a custom tool's input (`custom`)."""

    index: int
    id: str
    name: str
    arguments: str
    custom: bool = False


class TokenLogprob:
    """One token's logprobs: its id, logprob (None: the first prompt token), alternatives, text offset."""

    __slots__ = ("token_id", "logprob", "top", "offset")

    def __init__(self, token_id: int, logprob: Optional[float], top, offset: int):
        self.token_id, self.logprob, self.top, self.offset = token_id, logprob, top, offset


@dataclass
class Delta:
    """What one event adds to a choice's reply, in this order: reasoning, text, tool calls; the
    tokens' logprobs; the finish reason ("stop", "length", "tool_calls") with the last."""

    reasoning: str = ""
    text: str = ""
    calls: List[ToolCall] = field(default_factory=list)
    logprobs: List[TokenLogprob] = field(default_factory=list)
    finish: Optional[str] = None

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.text or self.calls or self.logprobs or self.finish)


@dataclass(frozen=True)
class Usage:
    """Tokens: the prompts' (each prompt once), of which the prefix cache restored `cached`, the
    completions', and of these the reasoning's (None: not counted, the reply is not split)."""

    prompt: int
    completion: int
    cached: int
    reasoning: Optional[int] = None


class Choice:
    """One generation's reply as its events arrive: add(event) -> the Deltas it makes."""

    def __init__(self, reply: "Reply", index: int, echo: Optional[str], scored: bool):
        self.reply, self.index, self.echo = reply, index, echo
        request = reply.plan.requests[index]
        prompt = request.prompt_ids if reply.plan.lazy else reply_prompt(request)  # a lazy grammar binds later
        # chat: the reply split into reasoning, content and tool calls (completions are text as it comes)
        self.split = ReplySplitter(reply.tokenizer, reply.plan.tools, prompt) if reply.plan.chat else None
        self.echo_waits = echo is not None and scored  # the echo goes out with the prompt's logprobs
        self.text, self.reasoning, self.entries, self.calls = [], [], [], []
        self.reasoning_tokens = 0  # tokens generated while the reply was reasoning (their </think> too)
        self.offset = 0  # text_offset of the next entry
        self.finish = self.error = self.stop_sequence = None
        self.usage = (0, 0, 0)  # prompt, completion and cached tokens
        self.first_ns = self.last_ns = None  # when its first and last events came (perf_counter_ns)

    def opening(self) -> List[Delta]:
        """What comes before any event: the echoed prompt (completions with echo)."""
        if self.echo is not None and not self.echo_waits:
            return self._text(self.echo, [])
        return []

    def add(self, event) -> List[Delta]:
        """Take one event; returns what it adds to the reply (none, one Delta, or with the finish two)."""
        self.last_ns = time.perf_counter_ns()
        self.first_ns = self.first_ns or self.last_ns
        logprobs = self.reply.plan.logprobs is not None
        if isinstance(event, PromptEvent):
            entries = [self._entry(*e) for e in zip(event.token_ids, event.logprobs, event.top_logprobs)] \
                if logprobs and self.echo is not None else []
            return self._text(self.echo or "", entries) if self.echo_waits else []
        if isinstance(event, TokenEvent):
            entries = [self._entry(event.token_id, event.logprob, event.top_logprobs or [])] if logprobs else []
            self.reasoning_tokens += self.split is not None and self.split.state == "reasoning"
            return self._text(event.text, entries)
        self.error = event.error if event.finish_reason == "error" else None
        self.stop_sequence = event.stop_sequence  # the Messages API names it
        self.usage = (event.prompt_tokens, event.completion_tokens, event.cached_tokens)
        deltas = self._text(event.text, [])
        reasoning, tail, calls = self.split.finish() if self.split else ("", "", [])
        self.finish = "length" if event.finish_reason == "length" else "stop"  # "cancelled": nobody listens
        if self.calls or calls:
            self.finish = "tool_calls" if self.finish == "stop" else self.finish
        return deltas + self._content(tail, calls, [], reasoning, self.finish)

    def _entry(self, token_id: int, logprob: Optional[float], top) -> TokenLogprob:
        """Offsets add up the tokens' own texts, from the choice's start (as vLLM counts them)."""
        entry = TokenLogprob(token_id, logprob, top, self.offset)
        self.offset += len(self.reply.token(token_id))
        return entry

    def _text(self, text: str, entries: List[TokenLogprob]) -> List[Delta]:
        calls, reasoning = [], ""
        if self.split is not None:
            reasoning, text, calls = self.split.feed(text)
        return self._content(text, calls, entries, reasoning)

    def _content(self, text: str, calls: List[dict], entries: List[TokenLogprob], reasoning: str = "",
                 finish: Optional[str] = None) -> List[Delta]:
        custom = self.reply.plan.custom
        calls = [_call(c, c["function"]["name"] in custom) for c in calls]
        self.text.append(text)
        self.reasoning.append(reasoning)
        self.entries += entries
        self.calls += calls
        delta = Delta(reasoning, text, calls, entries, finish)
        return [delta] if delta else []

    def whole(self) -> Delta:
        """The choice's reply so far, as one Delta (its finish once it has ended)."""
        return Delta("".join(self.reasoning), "".join(self.text), self.calls, self.entries, self.finish)


def _call(call: dict, custom: bool) -> ToolCall:
    """A parsed call (chat_format.ReplySplitter's) as a ToolCall; a custom tool's carries its input."""
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    return ToolCall(call["index"], call["id"], name, custom_input(arguments) if custom else arguments, custom)


class Reply:
    """A request's choices (a plan's, openai_api.CompletionPlan) and what they add up to."""

    def __init__(self, plan, model: str, tokenizer):
        self.plan, self.model, self.tokenizer = plan, model, tokenizer
        self.thinks = bool(plan.chat and getattr(tokenizer, "has_thinking", False))  # its reasoning is apart
        self._tokens = {}
        echoes = plan.echo or [None] * len(plan.requests)
        self.choices = [Choice(self, i, echo, r.prompt_logprobs) for i, (echo, r) in enumerate(zip(echoes, plan.requests))]

    @property
    def error(self) -> Optional[str]:
        return next((c.error for c in self.choices if c.error), None)

    def usage(self) -> Usage:
        firsts = {}  # a prompt counts once, however many choices it has
        for prompt, choice in zip(self.plan.prompts, self.choices):
            firsts.setdefault(prompt, choice)
        return Usage(sum(c.usage[0] for c in firsts.values()), sum(c.usage[1] for c in self.choices),
                     sum(c.usage[2] for c in firsts.values()),
                     sum(c.reasoning_tokens for c in self.choices) if self.thinks else None)

    def token(self, token_id: int) -> str:
        """A token's own text (cached: each reply decodes the same few ids again and again)."""
        text = self._tokens.get(token_id)
        if text is None:
            text = self._tokens[token_id] = self.tokenizer.decode([token_id])
        return text


def sse(event: str, data: dict) -> bytes:
    """One server-sent event with a name (as the Responses and Messages APIs send them)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def ndjson(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"
