"""OpenAI's completions and chat completions: which request fields the HTTP API takes (one
FieldPolicy per endpoint, protocol.py), a body parsed into its typed request (CompletionRequest,
ChatRequest) and planned into the generation requests of its choices (a CompletionPlan), and the
JSON an OpenAI client gets back (a Completion).

Every field is implemented, accepted only with the value that changes nothing
here (NEUTRAL), refused by name (REFUSED), or accepted as a hint with no effect
(HINT_TYPES); any other name is refused as unknown. docs/serving.md's field table lists the
same sets (a test compares them). The compatibility rule is protocol.py's; a limit (max_tokens
beyond the context or the cap) is clamped (`clamped=…`), the finish reason telling when the
clamp ended the reply.

The other APIs (Responses, Messages, Ollama: Adapter) parse their own bodies into a ChatRequest
(or a CompletionRequest), planned here like any other.

The reply, whole or as stream chunks (Completion), is rendered from the typed reply
(protocol.Reply: a Choice per generation, the Deltas its events make, the Usage).

Logprobs follow OpenAI's two formats: completions' (`tokens`, `token_logprobs`,
`top_logprobs` as {token: logprob} holding the top N and the chosen token,
`text_offset`; with `echo`, the prompt's tokens come first and the first one has
null logprobs, as OpenAI and vLLM answer) and chat's (`content`: a list of
{token, logprob, bytes, top_logprobs}).

Where the checkpoint thinks, a chat reply's reasoning comes in `reasoning_content` (the message's,
and streamed deltas', as vLLM and DeepSeek send it) and usage counts its tokens
(`completion_tokens_details`).
"""

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Union

from ..runtime.request import MAX_TOP_LOGPROBS, GenerationRequest, RequestError
from .chat_format import ModelInfo, build_request, chat_ids, prompt_ids
from .constraints import allowed_tools, forced_tools, response_grammar, strict_calls_grammar, tool_call_grammar
from .parts import Message, ResponseFormat, Tool, ToolChoice
from .protocol import ApiError, Choice, Delta, FieldPolicy, Reply, ToolCall, Typed, check_fields, parse
from .tools import chat_messages, custom_names, request_tools

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
# Accepted with no effect on the output (named in the access log): identifiers and caching hints
# for OpenAI's own service, storage, service tiers, and knobs this server and model have not
# (reasoning effort and verbosity: the chat template decides; a hosted web search: none runs
# here; a predicted output only speeds OpenAI's decoding up) -> the JSON types each takes.
HINT_TYPES = {"user": (str,), "safety_identifier": (str,), "prompt_cache_key": (str,), "store": (bool,),
              "metadata": (dict,), "service_tier": (str,), "reasoning_effort": (str,), "verbosity": (str,),
              "web_search_options": (dict,), "prediction": (dict,)}
# Accepted only with these values (the ones that change nothing here), else refused.
NEUTRAL = {
    "best_of": ((1,), "only 1 (use n for several completions)"),
    "suffix": (("",), "text after the completion (insertion) is not supported"),
    "modalities": ((["text"],), "only text output"),
}
REFUSED = {
    "audio": "audio output is not supported",
    "functions": "deprecated by OpenAI: use tools",
    "function_call": "deprecated by OpenAI: use tool_choice",
}
POLICIES = {
    "completions": FieldPolicy(SHARED + ("prompt", "echo"), hints={"user": HINT_TYPES["user"]},
                               neutral={k: NEUTRAL[k] for k in ("best_of", "suffix")}),
    "chat": FieldPolicy(SHARED + ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                  "parallel_tool_calls", "response_format") + CHAT_EXTENSIONS,
                        hints=HINT_TYPES, neutral={"modalities": NEUTRAL["modalities"]}, refused=REFUSED),
}


