"""What rank 0's Batcher has in the ring: decode groups and the frames whose replies it waits for,
and how large those frames are by default (the command line's defaults; this module imports no
mlx_lm, so the launcher reads rank command lines without it)."""

from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional

# Prompt tokens per prefill frame (--prefill-step-size), as mlx-lm's generate and
# BatchGenerator: on an H200 a batch of 64 prompts prefilled 1.4x faster in frames
# of 2048 tokens than of 512 (bench_steps.py, since removed: docs/benchmarks.md).
PREFILL_STEP_SIZE = 2048
# A prompt alone in a ring of P stages goes in CHUNKS_PER_STAGE * P chunks at least, so that every
# stage has one to compute while the others compute theirs (a pipeline of 2 chunks keeps 2 stages busy
# half the time); never in chunks shorter than MIN_CHUNK, below which a chunk's fixed costs (its hop,
# the expert weights read once per chunk) outweigh the overlap (bench/prefill_stages.py measures it).
CHUNKS_PER_STAGE = 4
MIN_CHUNK = 256

# The most drafts a verification frame may carry (--num-draft-tokens): a pass over 9 positions costs
# 1.31x one over 1 with the embedded model on a CPU with OpenBLAS (python -m bench micro verify; 1.01x
# over 5), and a copied passage is drafted best by long passes (the tiny editor at P = 1: 2.15x plain
# with up to 8, 1.36x with up to 4). A sequence's first pass drafts speculation.FIRST_DRAFTS.
DEFAULT_DRAFT_TOKENS = 8


class FrameKind(Enum):
    CHUNK = "chunk"  # prompt rows but their last tokens (prefill)
    STEP = "step"  # a decode step (it may carry a prefill chunk: Outstanding.chunk)
    VERIFY = "verify"  # a verification frame (speculation.Verifier)


@dataclass
class Group:
    slot: int
    members: list = field(default_factory=list)  # its Sequences
    busy: bool = False  # its decode step is in the ring


@dataclass
class Outstanding:
    """A frame in the ring whose reply rank 0 waits for."""

    kind: FrameKind
    sequences: list  # the frame's rows (Sequences), in order
    slot: int
    group: Optional[Group] = None
    picked: Optional[tuple] = None  # what _pick gives; one rank: as the frame was sent
    first: bool = False  # a step giving some rows their first token
    chunk: list = field(default_factory=list)  # a step's frame carrying a prefill chunk: that batch's rows
    drafts: List[int] = field(default_factory=list)  # a verification frame's draft tokens
    inputs: List[int] = field(default_factory=list)  # what it feeds: its first token, then the drafts
    cancelled: bool = False  # sent ahead on drafts that did not hold: its reply is dropped
    rows: int = 0  # a step's rows in its frame
