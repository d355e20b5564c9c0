"""Building an in-process pipeline from a checkpoint, as --stages N does."""

from distributed.pipeline import Pipeline
from distributed.shard.loader import load_stage
from distributed.shard.plan import layer_ranges
from distributed.transport.local import LocalRing
from distributed.worker import StageWorker


def in_process_pipeline(path, split):
    num_layers = sum(split)
    ranges = layer_ranges(num_layers, len(split), list(split))
    stages = [load_stage(path, s, e, i == 0) for i, (s, e) in enumerate(ranges)]
    workers = [StageWorker(st, i + 1, len(stages)).handle for i, st in enumerate(stages[1:])]
    return Pipeline(stages[0], LocalRing(workers) if workers else None), stages