def fields(endpoint: str) -> dict:
    """Every field name `endpoint` knows -> "implemented", "extension", "hint", "neutral only" or "refused"."""
    policy = POLICIES[endpoint]
    out = {name: "extension" if name in EXTENSIONS + CHAT_EXTENSIONS else "implemented" for name in policy.accepted}
    out.update({name: "hint" for name in policy.hints})
    out.update({name: "neutral only" for name in policy.neutral})
    out.update({name: "refused" for name in policy.refused})
    return out


Number = Optional[Union[int, float]]


class CompletionRequest(Typed):
    """A /v1/completions body, typed (or what an API served over completions made of its own)."""

    model: Any = None  # the served id (another: 404)
    prompt: Any = None  # a string, token ids, or a list of either (_completion_prompts)
    echo: bool = False
    max_tokens: Optional[int] = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: int = 0
    min_p: Number = 0.0
    n: int = 1
    stream: bool = False
    stream_options: Optional[dict] = None
    stop: Union[str, list] = []
    seed: Optional[int] = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    presence_context_size: int = 20
    frequency_context_size: int = 20
    repetition_context_size: int = 20
    logit_bias: dict = {}
    logprobs: Optional[int] = None  # top alternatives per token
    speculative: bool = True  # false: no drafts verified for it
    ignored: List[str] = []  # set by the server: client fields accepted with no effect


class ChatRequest(CompletionRequest):
    """A /v1/chat/completions body, typed (or what an API served over chat made of its own)."""

    messages: Optional[List[Message]] = None  # tools.chat_messages reads them
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[List[Tool]] = None  # tools.request_tools
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: bool = True
    response_format: Optional[ResponseFormat] = None  # constraints.response_grammar
    chat_template_kwargs: dict = {}


def parse_body(body: dict, chat: bool, info: ModelInfo, ignored=()) -> CompletionRequest:
    """A completions (or chat) body as its typed request: RequestError names a bad field; a model
    we do not serve is 404. `ignored`: what the client sent that an adapter left out."""
    hints = check_fields(body, POLICIES["chat" if chat else "completions"])
    model = body.get("model")
    if model is not None and model != info.model_id:
        raise ApiError(404, f"The model `{str(model)[:200]}` does not exist (this server serves `{info.model_id}`)",
                       param="model", code="model_not_found")
    return parse(ChatRequest if chat else CompletionRequest, body, ignored=[*ignored, *hints])


def clamp_max_tokens(requested: int, prompt_len: int, info: ModelInfo) -> int:
    """`requested` held to the server's cap and the context the prompt leaves (vLLM and
    llama.cpp clamp so); a prompt that leaves no room keeps its value (validation refuses it)."""
    room = min(info.max_tokens_cap, info.max_context - prompt_len)
    return room if requested > room >= 1 else requested


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


def _prompt_list(prompt) -> list:
    """A completions prompt as its prompts: a list of strings or of token-id lists, else one prompt."""
    many = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    return prompt if many else [prompt]


def prompt_count(request: CompletionRequest) -> int:
    """The prompts a request gives (a choice each, times n): a chat has one."""
    return 1 if isinstance(request, ChatRequest) else len(_prompt_list(request.prompt))


def _completion_prompts(request: CompletionRequest, tokenizer) -> List[tuple]:
    """(token ids, text) of each prompt: a string, token ids, or a list of either."""
    out = []
    for p in _prompt_list(request.prompt):
        if isinstance(p, str):
            out.append((prompt_ids(tokenizer, prompt=p) if p else [], p))  # raw text: no chat template
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append((prompt_ids(tokenizer, token_ids=p) if p else [], None))
        else:
            raise RequestError("prompt", "expected a string, a list of token ids, or a list of either")
    return out


