"""How much memory this rank may use, and every rank's figure, exchanged at start-up."""

import socket
import subprocess
import sys
from typing import List, Optional, Sequence

_LOW = (1 << 31) - 1  # ranks exchange int32 (every backend sums those); a byte count takes two
HOST_CHARS = 64


def usable_memory_bytes() -> int:
    """Bytes the model may use on this machine.

    macOS: Metal's recommended working set (about 75% of RAM: what the GPU may
    wire without the system swapping), else the RAM size. MLX's CUDA build: the
    GPU's free memory. Otherwise (Linux, CPU): MemAvailable.
    """
    try:
        import mlx.core as mx

        if mx.cuda.is_available():
            info = mx.device_info()
            return int(info.get("free_memory") or info["total_memory"])
    except (AttributeError, KeyError):  # an mlx without mx.cuda or these keys: the host's figure
        pass
    if sys.platform == "darwin":
        try:
            import mlx.core as mx

            if mx.metal.is_available():
                return int(mx.device_info()["max_recommended_working_set_size"])
        except Exception:  # an older mlx without device_info: use the RAM size
            pass
        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot tell this machine's memory: no MemAvailable in /proc/meminfo")


def share_by_host(memories: Sequence[int], hosts: Sequence[str]) -> List[int]:
    """Ranks on one machine share it: each gets an equal part of the smallest figure seen there."""
    out = []
    for host in hosts:
        same = [m for m, h in zip(memories, hosts) if h == host]
        out.append(min(same) // len(same))
    return out


def gather_memory(group, nbytes: Optional[int] = None, host: Optional[str] = None) -> List[int]:
    """Every rank's usable memory in rank order, shared between ranks on the same host.

    A collective: every rank of `group` must call it, before loading (all_sum, so it
    works on every backend, NCCL included).
    """
    import mlx.core as mx

    nbytes = usable_memory_bytes() if nbytes is None else int(nbytes)
    host = (host or socket.gethostname())[:HOST_CHARS]
    row = [nbytes >> 31, nbytes & _LOW] + [ord(c) for c in host] + [0] * (HOST_CHARS - len(host))
    table = mx.zeros((group.size(), len(row)), dtype=mx.int32)
    table[group.rank()] = mx.array(row, dtype=mx.int32)
    rows = mx.distributed.all_sum(table, group=group).tolist()
    memories = [(r[0] << 31) | r[1] for r in rows]
    hosts = ["".join(chr(c) for c in r[2:] if c) for r in rows]
    return share_by_host(memories, hosts)
