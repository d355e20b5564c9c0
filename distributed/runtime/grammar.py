"""Constrained decoding on rank 0: a sequence whose request carries a grammar samples
only tokens the grammar allows (llguidance: JSON schemas, Lark, regular expressions).

Each constrained sequence has a Constraint: an llguidance matcher fed the tokens it
generated, and the token mask of its next position. The mask is computed in a worker
thread as soon as the previous token is known (prepare), while the ring computes the
step that needs it, and applied to that row's logits only: rows without a grammar
pay nothing. A speculative pass asks for the mask of each verified position in turn
(the matcher then takes the drafts that hold), so a draft the grammar forbids is never
accepted.
"""

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Optional

import mlx.core as mx
import numpy as np

from .request import RequestError

_WORKERS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
_BITS = mx.arange(32, dtype=mx.uint32)


class Grammars:
    """The llguidance tokenizer of a model (built once: about a second for a real
    vocabulary), and the constraints made with it."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock, self._ll = threading.Lock(), None

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
                self._ll = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size,
                                                        eos_token=sorted(self._tokenizer.eos_token_ids))
            return self._ll

    def constraint(self, grammar: str) -> "Constraint":
        return Constraint(self, grammar)


def one_line(message: str, limit: int = 300) -> str:
    """llguidance's multi-line messages (a regex error draws a caret) as one line."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())[:limit]


def json_schema_grammar(schema, strict: bool = True) -> str:
    """llguidance's grammar for JSON that validates against `schema` (compact, as
    OpenAI's structured output writes it; `strict` False: keywords llguidance cannot
    enforce are ignored rather than refused)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False, "lenient": not strict})


def lark_grammar(lark: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


def regex_grammar(regex: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_regex(regex)


class Constraint:
    """One sequence's matcher and its next mask (see the module's docstring)."""

    def __init__(self, grammars: Grammars, grammar: str):
        import llguidance

        self.vocab_size = grammars.vocab_size
        self.matcher = llguidance.LLMatcher(grammars.ll_tokenizer, grammar, log_level=0)
        self._check()
        self.consumed = 0  # generated tokens given to the matcher
        self._mask: Optional[Future] = None  # the next position's mask (None: not started)
        # Set if the matcher fails on a token (a bug here or in the library): the sequence
        # then ends with this error; the ring and every other request go on.
        self.error: Optional[str] = None

    def _check(self) -> None:
        if self.matcher.is_error():
            raise RequestError("grammar", f"the grammar library rejects it: {one_line(self.matcher.get_error())}")

    def _advance(self, new: List[int]) -> Optional[np.ndarray]:
        """Feed `new` tokens to the matcher, then compute the mask after them (None: it failed)."""
        if new and not self.matcher.consume_tokens(new):
            reason = self.matcher.get_error() if self.matcher.is_error() else f"tokens {new} are not allowed here"
            self.error = f"the grammar cannot go on: {one_line(reason)}"
            return None
        words = np.full((self.vocab_size + 31) // 32, -1, dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        return words

    def _take(self, generated: List[int]) -> List[int]:
        """The tokens of `generated` the matcher has not been given. (A verification pass gives
        it its tokens before they join `generated`: a shorter one is behind, not a rollback.)"""
        if self._mask is not None:  # the matcher is the worker's until that job is done
            self._mask.result()
        new = generated[self.consumed:]
        self.consumed = max(self.consumed, len(generated))
        return new

    def prepare(self, generated: List[int]) -> None:
        """The tokens so far are known: the worker feeds them to the matcher and computes the
        next position's mask while the ring computes the step that needs it."""
        new = self._take(generated)
        if self.error is None:
            self._mask = _WORKERS.submit(self._advance, new)

    def words(self, generated: List[int]) -> Optional[np.ndarray]:
        """The bitmask (32 tokens a word) of what the grammar allows after `generated`;
        None: anything (the matcher failed, and the sequence ends: Sequence.accept)."""
        new = self._take(generated)
        if self.error is None and (new or self._mask is None):
            self._mask = Future()
            self._mask.set_result(self._advance(new))
        return None if self.error is not None else self._mask.result()

    def mask(self, logits: mx.array, generated: List[int]) -> mx.array:
        """`logits` (1, vocab) with every token the grammar forbids after `generated` at -inf."""
        return apply_masks([self], [generated], logits)

    def valid_prefix(self, generated: List[int], drafts: List[int]) -> List[int]:
        """The drafts the grammar allows after `generated`, up to the first it forbids."""
        self.words(generated)  # the matcher where `generated` ends
        return drafts[: self.matcher.validate_tokens(drafts)] if drafts and self.error is None else []


def apply_masks(constraints: List[Optional[Constraint]], generated: List[List[int]], logits: mx.array) -> mx.array:
    """Each row of `logits` (rows, vocab) with what its constraint forbids at -inf (a row
    without one: as it is), in one operation for the batch."""
    words = [c.words(g) if c is not None else None for c, g in zip(constraints, generated)]
    if all(w is None for w in words):
        return logits
    full = np.full((logits.shape[-1] + 31) // 32, -1, dtype=np.int32)
    stacked = mx.array(np.stack([full if w is None else w for w in words]).view(np.uint32))
    allowed = ((stacked[:, :, None] >> _BITS) & 1).reshape(len(words), -1)[:, : logits.shape[-1]].astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))
