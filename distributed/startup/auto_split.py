"""The plan made inside run_trinity.py when some host's memory is not in the hostfile.

`python -m launch run` then passes `--split auto` and, in the TRINITY_PLAN
environment variable, what it knows per rank (host name, memory from the
hostfile or null, speed), the safety margin and the context. Every rank measures
its memory, the ranks exchange it (a collective), and each computes the same
plan from the same numbers, so they agree on the split without another round.
"""

import json
import os
from typing import Dict, Optional

from .. import TrinityError
from ..shard.memory import DEFAULT_MARGIN, gather_memory, limited
from ..shard.plan import Plan, plan_layers

PLAN_ENV = "TRINITY_PLAN"


def plan_spec(hosts, margin: float, context: int) -> str:
    """The TRINITY_PLAN value for `hosts` (launch.hostfile.Host, rank order)."""
    return json.dumps({
        "hosts": [{"host": h.ssh, "memory_bytes": h.memory_bytes, "speed": h.speed} for h in hosts],
        "margin": margin,
        "context": context,
    }, separators=(",", ":"))


def startup_plan(config: dict, group, context: Optional[int] = None,
                 index_sizes: Optional[Dict[str, int]] = None, memory_limit=None, draft_model=None) -> Plan:
    """Measure, exchange and plan; every rank of `group` must call it, before loading.

    Memory from TRINITY_PLAN wins over the measured figure; context: the argument,
    else TRINITY_PLAN's, else max_position_embeddings. Check plan.fits (and raise
    plan.shortfall() on every rank) before loading. draft_model: --draft-model, which
    rank 0 holds beside its layers.
    """
    from ..shard.draft import draft_reserve  # imports mlx_lm, which the launcher (plan_spec) never needs

    spec = json.loads(os.environ.get(PLAN_ENV) or "{}")
    measured = [limited(m, memory_limit) for m in gather_memory(group)]  # --memory-limit's bytes win
    hosts = spec.get("hosts") or [{} for _ in range(group.size())]
    if len(hosts) != group.size():
        raise TrinityError(f"{PLAN_ENV} describes {len(hosts)} hosts but {group.size()} ranks started")
    context = context or spec.get("context") or config.get("max_position_embeddings") or 4096
    return plan_layers(
        config,
        memories=[h.get("memory_bytes") or measured[r] for r, h in enumerate(hosts)],
        speeds=[h.get("speed") or 1.0 for h in hosts],
        context=int(context),
        index_sizes=index_sizes,
        hosts=[h.get("host") or f"rank{r}" for r, h in enumerate(hosts)],
        margin=spec.get("margin", DEFAULT_MARGIN),
        draft_bytes=draft_reserve(draft_model, int(context), group.size()),
    )
