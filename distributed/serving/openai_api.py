"""OpenAI's completions and chat completions: which request fields the HTTP API takes, turning a
request body into the generation requests of its choices (a CompletionPlan), and the JSON an
OpenAI client gets back (a Completion).

Every field is implemented, accepted only with the value that changes nothing
here (NEUTRAL), refused by name (REFUSED), or accepted as a hint with no effect
(HINTS); any other name is refused as unknown. docs/serving.md's field table lists the
same sets (a test compares them).

The compatibility rule (docs/serving.md, "OpenAI fields"): what a real client sends by default
works. A field whose value changes nothing for this server and model is accepted and
named in the access log (`ignored=…`, and the metric trinity_ignored_fields); a limit
(max_tokens beyond the context or the cap) is clamped (`clamped=…`), the finish reason
telling when the clamp ended the reply; only a field whose loss would change the reply's
meaning and that cannot be honoured is refused by name.

The reply, whole or as stream chunks, is built from the scheduler's events, one Choice per
generation.

Logprobs follow OpenAI's two formats: completions' (`tokens`, `token_logprobs`,
`top_logprobs` as {token: logprob} holding the top N and the chosen token,
`text_offset`; with `echo`, the prompt's tokens come first and the first one has
null logprobs, as OpenAI and vLLM answer) and chat's (`content`: a list of
{token, logprob, bytes, top_logprobs}).

Chat replies are split by ReplySplitter: where the checkpoint thinks, the reasoning
comes in `reasoning_content` (the message's, and streamed deltas', as vLLM and
DeepSeek send it) and usage counts its tokens (`completion_tokens_details`).
"""

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from ..runtime.request import MAX_TOP_LOGPROBS, GenerationRequest, PromptEvent, RequestError, TokenEvent
from .chat_format import ModelInfo, ReplySplitter, build_request, chat_ids, prompt_ids, reply_prompt
from .constraints import allowed_tools, forced_tools, response_grammar, strict_calls_grammar, tool_call_grammar
from .tools import chat_messages, custom_input, custom_names, request_tools


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


# Extensions beyond OpenAI's fields (mlx-lm's server takes the same names).
EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "repetition_context_size", "presence_context_size",
              "frequency_context_size", "speculative")
CHAT_EXTENSIONS = ("chat_template_kwargs",)  # vLLM's and mlx-lm's name: the chat template's own variables
# What apply_chat_template itself takes: not template variables.
TEMPLATE_CALL = ("messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize", "chat_template",
                 "continue_final_message", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
                 "padding", "truncation", "max_length", "return_tensors")
SHARED = ("model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
          "presence_penalty", "frequency_penalty", "logit_bias", "logprobs") + EXTENSIONS
IMPLEMENTED = {
    "completions": SHARED + ("prompt", "echo"),
    "chat": SHARED + ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                      "parallel_tool_calls", "response_format") + CHAT_EXTENSIONS,
}
# Accepted with no effect on the output (named in the access log): identifiers and caching hints
# for OpenAI's own service, storage, service tiers, and knobs this server and model have not
# (reasoning effort and verbosity: the chat template decides; a hosted web search: none runs
# here; a predicted output only speeds OpenAI's decoding up) -> the JSON types each takes.
HINT_TYPES = {"user": (str,), "safety_identifier": (str,), "prompt_cache_key": (str,), "store": (bool,),
              "metadata": (dict,), "service_tier": (str,), "reasoning_effort": (str,), "verbosity": (str,),
              "web_search_options": (dict,), "prediction": (dict,)}
HINTS = {"completions": ("user",), "chat": tuple(HINT_TYPES)}
# Accepted only with these values (the ones that change nothing here), else refused.
NEUTRAL = {
    "best_of": ((1,), "only 1 (use n for several completions)"),
    "suffix": (("",), "text after the completion (insertion) is not supported"),
    "modalities": ((["text"],), "only text output"),
}
NEUTRAL_IN = {"completions": ("best_of", "suffix"), "chat": ("modalities",)}
REFUSED = {
    "audio": "audio output is not supported",
    "functions": "deprecated by OpenAI: use tools",
    "function_call": "deprecated by OpenAI: use tool_choice",
}
REFUSED_IN = {"completions": (), "chat": tuple(REFUSED)}


def fields(endpoint: str) -> dict:
    """Every field name `endpoint` knows -> "implemented", "extension", "hint", "neutral only" or "refused"."""
    out = {name: "extension" if name in EXTENSIONS + CHAT_EXTENSIONS else "implemented" for name in IMPLEMENTED[endpoint]}
    out.update({name: "hint" for name in HINTS[endpoint]})
    out.update({name: "neutral only" for name in NEUTRAL_IN[endpoint]})
    out.update({name: "refused" for name in REFUSED_IN[endpoint]})
    return out


