"""In-process pipelines (every split) equal one-device mlx-lm on the same weights.

Each rank's RankStats through a real in-process pipeline
(--stages N): every forward frame is counted on every rank; KV cache bytes follow
the slots, prefix-cache bytes the entries; rank 0 sees every rank's report. (The
time of each rank in its own process: tests/serving/test_metrics.py.)"""

import mlx.core as mx
import pytest

from distributed.transport import Reply
from reference import PROMPT, mlx_lm_greedy, mlx_lm_logprobs
from stages import generate, in_process_pipeline

# 8 layers: S S S F S S S F. "3,1,4": a stage with no full-attention layer and
# one with no sliding layer.
SPLITS = [(8,), (4, 4), (3, 5), (3, 1, 4), (2, 3, 3), (3, 1, 3, 1), (1, 2, 4, 1)]


@pytest.mark.parametrize("split", SPLITS)
def test_prompt_logprobs_equal_mlx_lm(hf_checkpoint, split):
    pipeline, _ = in_process_pipeline(hf_checkpoint, split)
    pipeline.release()
    logits = pipeline.logits(mx.array(PROMPT)[None], Reply.ALL)[0]
    ours = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ref = mlx_lm_logprobs(hf_checkpoint, PROMPT)
    assert ours.shape == ref.shape == (len(PROMPT), 259)
    assert mx.abs(ours - ref).max().item() < 1e-5


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("step", [8, 2048])
def test_greedy_generation_equals_mlx_lm(hf_checkpoint, split, step):
    ref_tokens, ref_logprobs = mlx_lm_greedy(hf_checkpoint, PROMPT, 64, step)
    assert len(ref_tokens) == 64, "the reference stopped early; pick another prompt"
    pipeline, _ = in_process_pipeline(hf_checkpoint, split)
    out = generate(pipeline, hf_checkpoint, PROMPT, 64, prefill_step_size=step)
    assert [t for t, _ in out] == ref_tokens
    assert max(abs(a - b) for (_, a), b in zip(out, ref_logprobs)) < 1e-5


@pytest.mark.parametrize("split", [(8,), (3, 5), (3, 1, 4)])
def test_quantized_mlx_layout_equals_mlx_lm(mlx_checkpoint, split):
    pipeline, _ = in_process_pipeline(mlx_checkpoint, split)
    pipeline.release()
    logits = pipeline.logits(mx.array(PROMPT)[None], Reply.ALL)[0]
    ours = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert mx.abs(ours - mlx_lm_logprobs(mlx_checkpoint, PROMPT)).max().item() < 1e-5
    pipeline.release()
    ref_tokens, _ = mlx_lm_greedy(mlx_checkpoint, PROMPT, 32, 8)
    out = [t for t, _ in generate(pipeline, mlx_checkpoint, PROMPT, len(ref_tokens), prefill_step_size=8)]
    assert out == ref_tokens


def test_tied_embeddings(tmp_path):
    from distributed.shard.tiny_checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path, tie_word_embeddings=True, seed=3)
    pipeline, stages = in_process_pipeline(path, (5, 3))
    assert "lm_head" not in stages[0]
    pipeline.release()
    logits = pipeline.logits(mx.array(PROMPT)[None], Reply.ALL)[0]
    ours = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert mx.abs(ours - mlx_lm_logprobs(path, PROMPT)).max().item() < 1e-5


def test_sampling_with_seed_is_reproducible_and_split_independent(hf_checkpoint):
    def sample(split, **kw):
        pipeline, _ = in_process_pipeline(hf_checkpoint, split)
        return [t for t, _ in generate(pipeline, hf_checkpoint, PROMPT, 24, **kw)]

    sampling = dict(temperature=0.9, top_p=0.95, min_p=0.01, top_k=50, seed=7)
    first = sample((8,), **sampling)
    assert first == sample((8,), **sampling) == sample((3, 1, 4), **sampling)
    assert first != sample((8,))  # greedy
    assert first != sample((8,), **{**sampling, "seed": 8})


def test_every_rank_counts_every_frame_and_its_caches(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (3, 1, 4))
    reports = pipeline.rank_reports()
    assert sorted(reports) == [0, 1, 2]
    assert all(r["forward_frames"] == 0 and r["kv_cache_bytes"] == 0 for r in reports.values())

    mx.eval(pipeline.forward(mx.array(PROMPT)[None], Reply.LAST, slot=7))  # one frame through every rank
    reports = pipeline.rank_reports()
    assert {r["forward_frames"] for r in reports.values()} == {1}
    assert all(r["kv_cache_bytes"] > 0 for r in reports.values()), reports

    pipeline.snapshot(7, [(3, 0)])  # a prefix-cache entry: every rank keeps its slice
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
