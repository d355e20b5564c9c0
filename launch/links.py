"""Measured links for the planner: what `trinity-launch doctor` (launch/link_probe.py) found
between consecutive ranks and over the whole ring, kept per hostfile with its date, and read
by `trinity-launch plan` and `run` in place of launch/tensor_plan.py's assumed LINKS.

A hop between stages costs half the fastest measured round trip of a hidden state between
those two ranks (a pair that was not measured, not being consecutive, the slowest measured hop);
one step of a group's ring all-reduce costs the fastest measured all_sum over every rank /
(2 (N - 1)) when the group is every rank, or that group's own all_sum / (2 (T - 1)) where it was
measured (MPI: groups of consecutive ranks), else the slowest hop inside the group (one step is
one hop). The fastest trip is the link's own cost: the median adds whatever else loaded the hosts
while the doctor measured (a busy machine's scheduling: in CI the median all-reduce over a bridge
grew tenfold and exceeded a 10 ms line's), which the run does not inherit. Records from before
the fastest figures were kept fall back to the medians.

The cache: $XDG_CACHE_HOME/trinity-pipeline/links/<key>.json (else ~/.cache/...), the key a
hash of the hosts (ssh names and IPs, in rank order) and the backend, so an edited hostfile
is measured again.
"""

import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import List, Optional

from .hostfile import Hostfile


def cache_folder() -> Path:
    from distributed.runtime.disk_cache import default_folder

    return default_folder().parent / "links"  # beside the prefix cache's, under the same XDG rule


def cache_key(hf: Hostfile) -> str:
    hosts = [[h.ssh, list(h.ips)] for h in hf.hosts]
    return hashlib.sha256(json.dumps([hf.backend, hosts]).encode()).hexdigest()[:16]


def fastest_all_reduce_ms(measured: dict) -> float:
    return measured.get("all_reduce_min_ms", measured["all_reduce_ms"])


class MeasuredLinks:
    """tensor_plan's links interface (hop_s, step_s, name, source) from one measurement."""

    def __init__(self, measured: dict, source: str):
        self.measured, self.source = measured, source
        self.hops = {}
        for pair in measured["pairs"]:
            hop = pair.get("rtt_min_ms", pair["rtt_ms"]) / 2e3
            self.hops[(pair["from"], pair["to"])] = self.hops[(pair["to"], pair["from"])] = hop
        self.slowest = max(self.hops.values(), default=0.0)
        self.ranks = measured["ranks"]

    def hop_s(self, a: int, b: int) -> float:
        return self.hops.get((a, b), self.slowest)

    def step_s(self, ranks: List[int]) -> float:
        if len(ranks) == self.ranks and self.ranks > 1:
            return fastest_all_reduce_ms(self.measured) / 1e3 / (2 * (self.ranks - 1))
        group = next((g for g in self.measured.get("groups", []) if sorted(g["ranks"]) == sorted(ranks)), None)
        if group is not None:
            return fastest_all_reduce_ms(group) / 1e3 / (2 * (len(ranks) - 1))
        return max((self.hop_s(a, b) for a in ranks for b in ranks if a != b), default=0.0)

    def name(self, ranks: List[int]) -> str:
        return f"measured, {self.step_s(ranks) * 1e3:.3f} ms an all-reduce step"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def save(hf: Hostfile, measured: dict) -> Path:
    """Keep a doctor run's links for this hostfile (atomically); the file's path."""
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{cache_key(hf)}.json"
    record = {"date": now(), "hostfile": str(hf.path) if hf.path else None, "hosts": hf.names,
              "backend": hf.backend, "links": measured}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
    return path


def cached(hf: Hostfile) -> Optional[MeasuredLinks]:
    """The last doctor run's links for this hostfile, or None."""
    path = cache_folder() / f"{cache_key(hf)}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if record.get("hosts") != hf.names or record["links"]["ranks"] != len(hf.hosts):
        return None
    return MeasuredLinks(record["links"], f"measured by `trinity-launch doctor` on {record['date']} ({path})")


def fresh(measured: dict) -> MeasuredLinks:
    return MeasuredLinks(measured, f"measured now (--measure-links, {now()})")