def get(body: dict, name: str, kinds: tuple, default=None):
    """body[name] if it is one of `kinds` (a bool is no number here); `default` if absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join("number" if k is float else k.__name__ for k in kinds)
        raise RequestError(name, f"expected {names}, got {json.dumps(value)[:40]}")
    return value


def _same(value, allowed) -> bool:
    return any(type(value) is type(a) and value == a for a in allowed)


class ChatBody(dict):
    """A chat-completions body an adapter (Adapter, below) made of its API's request, with the
    names of the client's fields it accepted and ignored (named in the access log)."""

    def __init__(self, *args, ignored=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.ignored = list(ignored)


def clamp_max_tokens(requested: int, prompt_len: int, info: ModelInfo) -> int:
    """`requested` held to the server's cap and the context the prompt leaves (vLLM and
    llama.cpp clamp so); a prompt that leaves no room keeps its value (validation refuses it)."""
    room = min(info.max_tokens_cap, info.max_context - prompt_len)
    return room if requested > room >= 1 else requested


def check_fields(body: dict, endpoint: str, info: ModelInfo) -> List[str]:
    """Unknown, refused and non-neutral fields are errors naming them; a model we do not serve is
    404. Returns the hints the body carries (accepted, ignored)."""
    known = fields(endpoint)
    ignored = []
    for name, value in body.items():
        if name not in known:
            raise RequestError(name, "unknown field")
        if value is None:
            continue  # null: OpenAI's default
        if known[name] == "refused":
            raise RequestError(name, REFUSED[name])
        if known[name] == "neutral only" and not _same(value, NEUTRAL[name][0]):
            raise RequestError(name, f"{json.dumps(value)[:60]} is not supported: {NEUTRAL[name][1]}")
        if known[name] == "hint":
            get(body, name, HINT_TYPES[name])
            ignored.append(name)
    model = body.get("model")
    if model is not None and model != info.model_id:
        raise ApiError(404, f"The model `{str(model)[:200]}` does not exist (this server serves `{info.model_id}`)",
                       param="model", code="model_not_found")
    return ignored


@dataclass
class CompletionPlan:
    """What a request runs (one GenerationRequest per choice) and how its reply looks."""

    chat: bool
    requests: List[GenerationRequest]
    prompts: List[int]  # each choice's prompt index (completions take several prompts)
    echo: List[Optional[str]] = field(default_factory=list)  # completions: each choice's prompt text to echo
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None  # None: not asked; else top alternatives per token
    tools: Optional[List[dict]] = None  # chat: tools whose calls the reply parses
    custom: frozenset = frozenset()  # chat: custom tools' names, whose calls come back as custom calls
    constrained_by: Optional[str] = None  # the field whose grammar the requests carry (its errors name it)
    lazy: bool = False  # the grammar binds only from a trigger (strict tools under "auto"): the reply may reason first
    ignored: List[str] = field(default_factory=list)  # client fields accepted with no effect (the access log names them)
    clamped: List[str] = field(default_factory=list)  # client limits held to what the server allows


def _completion_prompts(body: dict, tokenizer) -> List[tuple]:
    """(token ids, text) of each prompt: a string, token ids, or a list of either."""
    prompt = body.get("prompt")
    many = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    out = []
    for p in prompt if many else [prompt]:
        if isinstance(p, str):
            out.append((prompt_ids(tokenizer, prompt=p) if p else [], p))  # raw text: no chat template
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append((prompt_ids(tokenizer, token_ids=p) if p else [], None))
        else:
            raise RequestError("prompt", "expected a string, a list of token ids, or a list of either")
    return out


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    """None if no logprobs are asked for, else how many alternatives per token."""
    if chat:
        top = get(body, "top_logprobs", (int,), None)
        if not get(body, "logprobs", (bool,), False):
            if top is not None:
                raise RequestError("top_logprobs", "needs logprobs: true")
            return None
        name, top = "top_logprobs", top or 0
    else:
        name, top = "logprobs", get(body, "logprobs", (int,), None)
        if top is None:
            return None
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(name, f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return top


def _logit_bias(body: dict) -> dict:
    bias = get(body, "logit_bias", (dict,), {})
    try:
        return {int(k): float(v) for k, v in bias.items() if not isinstance(v, bool)} if bias else {}
    except (TypeError, ValueError):
        raise RequestError("logit_bias", "expected an object mapping token ids to numbers") from None


def _sampling(body: dict, chat: bool, max_name: str, prompt_len: int, info: ModelInfo) -> dict:
    stop = get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise RequestError("stop", "expected a string or a list of strings")
    default_max = max(1, min(info.max_tokens_cap, info.max_context - prompt_len)) if chat else 16

    def number(name, default):
        return float(get(body, name, (int, float), default))

    return dict(
        max_tokens=clamp_max_tokens(get(body, max_name, (int,), default_max), prompt_len, info),
        temperature=number("temperature", 1.0), top_p=number("top_p", 1.0), top_k=get(body, "top_k", (int,), 0),
        min_p=number("min_p", 0.0), seed=get(body, "seed", (int,), None), stop=stop,
        presence_penalty=number("presence_penalty", 0.0), frequency_penalty=number("frequency_penalty", 0.0),
        repetition_penalty=number("repetition_penalty", 1.0), logit_bias=_logit_bias(body),
        speculative=get(body, "speculative", (bool,), True),  # false: no drafts verified for it
        **{name: get(body, name, (int,), 20) for name in
           ("presence_context_size", "frequency_context_size", "repetition_context_size")},
    )


def _constraint(body: dict, tokenizer, tools) -> tuple:
    """(grammar, the field it comes from) of a chat request: response_format's, or a forced tool call's."""
    grammar = response_grammar(body.get("response_format"))
    parallel = get(body, "parallel_tool_calls", (bool,), True)
    forced = forced_tools(tools, body.get("tool_choice")) if tools else None
    if forced and grammar:
        raise RequestError("response_format", "cannot constrain the reply while tool_choice forces a tool call")
    if forced:
        return tool_call_grammar(tokenizer, forced, parallel), "tool_choice"
    choice = body.get("tool_choice")
    allowed = allowed_tools(tools, choice) if tools else None
    if grammar is None and tools and (choice in (None, "auto") or allowed is not None):
        lazy = strict_calls_grammar(tokenizer, tools, allowed)  # a call keeps to its schema (and the allowed) once opened
        if lazy is not None:
            return lazy, "tools"
    return grammar, "response_format" if grammar else None


def template_kwargs(body: dict) -> dict:
    """chat_template_kwargs: variables for the chat template (e.g. enable_thinking)."""
    kwargs = get(body, "chat_template_kwargs", (dict,), {})
    taken = next((k for k in kwargs if k in TEMPLATE_CALL), None)
    if taken is not None:
        raise RequestError(f"chat_template_kwargs.{taken}", "not a template variable (the request sets it)")
    return kwargs


def plan(body: dict, chat: bool, tokenizer, info: ModelInfo) -> CompletionPlan:
    """The choices to run for `body`; RequestError names a bad field (HTTP 400)."""
    ignored = list(getattr(body, "ignored", ())) + check_fields(body, "chat" if chat else "completions", info)
    n = get(body, "n", (int,), 1)
    if not 1 <= n <= 128:
        raise RequestError("n", f"must be in [1, 128], got {n}")
    stream = get(body, "stream", (bool,), False)
    options = get(body, "stream_options", (dict,), None)
    if options is not None and not stream:
        raise RequestError("stream_options", "only allowed with stream: true")
    unknown = next((k for k in options or {} if k not in ("include_usage", "include_obfuscation")), None)
    if unknown is not None or (options or {}).get("include_obfuscation"):
        raise RequestError("stream_options", f"only include_usage is supported, got {json.dumps(options)[:60]}")
    logprobs = _logprobs(body, chat)
    tools = grammar = constrained_by = None
    if chat:
        messages = chat_messages(body.get("messages"), tokenizer.has_thinking)
        tools = request_tools(body, tokenizer)
        grammar, constrained_by = _constraint(body, tokenizer, tools)
        prompts = [(chat_ids(tokenizer, messages, tools, template_kwargs(body)), None)]
        max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        echo = False
    else:
        prompts = _completion_prompts(body, tokenizer)
        max_name, echo = "max_tokens", get(body, "echo", (bool,), False)
    out = CompletionPlan(chat, [], [], stream=stream, include_usage=bool((options or {}).get("include_usage")),
               logprobs=logprobs, tools=tools, constrained_by=constrained_by, ignored=ignored,
               lazy=constrained_by == "tools", custom=custom_names(body) if tools else frozenset())
    for k, (ids, text) in enumerate(prompts):
        sampling = _sampling(body, chat, max_name, len(ids), info)
        if sampling["max_tokens"] != get(body, max_name, (int,), sampling["max_tokens"]) and max_name not in out.clamped:
            out.clamped.append(max_name)
        # echo with logprobs scores the prompt; echo alone with max_tokens 0 too (nothing else to run)
        scored = echo and (logprobs is not None or sampling["max_tokens"] == 0)
        for j in range(n):
            seed = sampling["seed"]
            choice = dict(sampling, seed=None if seed is None else seed + j)  # so that n choices differ
            out.requests.append(build_request(info, ids, top_logprobs=logprobs or 0, prompt_logprobs=scored,
                                              grammar=grammar, **choice))
            out.prompts.append(k)
            out.echo.append((text if text is not None else tokenizer.decode(ids)) if echo else None)
    return out


def param_of(error: RequestError, body: dict, chat: bool) -> str:
    """The request field a RequestError from shared validation is about, as the client named it."""
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    renamed = {"max_tokens": max_name, "token_ids": "messages" if chat else "prompt", "prompt": "messages" if chat else "prompt",
               "top_logprobs": "top_logprobs" if chat else "logprobs"}
    return renamed.get(error.field, error.field)


class TokenLogprob:
    """One token's logprobs: its id, logprob (None: the first prompt token), alternatives, text offset."""

    __slots__ = ("token_id", "logprob", "top", "offset")

    def __init__(self, token_id: int, logprob: Optional[float], top, offset: int):
        self.token_id, self.logprob, self.top, self.offset = token_id, logprob, top, offset


class Choice:
    """One generation's state as its events arrive; each step returns stream chunks."""

    def __init__(self, reply: "Completion", index: int, echo: Optional[str], scored: bool):
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

    def opening(self) -> List[dict]:
        """Chunks before any event: chat's role, or the echoed prompt."""
        if self.reply.plan.chat:
            return [self._chunk({"delta": {"role": "assistant", "content": ""}})]
        if self.echo is not None and not self.echo_waits:
            return self._text(self.echo, [])
        return []

    def add(self, event) -> List[dict]:
        """Take one event; returns the chunks it makes."""
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
        chunks = self._text(event.text, [])
        reasoning, tail, calls = self.split.finish() if self.split else ("", "", [])
        self.finish = "length" if event.finish_reason == "length" else "stop"  # "cancelled": nobody listens
        if self.calls or calls:
            self.finish = "tool_calls" if self.finish == "stop" else self.finish
        return chunks + self._content(tail, calls, [], self.finish, reasoning)

    def _entry(self, token_id: int, logprob: Optional[float], top) -> TokenLogprob:
        """Offsets add up the tokens' own texts, from the choice's start (as vLLM counts them)."""
        entry = TokenLogprob(token_id, logprob, top, self.offset)
        self.offset += len(self.reply.token(token_id))
        return entry

    def _text(self, text: str, entries: List[TokenLogprob]) -> List[dict]:
        calls, reasoning = [], ""
        if self.split is not None:
            reasoning, text, calls = self.split.feed(text)
        return self._content(text, calls, entries, None, reasoning)

    def _content(self, text: str, calls: List[dict], entries: List[TokenLogprob], finish, reasoning: str = "") -> List[dict]:
        calls = [self._custom(c) if c["function"]["name"] in self.reply.plan.custom else c for c in calls]
        self.text.append(text)
        self.reasoning.append(reasoning)
        self.entries += entries
        self.calls += calls
        if not (text or calls or entries or finish or reasoning):
            return []
        if not self.reply.plan.chat:
            return [self._chunk({"text": text}, entries, finish)]
        delta = {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": text} if text else {}),
                 **({"tool_calls": calls} if calls else {})}
        return [self._chunk({"delta": delta}, entries, finish)]

    @staticmethod
    def _custom(call: dict) -> dict:
        """A call to a custom tool as OpenAI sends it: its input, the string argument."""
        custom = {"name": call["function"]["name"], "input": custom_input(call["function"]["arguments"])}
        return {"index": call["index"], "id": call["id"], "type": "custom", "custom": custom}

    def _chunk(self, part: dict, entries=(), finish=None) -> dict:
        """One stream chunk: `part` is the choice's text (completions) or delta (chat)."""
        choice = {"index": self.index, **part, "logprobs": self.reply.logprobs(entries) if entries else None,
                  "finish_reason": finish}
        return self.reply.frame("chat.completion.chunk" if self.reply.plan.chat else "text_completion", [choice])

    def whole(self) -> dict:
        text = "".join(self.text)
        out = {"index": self.index}
        if self.reply.plan.chat:
            calls = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
            reasoning = "".join(self.reasoning)
            out["message"] = {"role": "assistant", "content": text if text or not calls else None,
                              **({"tool_calls": calls} if calls else {}), "refusal": None,
                              **({"reasoning_content": reasoning or None} if self.split.thinks else {})}
        else:
            out["text"] = text
        return {**out, "logprobs": self.reply.logprobs(self.entries), "finish_reason": self.finish}


class Completion:
    """A completion's choices and the frames around them."""

    def __init__(self, plan: CompletionPlan, model: str, tokenizer):
        self.plan, self.model, self.tokenizer = plan, model, tokenizer
        self.id = ("chatcmpl-" if plan.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._tokens = {}
        self.choices = [Choice(self, i, echo, r.prompt_logprobs)
                        for i, (echo, r) in enumerate(zip(plan.echo or [None] * len(plan.requests), plan.requests))]

    @property
    def error(self) -> Optional[str]:
        return next((c.error for c in self.choices if c.error), None)

    def frame(self, kind: str, choices: List[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def usage(self) -> dict:
        firsts = {}  # a prompt counts once, however many choices it has
        for prompt, choice in zip(self.plan.prompts, self.choices):
            firsts.setdefault(prompt, choice)
        prompt = sum(c.usage[0] for c in firsts.values())
        completion = sum(c.usage[1] for c in self.choices)
        out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": {"cached_tokens": sum(c.usage[2] for c in firsts.values())}}
        if self.plan.chat and self.tokenizer.has_thinking:  # OpenAI's reasoning models count them so
            out["completion_tokens_details"] = {"reasoning_tokens": sum(c.reasoning_tokens for c in self.choices)}
        return out

    def whole(self) -> dict:
        kind = "chat.completion" if self.plan.chat else "text_completion"
        return {**self.frame(kind, [c.whole() for c in self.choices]), "usage": self.usage()}

    def usage_chunk(self) -> dict:
        kind = "chat.completion.chunk" if self.plan.chat else "text_completion"
        return {**self.frame(kind, []), "usage": self.usage()}

    def token(self, token_id: int) -> str:
        """A token's own text (cached: each reply decodes the same few ids again and again)."""
        text = self._tokens.get(token_id)
        if text is None:
            text = self._tokens[token_id] = self.tokenizer.decode([token_id])
        return text

    def logprobs(self, entries) -> Optional[dict]:
        if self.plan.logprobs is None:
            return None
        if self.plan.chat:
            def item(token_id, logprob):
                token = self.token(token_id)
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top or []]}
                                for e in entries], "refusal": None}
        tokens = [self.token(e.token_id) for e in entries]
        tops = []
        for token, e in zip(tokens, entries):
            if e.top is None:
                tops.append(None)  # the first prompt token
            else:
                top = {self.token(i): v for i, v in e.top}
                top.setdefault(token, e.logprob)  # OpenAI: the chosen token is always there
                tops.append(top)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                "text_offset": [e.offset for e in entries]}


