"""Which hosts the ring runs on now, and which were planned out: what the launcher's own
front end (the router) reads to tell clients why the ring is paused or gone for good.

`launch run` owns one HostSet for its whole life. The re-planner (launch/replan.py)
calls `replanned()` when it drops a lost host and starts the ring on the rest, and
`gave_up()` when it cannot (the model does not fit on the rest, rank 0's serving host
is gone, no host could be blamed); listeners registered with `on_replanned` and
`on_give_up` are called then, from the launcher's supervising thread. A router
answers UNAVAILABLE with `unavailable` once it is set, e.g. "host B (rank 1) is gone
and the model does not fit on the rest".
"""

import threading
from dataclasses import dataclass
from typing import Callable, List, Optional


@dataclass(frozen=True)
class LostHost:
    name: str  # the hostfile's ssh name
    rank: int  # its rank in the ring it was lost from
    ip: str
    reason: str  # e.g. "no answer at 10.0.0.2:22"

    def describe(self) -> str:
        return f"host {self.name} (rank {self.rank}, {self.ip})"


class HostSet:
    def __init__(self, hosts: List[str]):
        self._lock = threading.Lock()
        self.hosts: List[str] = list(hosts)  # rank order of the ring running (or starting) now
        self.lost: List[LostHost] = []  # every host planned out so far, oldest first
        self.unavailable: Optional[str] = None  # set once the launcher gave up for good
        self._on_replanned: List[Callable[[List[str]], None]] = []
        self._on_give_up: List[Callable[[str], None]] = []

    def on_replanned(self, listener: Callable[[List[str]], None]) -> None:
        """listener(hosts): the ring restarts on these hosts (rank order), the lost ones dropped."""
        self._on_replanned.append(listener)

    def on_give_up(self, listener: Callable[[str], None]) -> None:
        """listener(reason): the ring will not come back; reason is one line for clients."""
        self._on_give_up.append(listener)

    def replanned(self, hosts: List[str], lost: List[LostHost]) -> None:
        with self._lock:
            self.hosts = list(hosts)
            self.lost.extend(lost)
        for listener in list(self._on_replanned):
            listener(list(hosts))

    def gave_up(self, reason: str) -> None:
        with self._lock:
            self.unavailable = reason
        for listener in list(self._on_give_up):
            listener(reason)

    def snapshot(self) -> dict:
        with self._lock:
            return {"hosts": list(self.hosts), "unavailable": self.unavailable,
                    "lost": [{"host": h.name, "rank": h.rank, "ip": h.ip, "reason": h.reason} for h in self.lost]}
