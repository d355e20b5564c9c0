"""Our runner against HF transformers' AfmoeForCausalLM (fixture made by
tests/fixtures/make_hf_reference.py; no torch needed here)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import run_json
from distributed.shard.plan import even_split
from distributed.shard.tiny_checkpoint import _hf_weights, tiny_config, weights_fingerprint
from distributed.transport import Reply
from stages import in_process_pipeline

REFERENCE = json.loads((Path(__file__).parent / "fixtures" / "hf_reference.json").read_text())
TOL = 1e-4


def test_fixture_matches_the_weights_the_maker_makes_now():
    assert REFERENCE["weights_fingerprint"] == weights_fingerprint(_hf_weights(tiny_config(), 0)), (
        "distributed/tiny_checkpoint.py changed its weights: regenerate the fixture with "
        "python tests/fixtures/make_hf_reference.py"
    )


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_prompt_logprobs_match_hf(hf_checkpoint, stages):
    pipeline, _ = in_process_pipeline(hf_checkpoint, even_split(tiny_config()["num_hidden_layers"], stages))
    pipeline.release()
    tokens = mx.array([REFERENCE["prompt_token_ids"]], dtype=mx.uint32)
    logits = pipeline.logits(tokens, Reply.ALL)[0].astype(mx.float32)
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    expected = np.array(REFERENCE["prompt_logprobs"])
    assert logprobs.shape == expected.shape
    diff = np.abs(logprobs - expected).max()
    assert diff < TOL, f"{stages} stage(s): max |log p - HF| = {diff:.3g}"


def test_two_ranks_greedy_matches_hf(hf_checkpoint):
    result = run_json(
        [
            "--model", str(hf_checkpoint),
            "--prompt-ids", ",".join(map(str, REFERENCE["prompt_token_ids"])),
            "--max-tokens", str(len(REFERENCE["greedy_token_ids"])),
        ],
        ranks=2,
    )
    assert result["finish_reason"] == "length"
    assert result["token_ids"] == REFERENCE["greedy_token_ids"]
    diff = np.abs(np.array(result["logprobs"]) - np.array(REFERENCE["greedy_logprobs"])).max()
    assert diff < TOL, f"max |logprob - HF| over greedy tokens = {diff:.3g}"