@dataclass(frozen=True)
class Adapter:
    """What an API served over chat completions' request path provides (HttpFrontEnd.adapters in
    http_api.py lists them): the Responses, Messages and Ollama APIs. One path for all: the same chat
    template, sampling, constraints, prefix cache, metrics, access log, cancellation and
    queue bound as /v1/chat/completions (http_api.py runs it), so the same greedy message
    gives the same text through every API.

    An Adapter is
    - `to_chat(body, info, tokenizer) -> dict`: the API's body as an OpenAI chat-completions
      body (or a completions one: a body with "prompt" and no "messages"), including
      "stream"; RequestError / ApiError name the API's own fields;
    - `reply(openai_reply, body) -> AdaptedReply`: what the client gets, made from the
      OpenAI reply (Completion) of its one choice;
    - `param(name) -> str`: the API's name for a chat-completions field an error names.

    An AdaptedReply has
    - `content_type`: of the stream ("text/event-stream", "application/x-ndjson");
    - `opening(chunks) -> [bytes]`: the stream's first frames (`chunks`: the OpenAI
      chunks of Choice.opening());
    - `add(chunks) -> [bytes]`: the frames for the OpenAI chunks one event made
      (Choice.add(event): reasoning, text and tool-call deltas, the finish);
    - `closing() -> [bytes]`: the last frames, after the finish;
    - `failure(error_body) -> bytes`: the frame that ends a stream whose generation failed;
    - `whole(openai_whole) -> dict`: the non-streamed answer, from Completion.whole().

    Frames are whole: an SSE event (sse()) or an NDJSON line (ndjson()).
    """

    to_chat: Callable
    reply: Callable
    param: Callable = lambda name: name


def sse(event: str, data: dict) -> bytes:
    """One server-sent event with a name (as the Responses and Messages APIs send them)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def ndjson(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"
