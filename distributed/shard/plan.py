"""Which contiguous range of decoder layers each rank holds."""

from typing import List, Optional, Tuple

from .. import TrinityError

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
