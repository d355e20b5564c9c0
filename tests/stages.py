"""Building an in-process pipeline from a checkpoint, as --stages N does."""

from distributed.pipeline import in_process_pipeline as pipeline_of
from distributed.shard.loader import load_stage
from distributed.shard.plan import layer_ranges


def in_process_pipeline(path, split):
    """(pipeline, stages) for `split` layers per stage."""
    ranges = layer_ranges(sum(split), len(split), list(split))
    stages = [load_stage(path, s, e, i == 0) for i, (s, e) in enumerate(ranges)]
    return pipeline_of(stages), stages
