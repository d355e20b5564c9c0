"""Start-up handshake: before anyone loads weights, every rank reports its host,
usable memory, model fingerprint and layer slice. Every rank checks the table
the same way, so all refuse together, naming the rank at fault, instead of one
failing later while the others wait on it."""

import hashlib
import socket
from pathlib import Path
from typing import List

import mlx.core as mx

from . import TrinityError
from .shard.loader import INDEX_FILE

HOST_CHARS = 64
_LOW = (1 << 31) - 1
_FP_INTS = 4  # 16 bytes of the sha256: plenty to tell checkpoints apart


def fingerprint(model_path: Path) -> str:
    """config.json, the weight index and the weight files' names and sizes.

    A rank downloads only its own weight files, so sizes come from the index's
    own record where there is one; otherwise from the file(s) on disk.
    """
    h = hashlib.sha256((model_path / "config.json").read_bytes())
    index = model_path / INDEX_FILE
    if index.exists():
        h.update(index.read_bytes())
    else:
        for f in sorted(model_path.glob("model*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[: 8 * _FP_INTS]


def _row(rank, memory, fp, start, end, need, host) -> List[int]:
    fp_ints = [int(fp[i : i + 8], 16) & _LOW for i in range(0, len(fp), 8)]
    chars = [ord(c) for c in host[:HOST_CHARS]]
    return [rank, memory >> 31, memory & _LOW, *fp_ints, start, end, need >> 31, need & _LOW] + chars + [0] * (HOST_CHARS - len(chars))


def handshake(group, model_path: Path, config: dict, ranges, context: int) -> List[dict]:
    """A collective (all_sum: every backend has it). Returns every rank's report,
    or raises TrinityError naming each rank with a different checkpoint or a
    slice that does not fit."""
    from launch.memory import share_by_host, usable_memory_bytes
    from launch.sizes import model_sizes

    rank = group.rank()
    start, end = ranges[rank]
    sizes = model_sizes(config)
    need = sizes.weight_bytes(start, end, rank == 0) + sizes.cache_bytes(start, end, context)
    row = _row(rank, usable_memory_bytes(), fingerprint(model_path), start, end, need, socket.gethostname())
    table = mx.zeros((group.size(), len(row)), dtype=mx.int32)
    table[rank] = mx.array(row, dtype=mx.int32)
    reports = []
    for r in mx.distributed.all_sum(table, group=group).tolist():
        f = 3 + _FP_INTS
        reports.append({
            "rank": r[0], "memory_bytes": (r[1] << 31) | r[2], "fingerprint": tuple(r[3:f]),
            "layers": [r[f], r[f + 1]], "need_bytes": (r[f + 2] << 31) | r[f + 3],
            "host": "".join(chr(c) for c in r[f + 4 :] if c),
        })
    shared = share_by_host([r["memory_bytes"] for r in reports], [r["host"] for r in reports])
    problems = []
    for r, memory in zip(reports, shared):
        r["memory_bytes"] = memory
        if r["fingerprint"] != reports[0]["fingerprint"]:
            problems.append(f"rank {r['rank']} ({r['host']}) has a different checkpoint than rank 0 "
                            "(config.json, weight index or file sizes differ)")
        if r["need_bytes"] > memory:
            problems.append(f"rank {r['rank']} ({r['host']}) cannot fit layers [{r['layers'][0]}, {r['layers'][1]}): "
                            f"needs {r['need_bytes'] / 2**30:.2f} GiB at a {context}-token context, "
                            f"has {memory / 2**30:.2f} GiB usable")
    if problems:
        raise TrinityError("start-up check failed: " + "; ".join(problems))
    return reports
