"""Building an in-process pipeline from a checkpoint, as --stages N does."""

from distributed.runtime.pipeline import in_process_pipeline as pipeline_of
from distributed.shard.loader import load_stage
from distributed.shard.plan import layer_ranges


def in_process_pipeline(path, split, config=None, memory_limit=None):
    """(pipeline, stages) for `split` layers per stage (`config`: in place of the checkpoint's;
    `memory_limit`: what every stage's memory guard checks its frames against)."""
    ranges = layer_ranges(sum(split), len(split), list(split))
    stages = [load_stage(path, s, e, i == 0, config) for i, (s, e) in enumerate(ranges)]
    return pipeline_of(stages, memory_limit), stages


def generate(pipeline, path, prompt, max_tokens, prefill_step_size=512, **sampling):
    """(token, logprob) pairs for one request, through the real scheduler on this thread."""
    from mlx_lm.utils import load_tokenizer

    from distributed.runtime.request import GenerationRequest, TokenEvent
    from distributed.runtime.scheduler import Scheduler

    scheduler = Scheduler(pipeline, load_tokenizer(path), prefill_step_size=prefill_step_size)
    handle = scheduler.submit(GenerationRequest(list(prompt), max_tokens=max_tokens, **sampling))
    scheduler.run_pending()
    assert scheduler.failure is None, scheduler.failure
    return [(e.token_id, e.logprob) for e in handle.events() if isinstance(e, TokenEvent)]
