"""Each rank's RankStats (runtime/rank_stats.py) through a real in-process pipeline
(--stages N): every forward frame is counted on every rank; KV cache bytes follow
the slots, prefix-cache bytes the entries; rank 0 sees every rank's report. (The
time of each rank in its own process: tests/serving/test_metrics.py.)"""

import mlx.core as mx

from distributed.transport import Reply
from reference import PROMPT
from stages import generate, in_process_pipeline


def test_every_rank_counts_every_frame_and_its_caches(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (3, 1, 4))
    reports = pipeline.rank_reports()
    assert sorted(reports) == [0, 1, 2]
    assert all(r["forward_frames"] == 0 and r["kv_cache_bytes"] == 0 for r in reports.values())

    mx.eval(pipeline.forward(mx.array(PROMPT)[None], Reply.LAST, slot=7))  # one frame through every rank
    reports = pipeline.rank_reports()
    assert {r["forward_frames"] for r in reports.values()} == {1}
    assert all(r["kv_cache_bytes"] > 0 for r in reports.values()), reports

    pipeline.snapshot(7, entry=3)  # a prefix-cache entry: every rank keeps its slice
    pipeline.release(7)
    reports = pipeline.rank_reports()
    assert all(r["kv_cache_bytes"] == 0 and r["prefix_cache_bytes"] > 0 for r in reports.values()), reports
    pipeline.evict([3])
    assert all(r["prefix_cache_bytes"] == 0 for r in pipeline.rank_reports().values())


def test_a_generation_is_counted_and_timed(hf_checkpoint):
    """6 tokens from a prompt that fits one chunk: the prompt but its last token (one frame),
    its last token (the first token's frame), then 5 decode steps: none after the 6th token
    (the lookahead sends no step that max_tokens makes useless). In one process the stages'
    layers are computed within rank 0's waits."""
    pipeline, _ = in_process_pipeline(hf_checkpoint, (4, 4))
    out = generate(pipeline, hf_checkpoint, PROMPT, 6)
    reports = pipeline.rank_reports()
    assert len(out) == 6
    assert reports[0]["forward_frames"] == reports[1]["forward_frames"] == 1 + 1 + 5, reports
    assert reports[0]["forward_seconds"] > 0 and reports[0]["peak_memory_bytes"] > 0
