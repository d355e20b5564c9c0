"""Process groups, ports and signals: what the launcher needs from the OS.

Every rank (or mlx.launch) runs in a process group of its own; these tell what
of a group, or under a process, is still alive, and signal it. Linux reads
/proc; elsewhere only what os.killpg can tell.
"""

import os
import random
import signal
import socket
from typing import Iterable, List, Set


def signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


_handed_out: Set[int] = set()  # every port free_ports returned in this process


def free_ports(n: int, host: str = "127.0.0.1", avoid: Iterable[int] = ()) -> List[int]:
    """n consecutive ports free now (the ranks bind them moments later). Taken below
    Linux's ephemeral range (32768+), where outgoing connections, the ring's own
    included, would otherwise take them in the meantime. Never a port in `avoid` or one
    handed out before in this process: those may be free only because their owner has not
    bound them yet (a ring port picked a moment ago, the router's upstream between restarts)."""
    taken = _handed_out | set(avoid)
    for _ in range(200):
        base = random.randrange(20000, 32000 - n)
        if taken.intersection(range(base, base + n)):
            continue
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        ports = list(range(base, base + n))
        _handed_out.update(ports)
        return ports
    socks = [socket.socket() for _ in range(n)]  # crowded: any free ports
    try:
        for s in socks:
            s.bind((host, 0))
        ports = [s.getsockname()[1] for s in socks]
        _handed_out.update(ports)
        return ports
    finally:
        for s in socks:
            s.close()


def group_members(pgid: int) -> List[int]:
    """Live processes of process group `pgid` (Linux: from /proc; zombies, already dead
    and waiting for init to reap them, do not count)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            out.append(int(pid))
    return out


def group_alive(pgid: int) -> bool:
    """Whether any process of process group `pgid` still runs."""
    if os.path.isdir("/proc/self"):
        return bool(group_members(pgid))
    try:  # no /proc (macOS): zombies count too, until reaped
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but not ours any more (pid reuse): not our orphan
        return False


def children(pid: int) -> List[int]:
    """Live child processes of pid (Linux: from /proc; empty elsewhere)."""
    out = []
    if not os.path.isdir("/proc/self"):
        return out
    for child in os.listdir("/proc"):
        if not child.isdigit():
            continue
        try:
            with open(f"/proc/{child}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if len(fields) > 1 and int(fields[1]) == pid and fields[0] != b"Z":
            out.append(int(child))
    return out


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
