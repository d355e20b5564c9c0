"""Tensor parallelism in the launcher: the memory each host needs under --tensor-parallel-size T,
which hosts form a group, and when to choose it over the pipeline (a speed model, per link).

Memory: ranks [sT, (s+1)T) are pipeline stage s (the layers split evenly between the N / T
stages, as the ranks split them); each holds 1/T of its stage's layers and their KV caches, and
the first stage's ranks the embedding and head whole.

Speed, one chat's decode (memory-bound on Apple silicon: a token reads every active weight once):
  pipeline over P hosts     (B_L + B_H) / (e BW) + L d + P hop
  tensor T, S = N/T stages  B_L / (h e BW) + B_H / (e BW) + L d + (2L + S) a + S hop  (no hop if S = 1)
B_L, B_H: the active bytes of the decoder layers (attention, dense MLPs, router, top-k and shared
experts) and of the lm_head (rank 0 alone runs it); h: the distinct hosts in a group (ranks on one
host share its memory bus, so splitting there reads no faster); a: one all-reduce of a hidden
vector in a group, 2 (T - 1) steps of its slowest link; d: a per-layer cost no split shrinks.
A hostfile's link between two hosts: RDMA over Thunderbolt 5 where the jaccl backends list an
RDMA device both ways (single-digit µs), else TCP (the ring and MPI backends: ~300 µs over a
Thunderbolt bridge; Apple's TN3205), or one host's shared memory. Those are assumed (LINKS);
`trinity-launch doctor` measures them instead (launch/links.py's MeasuredLinks), and every
function here takes either through `links`.
"""

import itertools
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from distributed import TrinityError
from distributed.shard.plan import HostPlan, Plan

from .hostfile import Hostfile


@dataclass(frozen=True)
class Link:
    name: str
    step_s: float  # one step of a ring all-reduce of a hidden vector (latency-bound at this size)
    hop_s: float  # one hidden-state hop between pipeline stages


LINKS = {
    "local": Link("one host", 20e-6, 50e-6),  # measured: all_sum of 2,048 floats between two local ranks ~40 µs
    "rdma": Link("RDMA over Thunderbolt 5", 5e-6, 10e-6),
    "tcp": Link("TCP", 150e-6, 300e-6),
}
SLOWEST_FIRST = ("tcp", "rdma", "local")
EFFICIENCY = 0.7  # share of the memory bandwidth a decode step reaches (assumed)
PER_LAYER_S = 0.05e-3  # kernel launches and host work per layer per token (assumed)
DEFAULT_BANDWIDTH_GB_S = 546.0  # an M4 Max; hosts say theirs with "bandwidth_gb_s"


def link(hf: Hostfile, a: int, b: int) -> str:
    """How ranks a and b are joined: "local", "rdma" or "tcp"."""
    ha, hb = hf.hosts[a], hf.hosts[b]
    if ha.ssh == hb.ssh or (ha.is_local and hb.is_local):
        return "local"
    if hf.backend in ("jaccl", "jaccl-ring") and len(ha.rdma) > b and len(hb.rdma) > a and ha.rdma[b] and hb.rdma[a]:
        return "rdma"
    return "tcp"


def group_link(hf: Hostfile, ranks: List[int]) -> str:
    """A group's slowest link (what its all-reduces wait for)."""
    kinds = {link(hf, a, b) for a, b in itertools.combinations(ranks, 2)} or {"local"}
    return next(k for k in SLOWEST_FIRST if k in kinds)


class AssumedLinks:
    """Each link's times from its kind (LINKS): what the planner uses without a measurement."""

    source = "assumed (launch/tensor_plan.py's LINKS; `trinity-launch doctor` measures them)"

    def __init__(self, hf: Hostfile):
        self.hf = hf

    def hop_s(self, a: int, b: int) -> float:
        return LINKS[link(self.hf, a, b)].hop_s

    def step_s(self, ranks: List[int]) -> float:
        return LINKS[group_link(self.hf, ranks)].step_s

    def name(self, ranks: List[int]) -> str:
        return LINKS[group_link(self.hf, ranks)].name


