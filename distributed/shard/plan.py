"""Which contiguous range of decoder layers each rank holds: an even split, `--split`, or a
plan by memory.

By memory (plan_layers; plain numbers in, a Plan out): run_trinity.py calls it at start-up
once the ranks have exchanged their measured memory, and `python -m launch`
calls it before starting them.

Each host gets a contiguous range. The split minimises the largest
load / (usable memory x speed) over hosts, where a host's load is its layers'
weights plus their KV cache at the target context (and, on rank 0, the
embedding and head), and usable memory is what is left after a safety margin.
So loads come out proportional to memory (times speed), rank 0 takes fewer
layers, and no host is planned past its usable memory.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .. import TrinityError
from .memory import DEFAULT_MARGIN
from .sizes import ModelSizes, model_sizes

LayerRange = Tuple[int, int]


def even_split(num_layers: int, num_ranks: int) -> List[int]:
    """Layers per rank, as even as possible.

    The remainder goes to the last ranks: rank 0 also holds the embedding and
    the head, so it is the one that should take fewer layers.
    """
    if num_ranks > num_layers:
        raise TrinityError(
            f"cannot split {num_layers} layers over {num_ranks} ranks: "
            "every rank needs at least one layer"
        )
    base, extra = divmod(num_layers, num_ranks)
    return [base + (1 if r >= num_ranks - extra else 0) for r in range(num_ranks)]


def parse_split(text: str) -> List[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise TrinityError(
            f"--split {text!r} is malformed: expected comma-separated layer counts, e.g. 10,12,10"
        ) from None


def layer_ranges(
    num_layers: int, num_ranks: int, split: Optional[List[int]] = None
) -> List[LayerRange]:
    """[start, end) per rank, validating an explicit split."""
    if split is None:
        split = even_split(num_layers, num_ranks)
    elif len(split) != num_ranks:
        raise TrinityError(
            f"--split has {len(split)} entries but there are {num_ranks} ranks "
            "(one entry per rank)"
        )
    elif any(n <= 0 for n in split):
        raise TrinityError(f"--split entries must be positive, got {split}")
    elif sum(split) != num_layers:
        raise TrinityError(
            f"--split sums to {sum(split)} but the model has {num_layers} layers"
        )
    ranges, start = [], 0
    for n in split:
        ranges.append((start, start + n))
        start += n
    return ranges


GIB = 1 << 30


@dataclass
class HostPlan:
    host: str
    rank: int
    start: int
    end: int
    weight_bytes: int
    cache_bytes: int
    memory_bytes: int
    usable_bytes: int
    speed: float = 1.0
    weights: Dict[str, int] = field(default_factory=dict)  # by category
    draft_bytes: int = 0  # rank 0: the draft model's weights and caches (--draft-model)

    @property
    def layers(self) -> List[int]:
        return [self.start, self.end]

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes + self.draft_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.memory_bytes - self.total_bytes

    @property
    def missing_bytes(self) -> int:
        return max(0, self.total_bytes - self.usable_bytes)

    def to_json(self) -> dict:
        return {
            "host": self.host, "rank": self.rank, "layers": self.layers,
            "weight_bytes": self.weight_bytes, "cache_bytes": self.cache_bytes,
            "memory_bytes": self.memory_bytes, "usable_bytes": self.usable_bytes,
            "headroom_bytes": self.headroom_bytes, "speed": self.speed, "weights": self.weights,
            "draft_bytes": self.draft_bytes,
        }


@dataclass
class Plan:
    hosts: List[HostPlan]
    context: int
    margin: float
    source: str  # where the sizes came from: "config" or "tensors"

    @property
    def fits(self) -> bool:
        return all(h.missing_bytes == 0 for h in self.hosts)

    @property
    def split(self) -> List[int]:
        return [h.end - h.start for h in self.hosts]

    def to_json(self) -> dict:
        return {"fits": self.fits, "context": self.context, "margin": self.margin,
                "source": self.source, "split": self.split, "hosts": [h.to_json() for h in self.hosts]}

    def shortfall(self) -> str:
        """What is missing where, for a plan that does not fit."""
        lines = []
        for h in self.hosts:
            if h.missing_bytes:
                lines.append(
                    f"host {h.host} (rank {h.rank}) needs {gib(h.total_bytes)} for layers "
                    f"[{h.start}, {h.end}){' with the embedding and head' if h.rank == 0 else ''}"
                    f"{' and the draft model' if h.draft_bytes else ''} "
                    f"at context {self.context} but has {gib(h.usable_bytes)} usable "
                    f"({gib(h.memory_bytes)} less the {self.margin:.0%} safety margin): "
                    f"{gib(h.missing_bytes)} missing"
                )
        need = sum(h.total_bytes for h in self.hosts)
        have = sum(h.usable_bytes for h in self.hosts)
        if need > have:
            lines.append(f"in all the model needs {gib(need)} and the hosts offer {gib(have)} usable: "
                         f"{gib(need - have)} missing (add a host, shorten --context, or quantize)")
        return "\n".join(lines)

    def describe(self) -> str:
        """A table: per host its layers, weights by kind, cache, memory and headroom."""
        # GiB, or MiB when the weights are small (tiny test models), so the figures say something.
        unit, div = ("GiB", GIB) if max(h.weight_bytes for h in self.hosts) >= GIB // 10 else ("MiB", 1 << 20)

        def f(n: int) -> str:
            return f"{n / div:.2f}"

        rows = [f"{'rank':>4}  {'host':<18} {'layers':<10} {'attn':>8} {'dense':>8} {'experts':>8} {'emb/head':>8} "
                f"{'weights':>8} {'cache':>8} {'memory':>9} {'usable':>9} {'headroom':>9}"]
        for h in self.hosts:
            w = h.weights
            rows.append(
                f"{h.rank:>4}  {h.host[:18]:<18} {f'[{h.start}, {h.end})':<10} {f(w.get('attention', 0)):>8} "
                f"{f(w.get('dense_mlp', 0)):>8} {f(w.get('experts', 0)):>8} {f(w.get('embed_head', 0)):>8} "
                f"{f(h.weight_bytes):>8} {f(h.cache_bytes + h.draft_bytes):>8} {f(h.memory_bytes):>9} "
                f"{f(h.usable_bytes):>9} {f(h.headroom_bytes):>9}"
            )
        draft = self.hosts[0].draft_bytes
        rows.append(f"{unit}; context {self.context} tokens; safety margin {self.margin:.0%}; "
                    + (f"rank 0 also holds the draft model ({f(draft)}, in its cache column); " if draft else "")
                    + 
                    f"sizes from {self.source}; split {','.join(map(str, self.split))}; "
                    + ("fits" if self.fits else "DOES NOT FIT"))
        return "\n".join(rows)


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _partition(costs: Sequence[int], head: int, usable: Sequence[int], weights: Sequence[float], capped: bool):
    """Layer boundaries minimising (max load/weight, sum of squares) over contiguous splits,
    every host at least one layer; with `capped`, no host past its usable bytes. None if impossible."""
    L, P = len(costs), len(usable)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = (math.inf, math.inf)
    best = [[inf] * (L + 1) for _ in range(P + 1)]
    choice = [[0] * (L + 1) for _ in range(P + 1)]
    best[0][0] = (0.0, 0.0)
    for i in range(P):
        extra = head if i == 0 else 0
        for e in range(i + 1, L - (P - 1 - i) + 1):
            for s in range(i, e):
                prev = best[i][s]
                if prev[0] == math.inf:
                    continue
                load = prefix[e] - prefix[s] + extra
                if capped and load > usable[i]:
                    continue
                r = load / weights[i]
                cand = (max(prev[0], r), prev[1] + r * r)
                if cand < best[i + 1][e]:
                    best[i + 1][e], choice[i + 1][e] = cand, s
    if best[P][L][0] == math.inf:
        return None
    bounds, e = [L], L
    for i in range(P, 0, -1):
        e = choice[i][e]
        bounds.append(e)
    return bounds[::-1]


def plan_sizes(sizes: ModelSizes, memories: Sequence[int], speeds: Optional[Sequence[float]] = None,
               context: int = 4096, hosts: Optional[Sequence[str]] = None, margin: float = DEFAULT_MARGIN,
               draft_bytes: int = 0) -> Plan:
    """plan_layers for sizes already computed."""
    P, L = len(memories), sizes.num_layers
    speeds = list(speeds) if speeds is not None else [1.0] * P
    hosts = list(hosts) if hosts is not None else [f"rank{r}" for r in range(P)]
    if P == 0:
        raise TrinityError("no hosts to plan for")
    if len(speeds) != P or len(hosts) != P:
        raise TrinityError(f"{P} memories but {len(speeds)} speeds and {len(hosts)} host names")
    if P > L:
        raise TrinityError(f"cannot split {L} layers over {P} hosts: every host needs at least one layer")
    if any(m <= 0 for m in memories) or any(s <= 0 for s in speeds):
        raise TrinityError(f"memory and speed must be positive, got {list(memories)} and {speeds}")
    if not 0 <= margin < 1:
        raise TrinityError(f"the safety margin must be in [0, 1), got {margin}")
    if context < 1:
        raise TrinityError(f"the context must be at least 1 token, got {context}")
    usable = [int(m * (1 - margin)) for m in memories]
    costs = [sizes.layer_weight_bytes(l) + sizes.layer_cache_bytes(l, context) for l in range(L)]
    head = sizes.embed_head + draft_bytes  # what rank 0 holds beside its layers
    bounds = _partition(costs, head, usable, [u * s for u, s in zip(usable, speeds)], capped=True)
    if bounds is None:
        # Nothing fits: show the memory-proportional split and what each host lacks under it.
        bounds = _partition(costs, head, usable, usable, capped=False)
    out = []
    for r in range(P):
        s, e = bounds[r], bounds[r + 1]
        out.append(HostPlan(
            host=hosts[r], rank=r, start=s, end=e,
            weight_bytes=sizes.weight_bytes(s, e, r == 0), cache_bytes=sizes.cache_bytes(s, e, context),
            memory_bytes=int(memories[r]), usable_bytes=usable[r], speed=float(speeds[r]),
            weights=sizes.breakdown(s, e, r == 0), draft_bytes=draft_bytes if r == 0 else 0,
        ))
    return Plan(out, context, margin, sizes.source)


def plan_layers(config: dict, memories: Sequence[int], speeds: Optional[Sequence[float]] = None,
                context: int = 4096, index_sizes: Optional[Dict[str, int]] = None,
                hosts: Optional[Sequence[str]] = None, margin: float = DEFAULT_MARGIN, draft_bytes: int = 0) -> Plan:
    """Plan contiguous layer ranges for hosts with `memories` bytes each (rank order).

    config: config.json as a dict. speeds: optional relative speed per host (default 1).
    context: target tokens per request (prompt + generation). index_sizes: exact bytes per
    checkpoint tensor name, when known (see launch.checkpoint.tensor_sizes). draft_bytes:
    what rank 0 holds beside its layers for --draft-model (shard/draft.py). A plan that
    does not fit has fits == False; plan.shortfall() says what is missing where.
    """
    return plan_sizes(model_sizes(config, index_sizes), memories, speeds, context, hosts, margin, draft_bytes)