def _logprobs(request: CompletionRequest) -> Optional[int]:
    """None if no logprobs are asked for, else how many alternatives per token."""
    if isinstance(request, ChatRequest):
        top = request.top_logprobs
        if not request.logprobs:
            if top is not None:
                raise RequestError("top_logprobs", "needs logprobs: true")
            return None
        name, top = "top_logprobs", top or 0
    else:
        name, top = "logprobs", request.logprobs
        if top is None:
            return None
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(name, f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return top


def _logit_bias(bias: dict) -> dict:
    try:
        return {int(k): float(v) for k, v in bias.items() if not isinstance(v, bool)} if bias else {}
    except (TypeError, ValueError):
        raise RequestError("logit_bias", "expected an object mapping token ids to numbers") from None


def _max_name(request: CompletionRequest) -> str:
    """The field that bounds the reply: chat's max_completion_tokens where given."""
    chat_max = isinstance(request, ChatRequest) and request.max_completion_tokens is not None
    return "max_completion_tokens" if chat_max else "max_tokens"


def _sampling(request: CompletionRequest, prompt_len: int, info: ModelInfo) -> dict:
    r = request
    stop = [r.stop] if isinstance(r.stop, str) else r.stop
    if not all(isinstance(s, str) for s in stop):
        raise RequestError("stop", "expected a string or a list of strings")
    chat = isinstance(r, ChatRequest)
    default_max = max(1, min(info.max_tokens_cap, info.max_context - prompt_len)) if chat else 16
    asked = getattr(r, _max_name(r))
    return dict(
        max_tokens=clamp_max_tokens(default_max if asked is None else asked, prompt_len, info),
        temperature=float(r.temperature), top_p=float(r.top_p), top_k=r.top_k, min_p=float(r.min_p), seed=r.seed,
        stop=stop, presence_penalty=float(r.presence_penalty), frequency_penalty=float(r.frequency_penalty),
        repetition_penalty=float(r.repetition_penalty), logit_bias=_logit_bias(r.logit_bias),
        speculative=r.speculative, presence_context_size=r.presence_context_size,
        frequency_context_size=r.frequency_context_size, repetition_context_size=r.repetition_context_size)


def _constraint(request: ChatRequest, tokenizer, tools) -> tuple:
    """(grammar, the field it comes from) of a chat request: response_format's, or a forced tool call's."""
    if request.response_format is None and not tools:
        return None, None  # nothing constrains it
    grammar = response_grammar(request.response_format)
    choice = request.tool_choice
    forced = forced_tools(tools, choice) if tools else None
    if forced and grammar:
        raise RequestError("response_format", "cannot constrain the reply while tool_choice forces a tool call")
    if forced:
        return tool_call_grammar(tokenizer, forced, request.parallel_tool_calls), "tool_choice"
    allowed = allowed_tools(tools, choice) if tools else None
    if grammar is None and tools and (choice in (None, "auto") or allowed is not None):
        lazy = strict_calls_grammar(tokenizer, tools, allowed)  # a call keeps to its schema (and the allowed) once opened
        if lazy is not None:
            return lazy, "tools"
    return grammar, "response_format" if grammar else None


def template_kwargs(request: ChatRequest) -> dict:
    """chat_template_kwargs: variables for the chat template (e.g. enable_thinking)."""
    kwargs = request.chat_template_kwargs
    taken = next((k for k in kwargs if k in TEMPLATE_CALL), None)
    if taken is not None:
        raise RequestError(f"chat_template_kwargs.{taken}", "not a template variable (the request sets it)")
    return kwargs


def _stream_options(request: CompletionRequest) -> bool:
    """Whether the stream ends with a usage chunk (stream_options.include_usage)."""
    options = request.stream_options
    if options is not None and not request.stream:
        raise RequestError("stream_options", "only allowed with stream: true")
    unknown = next((k for k in options or {} if k not in ("include_usage", "include_obfuscation")), None)
    if unknown is not None or (options or {}).get("include_obfuscation"):
        raise RequestError("stream_options", f"only include_usage is supported, got {json.dumps(options)[:60]}")
    return bool((options or {}).get("include_usage"))


def chat_prompt(request: ChatRequest, tokenizer) -> tuple:
    """(token ids, tools) of a chat request's prompt: its messages, tools and template variables
    through the chat template; a tool_choice naming no tool is an error here too."""
    messages = chat_messages(request.messages, tokenizer.has_thinking)
    tools = request_tools(request.tools, request.tool_choice, tokenizer)
    if tools:
        forced_tools(tools, request.tool_choice)
    return chat_ids(tokenizer, messages, tools, template_kwargs(request)), tools


def plan(request: CompletionRequest, tokenizer, info: ModelInfo) -> CompletionPlan:
    """The choices to run for `request`; RequestError names a bad field (HTTP 400)."""
    chat = isinstance(request, ChatRequest)
    n = request.n
    if not 1 <= n <= 128:
        raise RequestError("n", f"must be in [1, 128], got {n}")
    include_usage, logprobs = _stream_options(request), _logprobs(request)
    tools = grammar = constrained_by = None
    if chat:
        ids, tools = chat_prompt(request, tokenizer)
        grammar, constrained_by = _constraint(request, tokenizer, tools)
        prompts, echo = [(ids, None)], False
    else:
        prompts = _completion_prompts(request, tokenizer)
        echo = request.echo
    max_name = _max_name(request)
    out = CompletionPlan(chat, [], [], stream=request.stream, include_usage=include_usage,
                         logprobs=logprobs, tools=tools, constrained_by=constrained_by, ignored=list(request.ignored),
                         lazy=constrained_by == "tools", custom=custom_names(request.tools) if tools else frozenset())
    for k, (ids, text) in enumerate(prompts):
        sampling = _sampling(request, len(ids), info)
        asked = getattr(request, max_name)
        if asked is not None and sampling["max_tokens"] != asked and max_name not in out.clamped:
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


def param_of(error: RequestError, request: Optional[CompletionRequest]) -> str:
    """The request field a RequestError from shared validation is about, as the client named it."""
    chat = isinstance(request, ChatRequest)
    max_name = _max_name(request) if request is not None else "max_tokens"
    renamed = {"max_tokens": max_name, "token_ids": "messages" if chat else "prompt", "prompt": "messages" if chat else "prompt",
               "top_logprobs": "top_logprobs" if chat else "logprobs"}
    return renamed.get(error.field, error.field)


class Completion:
    """The JSON an OpenAI client gets for a Reply: stream chunks (one per Delta), the whole reply,
    usage, in completions' or chat's shape."""

    def __init__(self, reply: Reply):
        self.reply, self.chat = reply, reply.plan.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def frame(self, kind: str, choices: List[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.reply.model, "choices": choices}

    def opening(self, choice: Choice) -> List[dict]:
        """Chunks before any event: chat's role, or the echoed prompt."""
        if self.chat:
            return [self._chunk(choice, {"delta": {"role": "assistant", "content": ""}})]
        return self.chunks(choice, choice.opening())

    def chunks(self, choice: Choice, deltas: List[Delta]) -> List[dict]:
        """The stream chunks of what an event added to `choice`."""
        return [self._chunk(choice, self._part(d), d.logprobs, d.finish) for d in deltas]

    def _part(self, d: Delta) -> dict:
        if not self.chat:
            return {"text": d.text}
        calls = [_call(c) for c in d.calls]
        return {"delta": {**({"reasoning_content": d.reasoning} if d.reasoning else {}),
                          **({"content": d.text} if d.text else {}), **({"tool_calls": calls} if calls else {})}}

    def _chunk(self, choice: Choice, part: dict, entries=(), finish=None) -> dict:
        """One stream chunk: `part` is the choice's text (completions) or delta (chat)."""
        out = {"index": choice.index, **part, "logprobs": self.logprobs(entries) if entries else None,
               "finish_reason": finish}
        return self.frame("chat.completion.chunk" if self.chat else "text_completion", [out])

    def _whole(self, choice: Choice) -> dict:
        d = choice.whole()
        out = {"index": choice.index}
        if self.chat:
            calls = [{k: v for k, v in _call(c).items() if k != "index"} for c in d.calls]
            out["message"] = {"role": "assistant", "content": d.text if d.text or not calls else None,
                              **({"tool_calls": calls} if calls else {}), "refusal": None,
                              **({"reasoning_content": d.reasoning or None} if self.reply.thinks else {})}
        else:
            out["text"] = d.text
        return {**out, "logprobs": self.logprobs(d.logprobs), "finish_reason": d.finish}

    def whole(self) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self.frame(kind, [self._whole(c) for c in self.reply.choices]), "usage": self.usage()}

    def usage(self) -> dict:
        u = self.reply.usage()
        out = {"prompt_tokens": u.prompt, "completion_tokens": u.completion, "total_tokens": u.prompt + u.completion,
               "prompt_tokens_details": {"cached_tokens": u.cached}}
        if u.reasoning is not None:  # OpenAI's reasoning models count them so
            out["completion_tokens_details"] = {"reasoning_tokens": u.reasoning}
        return out

    def usage_chunk(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self.frame(kind, []), "usage": self.usage()}

    def logprobs(self, entries) -> Optional[dict]:
        if self.reply.plan.logprobs is None:
            return None
        token = self.reply.token
        if self.chat:
            def item(token_id, logprob):
                text = token(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top or []]}
                                for e in entries], "refusal": None}
        tokens = [token(e.token_id) for e in entries]
        tops = []
        for text, e in zip(tokens, entries):
            if e.top is None:
                tops.append(None)  # the first prompt token
            else:
                top = {token(i): v for i, v in e.top}
                top.setdefault(text, e.logprob)  # OpenAI: the chosen token is always there
                tops.append(top)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                "text_offset": [e.offset for e in entries]}


