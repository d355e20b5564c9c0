"""`trinity-launch doctor`: before a ring starts, what will break, host by host.

1. A probe per host (launch/probes.py, launch/host_probe.py) over the launcher's ssh reports
   its versions, memory, disk, model files and the backend's prerequisites, and binds the
   ring port its rank would get.
2. Each host connects to the next rank's port (and, past two hosts, to the previous one's):
   the firewall, and the plain TCP link's round trip and bandwidth.
3. Where nothing failed so far: a ring of launch/link_probe.py started by `trinity-launch run`
   itself (same backend, ssh and interpreter) measures each consecutive link and one
   all-reduce of a hidden state as the run will see them; kept for the planner (launch/links.py).

`run` calls `fast_checks` (step 1 alone: versions, memory, ports) before starting a ring.
"""

import copy
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from distributed.shard.plan import Plan

from . import links as link_cache
from .checks import FAIL, PASS, SKIP, WARN, Check, backend_check, disk_check, firewall_check, memory_check, model_check, \
    port_check, version_checks
from .hostfile import Hostfile, Host
from .probes import ANSWER_S, Probe
from .processes import free_ports, signal_group

FAST = {"reachable", "python", "mlx", "mlx_backend", "mlx_lm", "package", "macos", "memory", "port"}
LINK_RING_S = 180.0  # the measuring ring's start, its trips at a few ms each, and its stop


@dataclass
class Options:
    python: str = sys.executable
    ssh: List[str] = field(default_factory=lambda: ["ssh"])
    starting_port: Optional[int] = None
    model: Optional[str] = None
    plan: Optional[Callable[[Hostfile], Optional[Plan]]] = None  # the shares, once memory is known
    links: bool = True  # step 3
    hidden: int = 2048  # values per hidden state on the measured links
    launch_args: List[str] = field(default_factory=list)  # for step 3's `trinity-launch run` (--hostfile ...)


@dataclass
class HostReport:
    host: Host
    address: str  # its ring port
    checks: List[Check] = field(default_factory=list)

    @property
    def failed(self) -> List[Check]:
        return [c for c in self.checks if c.status == FAIL]

    def to_json(self) -> dict:
        return {"host": self.host.ssh, "rank": self.host.rank, "address": self.address,
                "checks": [c.to_json() for c in self.checks]}


@dataclass
class Report:
    hosts: List[HostReport]
    backend: str
    links: Optional[dict] = None  # link_probe's figures
    tcp: Dict[str, dict] = field(default_factory=dict)  # "A -> B": the probes' own TCP figures
    links_note: str = ""  # why the links were not measured, or where they were kept
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(h.failed for h in self.hosts)

    def to_json(self) -> dict:
        return {"ok": self.ok, "date": link_cache.now(), "backend": self.backend, "wall_s": self.wall_s,
                "hosts": [h.to_json() for h in self.hosts], "links": self.links, "tcp": self.tcp,
                "links_note": self.links_note}


def ring_addresses(hf: Hostfile, starting_port: Optional[int], pick: bool = True) -> List[tuple]:
    """(ip, port) per rank, as the launcher would pick them (free here; likely free there);
    without --starting-port and `pick`, no port (None)."""
    n = len(hf.hosts)
    ports = [starting_port + r for r in range(n)] if starting_port is not None else \
        free_ports(n) if pick else [None] * n
    return [(h.ips[0] if h.ips else "127.0.0.1", port) for h, port in zip(hf.hosts, ports)]


def start_probes(hf: Hostfile, options: Options, addresses: List[tuple], env=None) -> List[Probe]:
    return [Probe(h, {"host": h.ssh, "model": options.model, "backend": hf.backend, "rdma": h.rdma, "ip": ip,
                      "port": port}, options.python, options.ssh, env) for h, (ip, port) in zip(hf.hosts, addresses)]


def gather(probes: List[Probe]) -> tuple:
    """(facts, bound) per host; None where the host gave none (all of them within ANSWER_S)."""
    deadline = time.monotonic() + ANSWER_S
    facts = [p.next(max(0.1, deadline - time.monotonic())) for p in probes]
    bound = [p.next(max(0.1, deadline - time.monotonic())) if f is not None else None for p, f in zip(probes, facts)]
    return [f and f["facts"] for f in facts], bound


