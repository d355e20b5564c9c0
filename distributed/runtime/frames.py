"""What rank 0's Batcher has in the ring: decode groups and the frames whose replies it waits for."""

from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional


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
