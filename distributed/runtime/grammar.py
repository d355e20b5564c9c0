"""Constrained decoding on rank 0: a sequence whose request carries a grammar samples
only tokens the grammar allows (llguidance: JSON schemas, Lark, regular expressions).

Each constrained sequence has a Constraint: an llguidance matcher fed the tokens it
generated, and the token mask of its next position. A group's masks are computed in
one worker job as soon as its previous tokens are known (prepare_masks), while the
ring computes the step that needs them, and applied to the rows with a grammar only:
a batch without one pays nothing. A speculative pass asks for the mask of each verified position in turn
(the matcher then takes the drafts that hold), so a draft the grammar forbids is never
accepted.
"""

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .request import RequestError

_WORKERS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
COMPILED_KEPT = 32  # grammars whose compiled matcher is kept, for the next request with the same one
# From host memory, not mx.arange: a lazy array would belong to the importing thread's stream.
_BITS = mx.array(np.arange(32, dtype=np.uint32))


class Grammars:
    """The llguidance tokenizer of a model (built once: about a second for a real
    vocabulary), the grammars compiled lately, and the constraints made with them."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock, self._ll = threading.Lock(), None
        self._compiled = {}  # grammar -> its matcher as compiled, before any token; least recently used first

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

    def matcher(self, grammar: str):
        """A fresh matcher of `grammar`: a copy of the one compiled for it lately, if any (an agent
        sends the same tools with every request: compiling Codex's takes tens of milliseconds, a
        copy microseconds)."""
        import llguidance

        with self._lock:
            compiled = self._compiled.pop(grammar, None)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > COMPILED_KEPT:
                del self._compiled[next(iter(self._compiled))]
        return compiled.deep_copy()


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
        self.vocab_size = grammars.vocab_size
        self.matcher = grammars.matcher(grammar)
        self._check()
        self.consumed = 0  # generated tokens given to the matcher
        # The next position's mask: (the job writing it, its row in the job's words), or None: not started.
        self._mask: Optional[Tuple[Future, int]] = None
        # Set if the matcher fails on a token (a bug here or in the library): the sequence
        # then ends with this error; the ring and every other request go on.
        self.error: Optional[str] = None

    def _check(self) -> None:
        if self.matcher.is_error():
            raise RequestError("grammar", f"the grammar library rejects it: {one_line(self.matcher.get_error())}")

    def _advance(self, new: List[int], words: np.ndarray) -> None:
        """Feed `new` tokens to the matcher, then write the mask after them into `words`
        (left allowing everything if the matcher fails: the sequence then ends)."""
        if new and not self.matcher.consume_tokens(new):
            reason = self.matcher.get_error() if self.matcher.is_error() else f"tokens {new} are not allowed here"
            self.error = f"the grammar cannot go on: {one_line(reason)}"
            return
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def _take(self, generated: List[int]) -> List[int]:
        """The tokens of `generated` the matcher has not been given. (A verification pass gives
        it its tokens before they join `generated`: a shorter one is behind, not a rollback.)"""
        if self._mask is not None:  # the matcher is the worker's until that job is done
            self._mask[0].result()
        new = generated[self.consumed:]
        self.consumed = max(self.consumed, len(generated))
        return new

    def words(self, generated: List[int]) -> Optional[np.ndarray]:
        """The bitmask (32 tokens a word) of what the grammar allows after `generated`;
        None: anything (the matcher failed, and the sequence ends: Sequence.accept)."""
        new = self._take(generated)
        if self.error is None and (new or self._mask is None):
            done: Future = Future()
            done.set_result(_words(1, self.vocab_size))
            self._advance(new, done.result()[0])
            self._mask = (done, 0)
        return None if self.error is not None else self._mask[0].result()[self._mask[1]]

    def mask(self, logits: mx.array, generated: List[int]) -> mx.array:
        """`logits` (1, vocab) with every token the grammar forbids after `generated` at -inf."""
        return apply_masks([self], [generated], logits)

    def valid_prefix(self, generated: List[int], drafts: List[int]) -> List[int]:
        """The drafts the grammar allows after `generated`, up to the first it forbids."""
        self.words(generated)  # the matcher where `generated` ends
        return drafts[: self.matcher.validate_tokens(drafts)] if drafts and self.error is None else []


def _words(rows: int, vocab_size: int) -> np.ndarray:
    """Masks that allow every token, a row of 32-token words each."""
    return np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


def prepare_masks(constraints: List[Optional[Constraint]], generated: List[List[int]]) -> None:
    """A group's tokens so far are known: one worker job feeds each row's matcher its new
    tokens and writes every row's next mask into one array (all ones for a row without a
    grammar), while the ring computes the step that needs them; apply_masks then takes
    that array as it is when the step's rows are these."""
    rows = [(i, c, c._take(g)) for i, (c, g) in enumerate(zip(constraints, generated))
            if c is not None and c.error is None]
    if not rows:
        return
    words = _words(len(constraints), rows[0][1].vocab_size)

    def advance() -> np.ndarray:
        for i, c, new in rows:
            c._advance(new, words[i])
        return words

    job = _WORKERS.submit(advance)
    for i, c, _ in rows:
        c._mask = (job, i)


def apply_masks(constraints: List[Optional[Constraint]], generated: List[List[int]], logits: mx.array) -> mx.array:
    """Each row of `logits` (rows, vocab) with what its constraint forbids at -inf (a row
    without one: as it is), in one operation for the batch."""
    if all(c is None for c in constraints):
        return logits
    words = [c.words(g) if c is not None else None for c, g in zip(constraints, generated)]
    if all(w is None for w in words):
        return logits
    marks = [(i, c._mask) for i, c in enumerate(constraints) if c is not None]
    job = next(m[0] for _, m in marks if m is not None)
    table = job.result()
    if len(table) != len(constraints) or any(m is None or m[0] is not job or m[1] != i for i, m in marks):
        full = _words(1, logits.shape[-1])[0]  # not prepared together: gathered
        table = np.stack([full if w is None else w for w in words])
    stacked = mx.array(table.view(np.uint32))
    allowed = ((stacked[:, :, None] >> _BITS) & 1).reshape(len(words), -1)[:, : logits.shape[-1]].astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))