def _call(call: ToolCall) -> dict:
    """A call as OpenAI sends it: a function's, or a custom tool's with its input."""
    if call.custom:
        return {"index": call.index, "id": call.id, "type": "custom", "custom": {"name": call.name, "input": call.arguments}}
    return {"index": call.index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def adapted(chat_fields: dict, info: ModelInfo, ignored, param: Callable, chat: bool = True) -> CompletionRequest:
    """The chat (or completions) request an adapter made of its API's body (`chat_fields`, as chat
    completions names them), typed; RequestError names the API's own field (`param`)."""
    try:
        return parse_body(chat_fields, chat, info, ignored)
    except RequestError as e:
        raise RequestError(param(e.field), e.detail) from None


@dataclass(frozen=True)
class Adapter:
    """What an API served over chat completions' request path provides (HttpFrontEnd.adapters in
    http_api.py lists them): the Responses, Messages and Ollama APIs. One path for all: the same chat
    template, sampling, constraints, prefix cache, metrics, access log, cancellation and
    queue bound as /v1/chat/completions (http_api.py runs it), so the same greedy message
    gives the same text through every API.

    An Adapter is
    - `parse(body, info, tokenizer) -> (request, chat)`: the API's body parsed once into its typed
      request, and the ChatRequest (or CompletionRequest) it becomes (adapted()); RequestError and
      ApiError name the API's own fields;
    - `reply(reply, request) -> AdaptedReply`: what the client gets, made from the typed reply
      (protocol.Reply) of its one choice;
    - `param(name) -> str`: the API's name for a chat-completions field an error names.

    An AdaptedReply has
    - `content_type`: of the stream ("text/event-stream", "application/x-ndjson");
    - `opening() -> [bytes]`: the stream's first frames;
    - `add(deltas) -> [bytes]`: the frames for what one event added (Choice.add(event): the
      Deltas' reasoning, text and tool calls, the finish);
    - `closing() -> [bytes]`: the last frames, after the finish;
    - `failure(error_body) -> bytes`: the frame that ends a stream whose generation failed;
    - `whole() -> dict`: the non-streamed answer.

    Frames are whole: an SSE event (protocol.sse) or an NDJSON line (protocol.ndjson).
    """

    parse: Callable
    reply: Callable
    param: Callable = lambda name: name
