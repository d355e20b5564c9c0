"""A generation request, its validation, and the events it produces.

Shared by every front end (command line, gRPC, OpenAI HTTP): each turns its
own input into a GenerationRequest and its own errors from RequestError.
"""

import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

MAX_TOP_LOGPROBS = 20  # alternatives reported per token (OpenAI's chat limit)
# How FinishEvent.error begins says whose failure it is (failure_kind); the front ends answer each
# its own way. A request that failed alone, on its own input (its grammar, its processors, its text,
# a frame of its that a rank could not run): HTTP 400, gRPC INVALID_ARGUMENT.
REQUEST_FAILED = "this request failed"
# A rank could not allocate for the request's frame: it alone failed (HTTP 507, RESOURCE_EXHAUSTED).
OUT_OF_MEMORY = "out of memory"
# A step raised where no one request is to blame: every running request ended and the ring was
# reset; it serves on (HTTP 503, gRPC ABORTED: retry). Anything else: the ring is down (UNAVAILABLE).
RING_RESET = "internal error; every running request was ended and the ring reset, it serves on"


def failure_kind(error: Optional[str]) -> str:
    """"request", "memory", "reset" or "ring": whose failure a FinishEvent's error is."""
    for prefix, kind in ((REQUEST_FAILED, "request"), (OUT_OF_MEMORY, "memory"), (RING_RESET, "reset")):
        if error and error.startswith(prefix):
            return kind
    return "ring"


# Stop strings: how many and how long (characters). Matching costs each token's text times the
# number of stops (sequence.StopStrings); the length bounds the text held back while it could
# still begin one.
MAX_STOPS = 64
MAX_STOP_CHARS = 4096
CONTEXT = "context"  # in LIMITS: the model's context (validate's max_context)
INF = math.inf

# Every number a request carries, checked before it is queued (every front end, through
# validate or, before the model is known, validate_sampling): (field, lowest, highest, whether the
# lowest itself is refused, whether it must be an integer). A number out of these ranges could
# reach MLX as a shape or an index (a context size of 2**40 raised inside the scheduler's step).
LIMITS = [
    ("temperature", 0, INF, False, False),
    ("top_p", 0, 1, True, False),
    ("top_k", 0, INF, False, True),
    ("min_p", 0, 1, False, False),
    ("presence_penalty", -2, 2, False, False),  # OpenAI's range
    ("frequency_penalty", -2, 2, False, False),
    ("repetition_penalty", 0, INF, True, False),  # 1: off
    ("presence_context_size", 1, CONTEXT, False, True),
    ("frequency_context_size", 1, CONTEXT, False, True),
    ("repetition_context_size", 1, CONTEXT, False, True),
    ("top_logprobs", 0, MAX_TOP_LOGPROBS, False, True),
]


def _range_text(low, high, open_low: bool) -> str:
    if high == INF:
        return f"{'>' if open_low else '>='} {low}"
    return f"in {'(' if open_low else '['}{low}, {high}]"


