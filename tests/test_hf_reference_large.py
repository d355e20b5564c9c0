"""Trinity-Large's layer structure at toy width (large_structure_config: 60 layers, 6 dense,
256 experts top-4 plus a shared one, 6:1 query:KV heads, window 12) against HF transformers'
AfmoeForCausalLM, in both checkpoint layouts (fixture made by
tests/fixtures/make_hf_reference.py --large; no torch needed here)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import ROOT, run_json
from distributed.shard.plan import even_split
from distributed.shard.tiny_checkpoint import _hf_weights, large_structure_config, make_checkpoint, weights_fingerprint
from distributed.transport import Reply
from stages import generate, in_process_pipeline

REFERENCE = json.loads((Path(__file__).parent / "fixtures" / "hf_reference_large.json").read_text())
LARGE_PRESET = json.loads((ROOT / "launch" / "configs" / "presets" / "trinity-large.json").read_text())["config"]
CONFIG = large_structure_config()
TOL = 1e-4
# Greedy decoding is prefix-stable: the first 14 of HF's 24 tokens cycle the window of 12
# once more while decoding, at 60% of the cost (decode dominates these tests).
GREEDY = len(REFERENCE["greedy_token_ids"][:14])


@pytest.fixture(scope="module")
def checkpoint_of(tmp_path_factory):
    """layout -> checkpoint, each made once: HF layout (per-expert keys) or mlx-community's
    (stacked experts), both float32."""
    made = {}

    def make(layout):
        if layout not in made:
            path = tmp_path_factory.mktemp(f"large_{layout}")
            made[layout] = make_checkpoint(path, layout, seed=0, layers_per_file=10, config=CONFIG, quantize=False)
        return made[layout]

    return make


def test_the_toy_has_large_layer_structure_and_wraps_its_window():
    structure = ("num_hidden_layers", "num_dense_layers", "num_experts", "num_experts_per_tok", "num_shared_experts",
                 "layer_types", "global_attn_every_n_layers", "route_scale", "n_group", "topk_group", "mup_enabled",
                 "tie_word_embeddings")
    assert {k: CONFIG[k] for k in structure} == {k: LARGE_PRESET[k] for k in structure}
    ratio = LARGE_PRESET["num_attention_heads"] // LARGE_PRESET["num_key_value_heads"]
    assert CONFIG["num_attention_heads"] == ratio * CONFIG["num_key_value_heads"]
    # The rotating caches wrap in the prompt and cycle again while decoding.
    assert CONFIG["sliding_window"] < min(len(REFERENCE["prompt_token_ids"]), GREEDY)


def test_fixture_matches_the_weights_the_maker_makes_now():
    assert REFERENCE["weights_fingerprint"] == weights_fingerprint(_hf_weights(CONFIG, 0)), (
        "distributed/shard/tiny_checkpoint.py changed its weights: regenerate the fixture with "
        "python tests/fixtures/make_hf_reference.py --large"
    )


def assert_greedy_matches_hf(token_logprobs, where):
    tokens = [t for t, _ in token_logprobs]
    assert tokens == REFERENCE["greedy_token_ids"][:GREEDY], where
    diff = np.abs(np.array([lp for _, lp in token_logprobs]) - np.array(REFERENCE["greedy_logprobs"][:GREEDY])).max()
    assert diff < TOL, f"{where}: max |logprob - HF| over greedy tokens = {diff:.3g}"


@pytest.mark.parametrize("layout", ["hf", "mlx"])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_in_process_stages_match_hf(checkpoint_of, layout, stages):
    checkpoint = checkpoint_of(layout)
    pipeline, _ = in_process_pipeline(checkpoint, even_split(CONFIG["num_hidden_layers"], stages))
    tokens = mx.array([REFERENCE["prompt_token_ids"]], dtype=mx.uint32)
    logits = pipeline.logits(tokens, Reply.ALL)[0].astype(mx.float32)
    pipeline.release()
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    expected = np.array(REFERENCE["prompt_logprobs"])
    assert logprobs.shape == expected.shape
    diff = np.abs(logprobs - expected).max()
    where = f"{layout} layout, {stages} stage(s)"
    assert diff < TOL, f"{where}: max |prompt log p - HF| = {diff:.3g}"
    # Both layouts load into the same stacked arrays, which the prompt logprobs above hold at
    # every count; decoding is checked once per count: here 1 and 2, the ring below 4 (HF layout).
    if layout == "mlx" and stages < 4:
        greedy = generate(pipeline, checkpoint, REFERENCE["prompt_token_ids"], GREEDY)
        assert_greedy_matches_hf(greedy, where)


def test_four_rank_ring_greedy_matches_hf(checkpoint_of):
    """One ring (they cost seconds to start; test_hf_reference's tiny ring has 2 ranks): each
    rank loads only the files of its own layers' per-expert keys."""
    ranks = 4
    result = run_json(
        [
            "--model", str(checkpoint_of("hf")),
            "--prompt-ids", ",".join(map(str, REFERENCE["prompt_token_ids"])),
            "--max-tokens", str(GREEDY),
        ],
        ranks=ranks,
    )
    assert result["finish_reason"] == "length"
    layers = [r["layers"] for r in result["ranks"]]
    assert len(layers) == ranks and layers[0][0] == 0 and layers[-1][1] == CONFIG["num_hidden_layers"]
    assert all(a[1] == b[0] for a, b in zip(layers, layers[1:])), layers
    assert_greedy_matches_hf(list(zip(result["token_ids"], result["logprobs"])), f"HF layout, {ranks} ranks")