def active_bytes(config: dict) -> Dict[str, float]:
    """Bytes a token reads: {"layers": B_L, "head": B_H} (quantization as the config says)."""
    from distributed.shard.sizes import layer_bytes_from_config, matrix_bytes, model_args

    a = model_args(config)
    layers = 0.0
    for layer in range(a.num_hidden_layers):
        b = layer_bytes_from_config(config, layer, a)
        if layer >= a.num_dense_layers:  # of the routed experts, only the top-k are read
            p = f"model.layers.{layer}.mlp.experts."
            routed = sum(matrix_bytes(config, p + n, o, i, a.num_experts) for n, o, i in (
                ("gate_proj", a.moe_intermediate_size, a.hidden_size), ("up_proj", a.moe_intermediate_size, a.hidden_size),
                ("down_proj", a.hidden_size, a.moe_intermediate_size)))
            b["experts"] -= routed * (1 - a.num_experts_per_tok / a.num_experts)
        layers += sum(b.values())
    head = matrix_bytes(config, "lm_head" if not a.tie_word_embeddings else "model.embed_tokens",
                        a.vocab_size, a.hidden_size)
    return {"layers": layers, "head": float(head)}


def bandwidth(hf: Hostfile) -> float:
    """The slowest host's memory bandwidth, bytes/s (every stage and group waits for it)."""
    return min((h.bandwidth_gb_s or DEFAULT_BANDWIDTH_GB_S) for h in hf.hosts) * 1e9


def seconds_per_token(config: dict, hf: Hostfile, groups: List[List[int]], links=None) -> float:
    """The speed model: one token through `groups` (stages in order, each a tensor group; a
    group of one is a pipeline stage). links: AssumedLinks(hf) unless given (a measurement)."""
    from distributed.shard.sizes import model_args

    links = links or AssumedLinks(hf)
    L = model_args(config).num_hidden_layers
    b, bw = active_bytes(config), EFFICIENCY * bandwidth(hf)
    t = b["head"] / bw + L * PER_LAYER_S
    stages = len(groups)
    for ranks in groups:
        hosts = len({hf.hosts[r].ssh for r in ranks})
        t += b["layers"] / stages / (hosts * bw)
        if len(ranks) > 1:
            a = 2 * (len(ranks) - 1) * links.step_s(ranks)
            t += (2 * L / stages + 1) * a
    if stages > 1:
        t += stages * max(links.hop_s(g[0], h[0]) for g, h in zip(groups, groups[1:] + groups[:1]))
    return t


def place(hf: Hostfile, config: dict, size: int, links=None) -> List[List[int]]:
    """Ranks into groups of `size` (stage order), the fastest placement by the speed model; rank 0
    stays first. Up to 8 hosts every placement is tried, past that the hostfile's order is kept."""
    n = len(hf.hosts)
    ordered = [list(range(s, s + size)) for s in range(0, n, size)]
    if n > 8 or size in (1, n):
        return ordered

    def partitions(rest: List[int]):
        if not rest:
            yield []
            return
        for others in itertools.combinations(rest[1:], size - 1):
            group = [rest[0], *others]
            for tail in partitions([r for r in rest if r not in group]):
                yield [group, *tail]

    return min(partitions(list(range(n))), key=lambda groups: seconds_per_token(config, hf, groups, links))


