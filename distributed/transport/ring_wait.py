"""Waiting for the next frame of MLX's ring backend without spinning a core.

The ring backend's receive is a loop of non-blocking `recv` calls on its socket thread
(MLX's ring.cpp: no sleep, no poll), so a rank waiting for its next frame keeps a core
busy the whole time: on a Mac, a core taken from the host work of the rank that
computes; on a machine with fewer cores than ranks, time taken from the computing rank
itself. Instead, a rank waits with `select` until its incoming link has data, and only
then posts the receive, which then finds its bytes there.

The incoming link is the connections accepted on this rank's own ring address (the
previous rank connects to it: ring.cpp's `sockets_left_`), found among this process's
open sockets by their local port. None found (another backend, another layout of a
later MLX): no waiting, the receive spins as before.
"""

import json
import os
import select
import socket
from typing import List, Optional


def own_ring_ports() -> List[int]:
    """The ports this rank's ring address(es) listen on, from mlx.launch's hostfile."""
    path, rank = os.environ.get("MLX_HOSTFILE"), os.environ.get("MLX_RANK")
    if not path or rank is None:
        return []
    try:
        with open(path) as f:
            nodes = json.load(f)
        return [int(address.rsplit(":", 1)[1]) for address in nodes[int(rank)]]
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return []


def accepted_sockets(ports: List[int]) -> List[int]:
    """This process's connected TCP sockets whose local port is one of `ports`."""
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    found = []
    for name in os.listdir(fd_dir):
        fd = int(name)
        try:
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # not a socket (or gone)
        try:
            if probe.type == socket.SOCK_STREAM and probe.getsockname()[1] in ports:
                probe.getpeername()  # connected: not the listening socket
                found.append(fd)
        except (OSError, IndexError, TypeError):
            pass
        finally:
            probe.close()
    return sorted(found)


class IncomingWait:
    """Blocks until the previous rank's link has bytes to read (or closed)."""

    def __init__(self, fds: List[int]):
        self.fds = fds
        self._poll = select.poll()  # not select(): fds above 1024 are fine
        for fd in fds:
            self._poll.register(fd, select.POLLIN)

    @classmethod
    def for_ring(cls) -> Optional["IncomingWait"]:
        ports = own_ring_ports()
        fds = accepted_sockets(ports) if ports else []
        return cls(fds) if fds else None

    def wait(self, timeout_ms: int = -1) -> None:
        """Returns once readable, closed or failed (the receive sees which), or after
        `timeout_ms` (-1: never): then the receive waits as MLX does."""
        self._poll.poll(timeout_ms)
