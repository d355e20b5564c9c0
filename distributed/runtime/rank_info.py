"""What each rank reports about itself: host, layer range, memory.

Rows travel around the ring as int32 (the transport moves arrays, not
strings), so the host name is packed one character per column.
"""

import socket
from typing import List

import mlx.core as mx

from ..rows import HOST_CHARS, columns_text, join_int, split_int, text_columns

_FIXED = 9  # rank, start, end, embed, head, peak (2 cols), params (2 cols)
ROW_WIDTH = _FIXED + HOST_CHARS


def encode_row(rank: int, start: int, end: int, first: bool, parameter_bytes: int) -> mx.array:
    fixed = [rank, start, end, int(first), int(first)]
    fixed += split_int(mx.get_peak_memory()) + split_int(parameter_bytes)
    return mx.array(fixed + text_columns(socket.gethostname()), dtype=mx.int32)[None, None, :]


def decode_rows(table: mx.array) -> List[dict]:
    rows = []
    for row in table.reshape(-1, ROW_WIDTH).tolist():
        host = columns_text(row[_FIXED:])
        rows.append(
            {
                "rank": row[0],
                "host": host,
                "layers": [row[1], row[2]],
                "embed": bool(row[3]),
                "head": bool(row[4]),
                "peak_memory_bytes": join_int(row[5], row[6]),
                "parameter_bytes": join_int(row[7], row[8]),
            }
        )
    return rows
