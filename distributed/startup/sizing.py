"""What rank 0 sizes once the ring is loaded: the context a request may use, the batch
and the prefix cache, all from each rank's memory figure (its host share, or
--memory-limit) beside the weights it holds.

`--max-context N` is a limit as given; `--max-context auto` is the longest context at
which --max-batch sequences' caches fit on the tightest rank (shard/memory.py: longest_context),
so a request that could not fit is refused up front, naming the numbers, instead of
running out of memory mid-prefill. Under --memory-limit or --max-context auto each prefill chunk is also cut
to what fits: the longest (up to --prefill-step-size) whose activations at its own context
fit half the margin the plans leave on each rank (what every rank's guard checks each frame
against: runtime/memory_guard.py), so a request the context admits
is not refused mid-prefill.
"""

from dataclasses import dataclass
from typing import List, Optional

from .. import TrinityError
from ..runtime.memory_guard import ChunkBudget, MemoryAdmission
from ..runtime.prefix_cache import default_budget
from ..shard.draft import draft_reserve
from ..shard.memory import AUTO, CACHE_STEP, DEFAULT_CONTEXT, DEFAULT_MARGIN, kv_budget, longest_context
from .settings import SizingSettings


def fixed_context(sizing: SizingSettings) -> Optional[int]:
    """--max-context as a number (None: absent, or auto, which is known only after loading)."""
    return None if sizing.max_context in (None, AUTO) else sizing.max_context


def model_context(config: dict) -> int:
    return config.get("max_position_embeddings") or 2**31


def context_limit(sizing: SizingSettings, config: dict) -> int:
    """Prompt + max tokens limit before sizing: --max-context, else the model's."""
    return fixed_context(sizing) or model_context(config)


def checked_context(sizing: SizingSettings, config: dict) -> int:
    """The context each rank's start-up check must hold: --max-context's, the model's without it;
    with auto, one cache step (the longest context that fits is found once the weights are in)."""
    if sizing.max_context == AUTO:
        return min(model_context(config), CACHE_STEP)
    return context_limit(sizing, config)


def planning_context(sizing: SizingSettings, config: dict) -> int:
    """The context the default batch and prefix cache are planned at."""
    return min(context_limit(sizing, config), fixed_context(sizing) or DEFAULT_CONTEXT)


def prefix_cache_budget(sizing: SizingSettings, config: dict, ranks, memory_bytes: List[int]) -> int:
    """--prefix-cache-bytes, else a share of the tightest rank's memory beside its weights."""
    if sizing.prefix_cache_bytes is not None:
        return sizing.prefix_cache_bytes
    return default_budget(kv_budget(config, ranks, memory_bytes, planning_context(sizing, config)).free_bytes)


def beside_draft(sizing: SizingSettings, draft_model: Optional[str], config: dict, memory_bytes: List[int],
                 ranks: int) -> List[int]:
    """Each rank's memory figure, rank 0's less what --draft-model takes there: its weights
    and the caches of the sequences that may speculate at once (one per rank) at the
    planning context."""
    taken = draft_reserve(draft_model, planning_context(sizing, config), ranks)
    return [max(0, memory_bytes[0] - taken), *memory_bytes[1:]]


@dataclass
class Sizes:
    max_context: int
    max_batch: int
    prefix_cache_bytes: int
    prefill_step_size: int
    lines: List[str]  # what was chosen and why, printed at start
    chunk_budget: Optional[ChunkBudget] = None  # each prefill chunk's activations fit it


def serving_sizes(sizing: SizingSettings, config: dict, ranks, memory_bytes: List[int],
                  batch: Optional[int] = None) -> Sizes:
    """The context, batch and prefix cache of a server (`batch`: a fixed batch, as --chat's 1)."""
    prefix_cache_bytes = prefix_cache_budget(sizing, config, ranks, memory_bytes)
    # The prefix cache's bytes come out of every rank's share before the batch and the context.
    budget = kv_budget(config, ranks, memory_bytes, planning_context(sizing, config),
                       set_aside_bytes=prefix_cache_bytes)
    max_batch = batch or sizing.max_batch or budget.max_batch
    lines = [f"max batch: {max_batch}" + (" (--max-batch)" if sizing.max_batch or batch else f": {budget.describe()}")]
    max_context = context_limit(sizing, config)
    if sizing.max_context == AUTO:
        fit = longest_context(config, ranks, memory_bytes, max_batch, model_context(config),
                              set_aside_bytes=prefix_cache_bytes)
        if fit.context < 1:
            raise TrinityError(f"--max-context auto: no context fits {max_batch} sequences: rank {fit.tightest_rank} "
                               f"has {fit.free_bytes / 2**30:.2f} GiB beside its weights (lower --max-batch or "
                               f"--prefix-cache-bytes, or give the ring more memory)")
        max_context = fit.context
        lines.append(f"max context: {fit.describe()} (--max-context auto)")
    step, budget = sizing.prefill_step_size, None
    # The auto context leaves the margin to activations: chunks bounded to half of it make
    # a long prompt's peak (weights + caches + one chunk) known before it runs.
    if sizing.memory_limit is not None or sizing.max_context == AUTO:
        # Half the margin: the other half holds what else the rank keeps meanwhile (replies, logits, inputs).
        budget = ChunkBudget(config, int(min(memory_bytes) * DEFAULT_MARGIN) // 2)
        why = "--memory-limit's" if sizing.memory_limit is not None else "the memory's"
        last = budget.ending_at(max_context, step)
        lines.append(f"prefill chunk: up to {step} tokens, {last} where a prompt nears {max_context} "
                     f"(each chunk's activations at its context fit {why} margin)")
    return Sizes(max_context, max_batch, prefix_cache_bytes, step, lines, budget)


def memory_admission(sizing: SizingSettings, config: dict, ranks, memory_bytes: List[int],
                     sizes: Sizes) -> Optional[MemoryAdmission]:
    """Under --memory-limit: what a prompt waits for, or is refused for (runtime/memory_guard.py)."""
    if sizing.memory_limit is None:
        return None
    return MemoryAdmission(config, ranks, memory_bytes, sizes.prefill_step_size, sizes.max_context,
                           set_aside_bytes=sizes.prefix_cache_bytes, chunk_budget=sizes.chunk_budget)
