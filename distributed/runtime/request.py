"""A generation request, its validation, and the events it produces.

Shared by every front end (command line, gRPC, OpenAI HTTP): each turns its
own input into a GenerationRequest and its own errors from RequestError.
"""

import math
import time
from dataclasses import dataclass, field
from typing import List, Optional


class RequestError(ValueError):
    """Bad input; `field` names what is wrong (gRPC: INVALID_ARGUMENT, HTTP: 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


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

    def validate(self, vocab_size: int, max_context: int, max_tokens_cap: Optional[int] = None) -> None:
        if not self.prompt_ids:
            raise RequestError("prompt", "the prompt is empty")
        bad = next((t for t in self.prompt_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError("token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        if max_tokens_cap is not None and self.max_tokens > max_tokens_cap:
            raise RequestError("max_tokens", f"{self.max_tokens} is above the server's cap of {max_tokens_cap}")
        self.validate_sampling()
        if len(self.prompt_ids) + self.max_tokens > max_context:
            raise RequestError(
                "max_tokens",
                f"prompt ({len(self.prompt_ids)} tokens) + max_tokens ({self.max_tokens}) "
                f"exceeds the context of {max_context} tokens",
            )

    def validate_sampling(self) -> None:
        """The checks that need no model (the command line runs them before loading)."""
        if self.max_tokens < 1:
            raise RequestError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if math.isnan(self.temperature) or self.temperature < 0:
            raise RequestError("temperature", f"must be >= 0, got {self.temperature}")
        if math.isnan(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError("top_k", f"must be >= 0, got {self.top_k}")
        if math.isnan(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:  # mx.random.key takes a uint64
            raise RequestError("seed", f"must be in [0, 2**64), got {self.seed}")
        if any(not s for s in self.stop):
            raise RequestError("stop", "stop strings must not be empty")

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


@dataclass
class TokenEvent:
    """One decoded token: its id, log-probability (before temperature) and new text."""

    token_id: int
    logprob: float
    text: str


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
