"""mlx.launch hostfiles, checked before anything starts.

Both of mlx.launch's formats are accepted (mlx/_distributed_utils/common.py):
a JSON list of hosts, or an object {"backend": ..., "envs": [...], "hosts": [...]}.
A host is {"ssh": name, "ips": [...], "rdma": [...]}; ours adds "memory_gb" (GiB
the model may use there; measured at start-up when absent), "speed" (relative,
default 1) and "bandwidth_gb_s" (its memory bandwidth, for the tensor-parallel advice
of launch/tensor_plan.py). mlx.launch ignores them, so the same file serves it unchanged.
"""

import ipaddress
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from distributed import TrinityError

BACKENDS = ("ring", "mpi", "nccl", "jaccl", "jaccl-ring")  # mlx.launch's own list
HOST_KEYS = {"ssh", "ips", "rdma", "memory_gb", "speed", "bandwidth_gb_s"}
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
GIB = 1 << 30


class HostfileError(TrinityError):
    pass


@dataclass
class Host:
    rank: int
    ssh: str
    ips: List[str] = field(default_factory=list)
    rdma: list = field(default_factory=list)
    memory_bytes: Optional[int] = None  # None: measured by the rank at start-up
    speed: float = 1.0
    bandwidth_gb_s: Optional[float] = None  # None: launch/tensor_plan.py's default

    @property
    def is_local(self) -> bool:
        return self.ssh in LOOPBACK


@dataclass
class Hostfile:
    hosts: List[Host]
    backend: str = "ring"
    envs: List[str] = field(default_factory=list)
    path: Optional[Path] = None

    @property
    def names(self) -> List[str]:
        return [h.ssh for h in self.hosts]


def local_hosts(n: int) -> Hostfile:
    """n ranks on this machine, as `mlx.launch -n n` makes them."""
    if n < 1:
        raise HostfileError(f"--single-host needs at least 1 rank, got {n}")
    return Hostfile([Host(r, "127.0.0.1", ["127.0.0.1"]) for r in range(n)])