def connect_neighbours(probes: List[Probe], addresses: List[tuple], bound: list) -> tuple:
    """Each host to the next rank's port (measured) and, past two hosts, to the previous one's:
    ({rank: {peer host: result}} of incoming connections, {"A -> B": tcp figures})."""
    n = len(probes)
    incoming: Dict[int, Dict[str, dict]] = {r: {} for r in range(n)}
    tcp = {}
    pairs = [(r, (r + 1) % n, True) for r in range(n)] + ([((r + 1) % n, r, False) for r in range(n)] if n > 2 else [])
    for a, b, measured in pairs if n > 1 else []:
        if bound[a] is None or bound[b] is None or not bound[b]["bound"]:
            continue
        answer = probes[a].ask({"connect": list(addresses[b]), "measure": measured})
        result = answer["connected"] if answer else {"ok": False, "error": f"{probes[a].host.ssh}'s probe ended"}
        incoming[b][probes[a].host.ssh] = result
        if measured and result["ok"]:
            tcp[f"{probes[a].host.ssh} -> {probes[b].host.ssh}"] = {k: v for k, v in result.items() if k != "ok"}
    return incoming, tcp


def with_measured_memory(hf: Hostfile, facts: list) -> Hostfile:
    """A copy of the hostfile with each host's measured memory where it gives none (as --split auto plans)."""
    hf = copy.deepcopy(hf)
    for h, f in zip(hf.hosts, facts):
        if h.memory_bytes is None and f is not None and f.get("memory_bytes"):
            h.memory_bytes = f["memory_bytes"]
    return hf


def host_checks(hf: Hostfile, r: int, facts: list, bound: list, incoming: dict, shares, options: Options,
                address: str) -> List[Check]:
    h, f = hf.hosts[r], facts[r]
    reference = facts[0] or f
    checks = [Check("reachable", PASS, f"{f['hostname']}")]
    checks += version_checks(f, reference, hf.hosts[0].ssh) if r else version_checks(f, f, h.ssh)
    share = shares[r] if shares else None
    checks += [memory_check(f, share), disk_check(f, share), model_check(f, options.model),
               backend_check(f, hf.backend, h.rdma, hf.names), port_check(bound[r], address),
               firewall_check(incoming.get(r, {}), address)]
    return checks


def unreachable(probe: Probe) -> List[Check]:
    return [Check("reachable", FAIL, probe.error(), f"check that `ssh {probe.host.ssh}` works without a password "
                  "(BatchMode) and that the interpreter exists there (--python)")]


def plan_shares(hf: Hostfile, facts: list, options: Options):
    if options.plan is None or any(f is None for f in facts):
        return None
    plan = options.plan(with_measured_memory(hf, facts))
    return sorted(plan.hosts, key=lambda p: p.rank) if plan else None


def probe_hosts(hf: Hostfile, options: Options, connect: bool, env=None) -> Report:
    """Steps 1 and 2 (step 2 only when `connect`)."""
    addresses = ring_addresses(hf, options.starting_port, pick=connect)
    probes = start_probes(hf, options, addresses, env)
    try:
        facts, bound = gather(probes)
        incoming, tcp = connect_neighbours(probes, addresses, bound) if connect else ({}, {})
    finally:
        for p in probes:
            p.close()
    shares = plan_shares(hf, facts, options)
    hosts = []
    for r, (p, (ip, port)) in enumerate(zip(probes, addresses)):
        report = HostReport(p.host, f"{ip}:{port}" if port else ip)
        report.checks = unreachable(p) if facts[r] is None else host_checks(
            hf, r, facts, bound, incoming if connect else {}, shares, options, report.address)
        if not connect:
            report.checks = [c for c in report.checks if c.name != "firewall"]
        hosts.append(report)
    return Report(hosts, hf.backend, tcp=tcp)


def tensor_sizes(hf: Hostfile) -> List[int]:
    """The tensor sizes 1 < T < N whose groups the backend can make (MPI splits groups)."""
    n = len(hf.hosts)
    return [t for t in range(2, n) if n % t == 0] if hf.backend == "mpi" else []


def measure_links(options: Options, hidden: int, hf: Hostfile) -> dict:
    """Step 3: link_probe's figures from a ring that `trinity-launch run` starts; raises
    RuntimeError with the launcher's last words when it fails."""
    command = [options.python, "-m", "launch.link_probe", json.dumps({"hidden": hidden, "groups": tensor_sizes(hf)})]
    argv = [sys.executable, "-m", "launch", "run", *options.launch_args, "--no-plan", "--no-checks", "--grace", "3",
            "--ssh", " ".join(options.ssh), "--python", options.python, "--", *command]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LINK_RING_S)
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGTERM)  # the launcher stops its ranks
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise RuntimeError(f"the measuring ring took over {LINK_RING_S:.0f} s: {' '.join(err.split())[-600:]}")
    found = [json.loads(x) for x in out.splitlines() if x.startswith('{"links"')]
    if proc.returncode or not found:
        raise RuntimeError(f"the measuring ring failed (status {proc.returncode}): {' '.join(err.split())[-600:]}")
    return found[-1]["links"]


