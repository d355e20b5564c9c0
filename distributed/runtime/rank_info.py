"""What each rank reports about itself: host, layer range, memory.

Rows travel around the ring as int32 (the transport moves arrays, not
strings), so the host name is packed one character per column.
"""

import socket
from typing import List

import mlx.core as mx

HOST_CHARS = 64
_FIXED = 9  # rank, start, end, embed, head, peak (2 cols), params (2 cols)
ROW_WIDTH = _FIXED + HOST_CHARS
_LOW = (1 << 31) - 1


def _split(v: int) -> List[int]:
    return [v >> 31, v & _LOW]


def encode_row(rank: int, start: int, end: int, first: bool, parameter_bytes: int) -> mx.array:
    host = socket.gethostname()[:HOST_CHARS]
    chars = [ord(c) for c in host] + [0] * (HOST_CHARS - len(host))
    fixed = [rank, start, end, int(first), int(first)]
    fixed += _split(mx.get_peak_memory()) + _split(parameter_bytes)
    return mx.array(fixed + chars, dtype=mx.int32)[None, None, :]


def decode_rows(table: mx.array) -> List[dict]:
    rows = []
    for row in table.reshape(-1, ROW_WIDTH).tolist():
        host = "".join(chr(c) for c in row[_FIXED:] if c)
        rows.append(
            {
                "rank": row[0],
                "host": host,
                "layers": [row[1], row[2]],
                "embed": bool(row[3]),
                "head": bool(row[4]),
                "peak_memory_bytes": (row[5] << 31) | row[6],
                "parameter_bytes": (row[7] << 31) | row[8],
            }
        )
    return rows
