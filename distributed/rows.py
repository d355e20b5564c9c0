"""Small records every rank tells every other: rows of int32, gathered with one all_sum.

Every backend (ring, MPI, NCCL) sums int32 arrays, and none moves strings, so a rank's
record is a row of int32: byte counts as two columns of 31 bits, text one character (or
byte) per column, zero-padded. Each rank writes its row of a zero table; the sum is
everyone's rows, in rank order.
"""

from typing import List, Sequence

import mlx.core as mx

HOST_CHARS = 64  # of a host name
_LOW = (1 << 31) - 1


def split_int(value: int) -> List[int]:
    """A non-negative count up to 2**62, as two int32 columns."""
    return [value >> 31, value & _LOW]


def join_int(high: int, low: int) -> int:
    return (high << 31) | low


def text_columns(text: str, width: int = HOST_CHARS) -> List[int]:
    """`text`'s first `width` characters, one a column, zero-padded."""
    chars = [ord(c) for c in text[:width]]
    return chars + [0] * (width - len(chars))


def columns_text(columns: Sequence[int]) -> str:
    return "".join(chr(c) for c in columns if c)


def gather_rows(group, row: Sequence[int]) -> List[List[int]]:
    """Every rank's `row` (each the same length), in rank order. A collective: every
    rank of `group` calls it."""
    table = mx.zeros((group.size(), len(row)), dtype=mx.int32)
    table[group.rank()] = mx.array(list(row), dtype=mx.int32)
    return mx.distributed.all_sum(table, group=group).tolist()