def _number(where: str, key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise HostfileError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def _host(i: int, raw, where: str) -> Host:
    if not isinstance(raw, dict):
        raise HostfileError(f"{where}: host {i} must be an object like "
                            f'{{"ssh": "mac1.local", "ips": ["10.0.0.1"]}}, got {raw!r}')
    where = f"{where}: host {i}"
    ssh = raw.get("ssh")
    if not isinstance(ssh, str) or not ssh.strip():
        raise HostfileError(f"{where} has no \"ssh\" (the name to ssh into, e.g. \"mac1.local\")")
    where = f"{where} ({ssh})"
    ips = raw.get("ips", [])
    if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
        raise HostfileError(f"{where}: \"ips\" must be a list of IP addresses, got {ips!r}")
    for ip in ips:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise HostfileError(f"{where}: {ip!r} in \"ips\" is not an IP address") from None
    if len(set(ips)) != len(ips):
        raise HostfileError(f"{where}: \"ips\" lists the same address twice: {ips}")
    rdma = raw.get("rdma", [])
    if not isinstance(rdma, list):
        raise HostfileError(f"{where}: \"rdma\" must be a list, got {rdma!r}")
    unknown = sorted(set(raw) - HOST_KEYS)
    if unknown:  # mlx.launch ignores them too; most likely a typo of ours
        print(f"launch: warning: {where}: ignoring unknown key(s) {', '.join(unknown)} "
              f"(known: {', '.join(sorted(HOST_KEYS))})", file=sys.stderr)
    memory, bandwidth = raw.get("memory_gb"), raw.get("bandwidth_gb_s")
    return Host(
        rank=i, ssh=ssh, ips=ips, rdma=rdma,
        memory_bytes=None if memory is None else int(_number(where, "memory_gb", memory) * GIB),
        speed=_number(where, "speed", raw.get("speed", 1)),
        bandwidth_gb_s=None if bandwidth is None else _number(where, "bandwidth_gb_s", bandwidth),
    )


def check(hf: Hostfile, where: str) -> Hostfile:
    """Backend-specific rules, mirroring what mlx.launch would refuse (later, and less clearly)."""
    hosts, backend = hf.hosts, hf.backend
    if backend not in BACKENDS:
        raise HostfileError(f"{where}: unknown backend {backend!r} (mlx.launch knows {', '.join(BACKENDS)})")
    if not hosts:
        raise HostfileError(f"{where}: no hosts")
    seen = {}
    for h in hosts:
        # One machine listed twice is a copy-paste slip, except for local test rings and
        # MPI, where a repeated host means several slots on it.
        if h.ssh in seen and not h.is_local and backend != "mpi":
            raise HostfileError(f"{where}: host {h.ssh!r} is listed twice (ranks {seen[h.ssh]} and {h.rank}); "
                                "give each machine one entry")
        seen.setdefault(h.ssh, h.rank)
    owner = {}
    for h in hosts:
        for ip in h.ips:
            if ip in owner and owner[ip][0] != h.ssh:
                raise HostfileError(f"{where}: IP {ip} is listed for both {owner[ip][0]} (rank {owner[ip][1]}) "
                                    f"and {h.ssh} (rank {h.rank})")
            owner.setdefault(ip, (h.ssh, h.rank))
    if backend == "ring":
        for h in hosts:
            if not h.ips:
                raise HostfileError(f"{where}: host {h.rank} ({h.ssh}) has no \"ips\": the ring backend connects "
                                    "to IP addresses, e.g. \"ips\": [\"192.168.1.10\"] (the Thunderbolt bridge "
                                    "or Ethernet address)")
    if backend in ("nccl", "jaccl", "jaccl-ring") and not hosts[0].ips:
        raise HostfileError(f"{where}: the {backend} backend needs rank 0 ({hosts[0].ssh}) to have an IP in \"ips\" "
                            "that every other rank can reach")
    if backend in ("jaccl", "jaccl-ring"):
        for h in hosts:
            if len(h.rdma) != len(hosts):
                raise HostfileError(f"{where}: host {h.rank} ({h.ssh}) lists {len(h.rdma)} RDMA devices; "
                                    f"the {backend} backend needs one per host ({len(hosts)}), null for itself")
            if h.rdma[h.rank] is not None:
                raise HostfileError(f"{where}: host {h.rank} ({h.ssh}): its own RDMA entry "
                                    f"(position {h.rank}) must be null")
    for e in hf.envs:
        key = e.split("=", 1)[0] if isinstance(e, str) else ""
        if not key or not all(c.isalnum() or c == "_" for c in key):
            raise HostfileError(f"{where}: \"envs\" entries must be NAME=VALUE, got {e!r}")
    return hf


def parse(data, where: str = "hostfile", backend: Optional[str] = None) -> Hostfile:
    """A Hostfile from parsed JSON; `backend` (from the command line) overrides the file's."""
    envs, file_backend = [], None
    if isinstance(data, dict):
        if "hosts" not in data:
            raise HostfileError(f"{where}: an object hostfile needs a \"hosts\" list")
        hosts, envs, file_backend = data["hosts"], data.get("envs", []), data.get("backend")
        if not isinstance(envs, list):
            raise HostfileError(f"{where}: \"envs\" must be a list of NAME=VALUE strings, got {envs!r}")
    elif isinstance(data, list):
        hosts = data
    else:
        raise HostfileError(f"{where}: expected a JSON list of hosts or an object with \"hosts\", "
                            f"got {type(data).__name__}")
    if not isinstance(hosts, list):
        raise HostfileError(f"{where}: \"hosts\" must be a list, got {type(hosts).__name__}")
    parsed = [_host(i, h, where) for i, h in enumerate(hosts)]
    chosen = backend or file_backend or "ring"  # mlx.launch's default off CUDA
    return check(Hostfile(parsed, chosen, list(envs)), where)


def load(path, backend: Optional[str] = None) -> Hostfile:
    path = Path(path)
    if not path.exists():
        raise HostfileError(f"hostfile {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HostfileError(f"hostfile {path} is not valid JSON: {e}") from None
    hf = parse(data, str(path), backend)
    hf.path = path
    return hf


def to_json(hf: Hostfile) -> dict:
    """The hostfile as mlx.launch's object format (our extras kept: mlx.launch ignores them)."""
    hosts = []
    for h in hf.hosts:
        host = {"ssh": h.ssh, "ips": list(h.ips)}
        if h.rdma:
            host["rdma"] = list(h.rdma)
        if h.memory_bytes is not None:
            host["memory_gb"] = h.memory_bytes / GIB
        if h.speed != 1:
            host["speed"] = h.speed
        if h.bandwidth_gb_s is not None:
            host["bandwidth_gb_s"] = h.bandwidth_gb_s
        hosts.append(host)
    return {"backend": hf.backend, "envs": list(hf.envs), "hosts": hosts}