def link_checks(report: Report, hf: Hostfile) -> None:
    """A "link" check on each host: its link to the next rank, as the backend measured it."""
    pairs = {p["from"]: p for p in (report.links or {}).get("pairs", [])}
    if len(pairs) == 1 and len(hf.hosts) == 2:  # two ranks: one link, both ways
        pairs[1] = dict(pairs[0], to=0)
    for r, host in enumerate(report.hosts):
        p = pairs.get(r)
        if p is None:
            host.checks.append(Check("link", SKIP, report.links_note or "one rank"))
            continue
        tcp = report.tcp.get(f"{host.host.ssh} -> {hf.hosts[p['to']].ssh}")
        host.checks.append(link_check(p, tcp, hf.hosts[p["to"]].ssh))


def link_check(pair: dict, tcp: Optional[dict], peer: str) -> Check:
    """Passed with its figures; warned where the backend's round trip is far above plain TCP's
    (ranks outnumbering a host's cores: the ring backend waits busily; or other load)."""
    rate = f"{pair['mbit_s']:,.0f} Mbit/s" if pair["mbit_s"] > 0 else "bandwidth lost in the noise"
    detail = f"to {peer}: {pair['rtt_ms']:.3f} ms round trip of a decode step's frame, {rate}"
    if tcp is None:
        return Check("link", PASS, detail)
    detail += f" (plain TCP {tcp['rtt_ms']:.3f} ms, {tcp['mbit_s']:,.0f} Mbit/s)"
    if pair["rtt_ms"] > max(10 * tcp["rtt_ms"], tcp["rtt_ms"] + 1.0):
        return Check("link", WARN, detail, "fewer ranks than cores on each host, and nothing else busy there")
    return Check("link", PASS, detail)


def run(hf: Hostfile, options: Options) -> Report:
    """Every step; the measured links kept for this hostfile."""
    tic = time.perf_counter()
    report = probe_hosts(hf, options, connect=True)
    if not options.links or len(hf.hosts) < 2:
        report.links_note = "not asked" if len(hf.hosts) > 1 else "one rank"
    elif not report.ok:
        report.links_note = "not measured: fix the failed checks first (a ring would not start)"
    else:
        try:
            report.links = measure_links(options, options.hidden, hf)
            report.links_note = (f"kept for `trinity-launch plan` and `run` in {link_cache.save(hf, report.links)}"
                                 if hf.path else "measured (kept only for a hostfile)")
        except RuntimeError as e:
            report.links_note = f"not measured: {e}"
            report.hosts[0].checks.append(Check("links", FAIL, str(e), "run the ring by hand with --log-level debug"))
    link_checks(report, hf)
    report.wall_s = time.perf_counter() - tic
    return report


MARKS = {"pass": "ok", "warn": "WARN", "fail": "FAIL", "skip": "-"}


def all_reduce_ms(measured: dict) -> str:
    return f"{measured['all_reduce_ms']:.3f} ms (fastest {link_cache.fastest_all_reduce_ms(measured):.3f})"


def describe(report: Report) -> str:
    """One row per host (every check's verdict), then each warning and failure with its fix."""
    lines = [f"trinity-launch doctor: {len(report.hosts)} host(s), {report.backend} backend, {link_cache.now()}"]
    for h in report.hosts:
        lines.append(f"{h.host.ssh} (rank {h.host.rank}, {h.address}): "
                     + " ".join(f"{c.name} {MARKS[c.status]}" for c in h.checks))
        for c in h.checks:
            if c.status in ("warn", "fail") or c.name in ("memory", "link"):
                lines.append(f"  {MARKS[c.status]:4} {c.name}: {c.detail}" + (f"  -> fix: {c.fix}" if c.fix else ""))
    if report.links:
        lines.append(f"all-reduce of a hidden state ({report.links['hidden']} float32) over {report.links['ranks']} "
                     f"ranks: {all_reduce_ms(report.links)}" + "".join(
                         f"; ranks {g['ranks']}: {all_reduce_ms(g)}" for g in report.links.get("groups", [])))
    lines.append(f"links: {report.links_note}")
    failed = [f"{h.host.ssh}: {c.name}" for h in report.hosts for c in h.failed]
    lines.append(f"{len(failed)} check(s) failed: {', '.join(failed)}" if failed else
                 f"every check passed ({report.wall_s:.1f} s)")
    return "\n".join(lines)


def fast_checks(hf: Hostfile, options: Options) -> Report:
    """Before `run` starts a ring: versions, memory and ports (no connections, no links)."""
    report = probe_hosts(hf, options, connect=False)
    for h in report.hosts:
        h.checks = [c for c in h.checks if c.name in FAST]
    return report


def failures(report: Report) -> List[str]:
    """One line per failed check: host, what was found, the fix."""
    return [f"{h.host.ssh} (rank {h.host.rank}): {c.name}: {c.detail}" + (f" -> fix: {c.fix}" if c.fix else "")
            for h in report.hosts for c in h.failed]
