"""Start-up handshake: before anyone loads weights, every rank reports its host,
usable memory, model fingerprint and layer slice. Every rank checks the table
the same way, so all refuse together, naming the rank at fault, instead of one
failing later while the others wait on it."""

import hashlib
import socket
from pathlib import Path
from typing import List, Optional, Tuple

from .. import TrinityError
from ..shard.loader import INDEX_FILE
from ..rows import columns_text, gather_rows, join_int, split_int, text_columns


class StartupRefused(TrinityError):
    """A verdict every rank reached from the same exchanged table: each exits
    with it on its own (no rank waits for, or needs to hear from, another)."""

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
    fp_ints = [int(fp[i : i + 8], 16) & 0x7FFFFFFF for i in range(0, len(fp), 8)]
    return [rank, *split_int(memory), *fp_ints, start, end, *split_int(need), *text_columns(host)]


def handshake(group, model_path: Path, config: dict, ranges, context: int, memory_limit=None,
              tensor: int = 1) -> List[dict]:
    """A collective (all_sum: every backend has it). Returns every rank's report,
    or raises TrinityError naming each rank with a different checkpoint or a
    slice that does not fit. Each rank's memory is its host share, or --memory-limit's bytes."""
    from ..shard.memory import limited, share_by_host, usable_memory_bytes
    from ..shard.sizes import model_sizes

    rank = group.rank()
    start, end = ranges[rank]
    sizes = model_sizes(config)
    need = sizes.weight_bytes(start, end, rank == 0) + sizes.cache_bytes(start, end, context)
    if tensor > 1:  # --tensor-parallel-size: 1/T of its stage's layers and caches; the first stage's ranks
        layers = sizes.weight_bytes(start, end, False)  # hold the embedding and head whole
        need = layers // tensor + sizes.weight_bytes(start, end, start == 0) - layers + sizes.cache_bytes(start, end, context) // tensor
    row = _row(rank, usable_memory_bytes(), fingerprint(model_path), start, end, need, socket.gethostname())
    reports = []
    for r in gather_rows(group, row):
        f = 3 + _FP_INTS
        reports.append({
            "rank": r[0], "memory_bytes": join_int(r[1], r[2]), "fingerprint": tuple(r[3:f]),
            "layers": [r[f], r[f + 1]], "need_bytes": join_int(r[f + 2], r[f + 3]),
            "host": columns_text(r[f + 4 :]),
        })
    shared = share_by_host([r["memory_bytes"] for r in reports], [r["host"] for r in reports])
    problems = []
    for r, memory in zip(reports, shared):
        r["memory_bytes"] = memory = limited(memory, memory_limit)
        if r["fingerprint"] != reports[0]["fingerprint"]:
            problems.append(f"rank {r['rank']} ({r['host']}) has a different checkpoint than rank 0 "
                            "(config.json, weight index or file sizes differ)")
        if r["need_bytes"] > memory:
            problems.append(f"rank {r['rank']} ({r['host']}) cannot fit layers [{r['layers'][0]}, {r['layers'][1]}): "
                            f"needs {r['need_bytes'] / 2**30:.2f} GiB at a {context}-token context, "
                            f"has {memory / 2**30:.2f} GiB usable")
    if problems:
        raise StartupRefused("start-up check failed: " + "; ".join(problems))
    return reports


ERROR_BYTES = 2048  # of each rank's start-up error text, utf-8


def exchange_errors(group, error: Optional[str]) -> List[Optional[str]]:
    """Every rank's start-up error text (None: it started), so rank 0 can show a
    peer's own error even when that peer runs on another machine."""
    data = (error or "").encode()[:ERROR_BYTES] if error is not None else b""
    row = [1 if error is not None else 0] + list(data) + [0] * (ERROR_BYTES - len(data))
    texts = []
    for r in gather_rows(group, row):
        texts.append(bytes(c for c in r[1:] if c).decode(errors="ignore") if r[0] else None)
    return texts


def _own_ipv4() -> str:
    """The source address of this host's default route (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def agree_control_address(group, explicit: Optional[Tuple[str, int]] = None):
    """After init, for backends that tell rank 0's address to nobody (MPI): rank 0
    listens (on `explicit`, else on every interface at a free port) and an
    all_sum gives every rank its port, IPv4 address and host name. Returns
    (rank 0's listener or None, the addresses to try in order, each rank's host)."""
    from .watchdog import listen

    rank = group.rank()
    listener = None
    port, ip = 0, "0.0.0.0"
    if rank == 0:
        listener = listen(explicit or ("0.0.0.0", 0))
        port, ip = listener.getsockname()[1], _own_ipv4()
    octets = [int(x) for x in ip.split(".")] if ip.count(".") == 3 else [0, 0, 0, 0]
    rows = gather_rows(group, [port, *octets, *text_columns(socket.gethostname())])
    hosts = [columns_text(r[5:]) for r in rows]
    port0, ip0 = rows[0][0], ".".join(map(str, rows[0][1:5]))
    if explicit is not None:
        return listener, [explicit], hosts
    candidates = [(ip0, port0), (hosts[0], port0)]
    if hosts[rank] == hosts[0]:
        candidates.insert(0, ("127.0.0.1", port0))
    return listener, candidates, hosts