def tensor_plan(sizes, hf: Hostfile, groups: List[List[int]], context: int, margin: float) -> Plan:
    """The memory plan of a tensor-parallel launch: per host (in the groups' order) 1/T of its
    stage's layers and caches, plus the embedding and head whole on the first stage."""
    from distributed.shard.plan import layer_ranges

    size = len(groups[0])
    ranges = layer_ranges(sizes.num_layers, len(groups), None)
    out = []
    for rank, host in enumerate(r for g in groups for r in g):
        start, end = ranges[rank // size]
        first = rank < size
        weights = {k: (v if k == "embed_head" else v // size) for k, v in sizes.breakdown(start, end, first).items()}
        h = hf.hosts[host]
        out.append(HostPlan(host=h.ssh, rank=rank, start=start, end=end, weight_bytes=sum(weights.values()),
                            cache_bytes=sizes.cache_bytes(start, end, context) // size, memory_bytes=h.memory_bytes,
                            usable_bytes=int(h.memory_bytes * (1 - margin)), speed=h.speed, weights=weights))
    return Plan(out, context, margin, sizes.source)


@dataclass
class Option:
    """One way to run one chat over these hosts."""

    tensor: int  # 1: the pipeline
    groups: List[List[int]]
    tok_s: float
    refused: Optional[str] = None  # why this size cannot run here
    link_names: List[str] = field(default_factory=list)  # each group's slowest link, as the links say

    def describe(self, hf: Hostfile) -> str:
        if self.tensor == 1:
            how = f"pipeline over {len(self.groups)} host{'s' if len(self.groups) > 1 else ''}"
        else:
            stages = len(self.groups)
            how = f"--tensor-parallel-size {self.tensor}" + (f" ({stages} stages)" if stages > 1 else "") + ": " + \
                ", ".join("[" + " ".join(hf.hosts[r].ssh for r in g) + f"] {name}"
                          for g, name in zip(self.groups, self.link_names))
        return how

    def to_json(self, hf: Hostfile) -> dict:
        return {"tensor_parallel_size": self.tensor, "groups": [[hf.hosts[r].ssh for r in g] for g in self.groups],
                "links": [group_link(hf, g) for g in self.groups], "link_times": self.link_names, "tok_s": self.tok_s,
                "refused": self.refused}


def options(config: dict, hf: Hostfile, links=None) -> List[Option]:
    """The pipeline and each tensor size T > 1 dividing the hosts, fastest placement each."""
    from distributed.shard.sizes import model_args
    from distributed.shard.tensor import check_tensor_size

    n = len(hf.hosts)
    pipeline = [[r] for r in range(n)]
    links = links or AssumedLinks(hf)
    out = [Option(1, pipeline, 1 / seconds_per_token(config, hf, pipeline, links))]
    for size in range(2, n + 1):
        if n % size:
            continue
        refused = None
        try:
            check_tensor_size(model_args(config), size, config.get("quantization"))
        except TrinityError as e:
            refused = str(e)
        if size < n and hf.backend != "mpi" and refused is None:
            refused = (f"{n // size} groups of {size} need mx.distributed.Group.split, which the {hf.backend} "
                       "backend lacks (MPI has it)")
        groups = place(hf, config, size, links)
        out.append(Option(size, groups, 1 / seconds_per_token(config, hf, groups, links), refused,
                          [links.name(g) for g in groups]))
    return out


@dataclass
class Advice:
    options: List[Option]  # the pipeline first
    choice: Option
    bandwidth_gb_s: float
    links: str = AssumedLinks.source  # where the links' times came from

    @property
    def why(self) -> str:
        base, best = self.options[0], self.choice
        if best.tensor > 1:
            return (f"--tensor-parallel-size {best.tensor}: about {best.tok_s / base.tok_s:.2f}x the pipeline for "
                    "one chat (the pipeline keeps every host busy under many streams instead)")
        if len(self.options) == 1:
            return "the pipeline (no tensor size divides these hosts)"
        return "the pipeline: no tensor size that runs here is faster for one chat over these links"

    def to_json(self, hf: Hostfile) -> dict:
        return {"options": [o.to_json(hf) for o in self.options], "choice": self.choice.tensor, "why": self.why,
                "bandwidth_gb_s": self.bandwidth_gb_s, "links": self.links}

    def describe(self, hf: Hostfile) -> str:
        """Lines for `trinity-launch plan`: each option's predicted tok/s, then the choice."""
        base = self.options[0].tok_s
        lines = [f"one chat's decode by the speed model (docs/tensor-parallel.md; {self.bandwidth_gb_s:.0f} GB/s "
                 "memory bandwidth per host, \"bandwidth_gb_s\" in the hostfile; links " + self.links + "):"]
        for o in self.options:
            lines.append(f"  {o.tok_s:7.1f} tok/s  x{o.tok_s / base:.2f}  {o.describe(hf)}"
                         + (f"  (not here: {o.refused})" if o.refused else ""))
        return "\n".join(lines + [f"choose: {self.why}"])


def advise(config: dict, hf: Hostfile, links=None) -> Advice:
    """The fastest option for one chat that can run here."""
    links = links or AssumedLinks(hf)
    opts = options(config, hf, links)
    return Advice(opts, max((o for o in opts if o.refused is None), key=lambda o: o.tok_s), bandwidth(hf) / 1e9,
                  links.source)