class RequestError(ValueError):
    """Bad input; `field` names what is wrong and `detail` how (gRPC: INVALID_ARGUMENT, HTTP: 400).
    Its text is "field: detail"; a front end that names the field as its client does uses
    `as_named(name)`."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.detail = field, message

    def as_named(self, name: str) -> str:
        return f"{name}: {self.detail}"


@dataclass
class GenerationRequest:
    prompt_ids: List[int]
    max_tokens: int = 100
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    deadline: Optional[float] = None  # time.monotonic() after which it is cancelled
    # Logits processors (mlx-lm's make_logits_processors, runtime/sequence.py); each
    # penalty counts the last *_context_size tokens fed, prompt included, as mlx-lm does.
    presence_penalty: float = 0.0  # 0: off
    frequency_penalty: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    presence_context_size: int = 20
    frequency_context_size: int = 20
    repetition_context_size: int = 20
    logit_bias: Dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    top_logprobs: int = 0  # most likely alternatives reported with each token (and prompt token)
    prompt_logprobs: bool = False  # report the prompt's logprobs first (a PromptEvent); max_tokens may be 0
    # A replay after a failure (the launcher's router): tokens this request already
    # produced and its client has received. They are prefilled after the prompt and
    # count as generated (max_tokens, completion_tokens, detokenizer, stop strings,
    # logits processors, the random key) but are not streamed again; neither are the
    # prompt's logprobs.
    resume_ids: List[int] = field(default_factory=list)
    speculative: bool = True  # False: never verify drafts for this request (where the server speculates)
    # Constrained decoding (runtime/grammar.py): an llguidance grammar (from a JSON schema,
    # Lark or a regex) that every generated token must keep to; None: unconstrained.
    grammar: Optional[str] = None

    @property
    def scores_prompt(self) -> bool:
        """The prompt's logprobs are to be computed and sent (not on a resumed request)."""
        return self.prompt_logprobs and not self.resume_ids

    def validate(self, vocab_size: int, max_context: int, max_tokens_cap: Optional[int] = None) -> None:
        self.validate_token_ids(vocab_size)
        if self.resume_ids and len(self.resume_ids) >= self.max_tokens:
            raise RequestError("resume_token_ids", f"{len(self.resume_ids)} tokens already produced leave none of "
                                                   f"max_tokens ({self.max_tokens})")
        if max_tokens_cap is not None and self.max_tokens > max_tokens_cap:
            raise RequestError("max_tokens", f"{self.max_tokens} is above the server's cap of {max_tokens_cap}")
        self.validate_sampling(max_context)
        if len(self.prompt_ids) + self.max_tokens > max_context:
            raise RequestError(
                "max_tokens",
                f"prompt ({len(self.prompt_ids)} tokens) + max_tokens ({self.max_tokens}) "
                f"exceeds the context of {max_context} tokens",
            )

    def validate_token_ids(self, vocab_size: int) -> None:
        """Every token id the model will look up is in its vocabulary (an id outside it
        would make the embedding read out of bounds). The scheduler checks this too."""
        if not self.prompt_ids:
            raise RequestError("prompt", "the prompt is empty")
        for name, ids in (("token_ids", self.prompt_ids), ("logit_bias", self.logit_bias),
                          ("resume_token_ids", self.resume_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise RequestError(name, f"token id {bad} is outside the vocabulary [0, {vocab_size})")

    def validate_sampling(self, max_context: float = INF) -> None:
        """The checks of LIMITS and the other fields' (the command line runs them before loading,
        with no context known)."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < (0 if self.prompt_logprobs else 1):
            raise RequestError("max_tokens", f"must be at least 1, got {self.max_tokens}")  # 0: score the prompt
        for name, low, high, open_low, integer in LIMITS:
            value, high = getattr(self, name), max_context if high == CONTEXT else high
            if integer and not isinstance(value, int):
                raise RequestError(name, f"must be an integer, got {value!r}")
            if not (low < value <= high if open_low else low <= value <= high):  # NaN fails it too
                raise RequestError(name, f"must be {_range_text(low, high, open_low)}, got {value}")
        if self.seed is not None and not 0 <= self.seed < 2**64:  # mx.random.key takes a uint64
            raise RequestError("seed", f"must be in [0, 2**64), got {self.seed}")
        bad = next((b for b in self.logit_bias.values() if not -100 <= b <= 100), None)
        if bad is not None:
            raise RequestError("logit_bias", f"biases must be in [-100, 100], got {bad}")
        self._validate_stops()

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOPS:
            raise RequestError("stop", f"at most {MAX_STOPS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s:
                raise RequestError("stop", "stop strings must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise RequestError("stop", f"stop strings are at most {MAX_STOP_CHARS} characters, got {len(s)}")

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


TopLogprobs = List[Tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class TokenEvent:
    """One decoded token: its id, log-probability (before logits processors and
    temperature), new text, and the request's top_logprobs most likely tokens."""

    token_id: int
    logprob: float
    text: str
    top_logprobs: Optional[TopLogprobs] = None


@dataclass
class PromptEvent:
    """The prompt's logprobs (request.prompt_logprobs), before any TokenEvent: for
    each prompt token, its logprob given the tokens before it (None for the first)
    and the top_logprobs most likely tokens there (None for the first)."""

    token_ids: List[int]
    logprobs: List[Optional[float]]
    top_logprobs: List[Optional[TopLogprobs]]
    text: str = ""  # no new text: consumers that join texts need no case for it


@dataclass
class FinishEvent:
    """The last event of a request."""

    finish_reason: str  # "stop", "length", "cancelled" or "error"
    prompt_tokens: int
    completion_tokens: int
    prefill_tokens_per_sec: float = 0.0
    generation_tokens_per_sec: float = 0.0
    error: Optional[str] = None
    text: str = ""  # text the detokenizer held back until the end
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache, not computed
    disk_tokens: int = 0  # of those, read from its disk tier (after a restart, or evicted from RAM)
    stop_sequence: Optional[str] = None  # the stop string that ended it, if one did
