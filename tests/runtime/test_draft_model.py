"""Speculative decoding with a draft model (draft_model.py): the target's own layers as
its draft, all of them (every draft right: its caches follow the history exactly, far
past the window) or the first few (drafts rejected at many offsets); drafts for two
sequences at once with room for one; the bundled draft of the embedded model on held-out
text; a draft whose tokenizer differs is refused."""

import json
import random
import sys
from types import SimpleNamespace

import pytest
from mlx_lm.utils import load_tokenizer

from distributed import TrinityError
from distributed.runtime import draft_model
from distributed.runtime.draft_model import ROLLBACK, ModelDrafter
from distributed.runtime.request import GenerationRequest, TokenEvent
from distributed.runtime.scheduler import Scheduler
from distributed.runtime.speculation import SpeculationOptions
from distributed.shard.draft import load_draft
from distributed.shard.loader import load_stage
from distributed.shard.tiny_checkpoint import DEFAULT_MODEL, default_checkpoint
from draft_checkpoint import truncated_draft
from reference import PROMPT, mlx_lm_greedy
from stages import in_process_pipeline

LONG = 120  # tokens: the window (16) wraps many times over
DRAFT = DEFAULT_MODEL.parent / "tiny_draft"


@pytest.fixture(scope="module")
def pipeline(hf_checkpoint):
    return in_process_pipeline(hf_checkpoint, (4, 4))[0]


@pytest.fixture(scope="module")
def reference(hf_checkpoint):
    return mlx_lm_greedy(hf_checkpoint, PROMPT, LONG, 16)


def draft_of(checkpoint, tmp_path, layers):
    return load_stage(truncated_draft(checkpoint, tmp_path / f"draft{layers}", layers), 0, layers, True)


def run(pipeline, path, draft, prompts=(PROMPT,), k=4, **fields):
    scheduler = Scheduler(pipeline, load_tokenizer(path), prefill_step_size=16,
                          speculation=SpeculationOptions(draft=draft, num_draft_tokens=k, measured=False))
    handles = [scheduler.submit(GenerationRequest(list(p), **fields)) for p in prompts]
    scheduler.run_pending()
    assert scheduler.failure is None, scheduler.failure
    outs = [[e for e in h.events() if isinstance(e, TokenEvent)] for h in handles]
    return outs, scheduler.batcher


def test_the_targets_own_layers_draft_its_every_token_far_past_the_window(pipeline, hf_checkpoint, reference,
                                                                           tmp_path):
    [tokens], batcher = run(pipeline, hf_checkpoint, draft_of(hf_checkpoint, tmp_path, 8), max_tokens=LONG)
    assert [e.token_id for e in tokens] == reference[0]
    assert max(abs(e.logprob - r) for e, r in zip(tokens, reference[1])) < 1e-4
    stats = batcher.verifier.stats
    # Every draft held: the draft's caches were brought to each new history exactly.
    assert stats.accepted == stats.drafted > LONG // 2 and stats.passes < LONG // 3, stats


def test_a_draft_of_the_first_layers_is_rejected_and_changes_nothing(pipeline, hf_checkpoint, reference, tmp_path):
    [tokens], batcher = run(pipeline, hf_checkpoint, draft_of(hf_checkpoint, tmp_path, 4), max_tokens=LONG,
                            repetition_penalty=1.2, top_logprobs=2)
    plain, _ = run(pipeline, hf_checkpoint, None, max_tokens=LONG, repetition_penalty=1.2, top_logprobs=2)
    assert [e.token_id for e in tokens] == [e.token_id for e in plain[0]]
    assert [e.top_logprobs[0][0] for e in tokens] == [e.top_logprobs[0][0] for e in plain[0]]
    stats = batcher.verifier.stats
    assert 0 < stats.accepted < stats.drafted, stats


def test_a_draft_whose_rope_cannot_be_compiled_steps_uncompiled(hf_checkpoint, tmp_path):
    """mlx-lm's dynamic NTK RoPE reads its offset on the host, which mx.compile cannot trace:
    that draft steps uncompiled, and proposes as the same draft fed afresh."""
    path = truncated_draft(hf_checkpoint, tmp_path / "dynamic", 4)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {**config.get("rope_parameters", {}), "rope_type": "dynamic", "factor": 2.0}
    (path / "config.json").write_text(json.dumps(config))
    draft = load_stage(path, 0, 4, True)
    drafter = ModelDrafter(draft)
    assert drafter._step == drafter._forward  # the compiled step could not be traced
    seq = Sequence(request=SimpleNamespace(prompt_ids=list(PROMPT)), generated=[])
    for token in (5, 9, 17):
        drafts = drafter.propose(seq, 3)
        assert drafts == ModelDrafter(draft).propose(seq, 3)
        seq.generated += drafts[:1] + [token]


class Sequence(SimpleNamespace):
    __hash__ = object.__hash__  # the drafter keeps its buffers by sequence


def test_drafts_taken_back_at_every_offset_leave_the_draft_as_one_fed_afresh(hf_checkpoint, tmp_path, monkeypatch):
    """Passes that accept 0..k drafts and frames ahead taken back (up to ROLLBACK positions,
    then beyond it), past the sliding window many times and past a full-attention layer's
    first buffers (32 slots here, doubled thrice): each proposal equals a fresh draft's, fed
    the whole history at once."""
    monkeypatch.setattr(draft_model, "FULL_SLOTS", 32)
    draft = draft_of(hf_checkpoint, tmp_path, 4)  # sliding and full-attention layers
    kept, rng = ModelDrafter(draft), random.Random(0)
    seq = Sequence(request=SimpleNamespace(prompt_ids=list(PROMPT)), generated=[])
    taken_back, sizes = [], set()
    while len(seq.generated) < 150:
        k = rng.randint(1, 8)
        ahead = [rng.randint(1, 250) for _ in range(rng.choice([0, 0, 0, 5, ROLLBACK - 8, ROLLBACK + 10]))]
        drafts, fresh = kept.propose(seq, k, ahead), ModelDrafter(draft)
        assert drafts == fresh.propose(seq, k, ahead)
        for drafter in (kept, fresh):  # full-attention buffers: 32 slots, doubled (few shapes to compile)
            [state] = drafter.states.values()
            sizes.update(b.shape[2] for b, w in zip(state.buffers[::2], drafter.windows) if w is None)
        taken_back.append(len(ahead) + k - 1)
        held = rng.randint(0, k)
        seq.generated += drafts[:held] + [rng.randint(1, 250)]
    assert max(taken_back) > ROLLBACK and len(taken_back) >= 50
    assert sizes <= {32 * 2 ** i for i in range(6)} and len(sizes) >= 3, sizes


def test_two_sequences_drafted_with_room_for_one_keep_their_own_histories(pipeline, hf_checkpoint, reference,
                                                                           tmp_path):
    other = [(5 * i + 1) % 250 + 1 for i in range(30)]
    scheduler = Scheduler(pipeline, load_tokenizer(hf_checkpoint), prefill_step_size=16, max_batch=2,
                          speculation=SpeculationOptions(draft=draft_of(hf_checkpoint, tmp_path, 8), measured=False))
    drafter = scheduler.batcher.verifier.drafter
    assert isinstance(drafter, ModelDrafter) and drafter.capacity == 2  # one per rank (group)
    drafter.capacity = 1  # each pass then evicts the other sequence's draft caches
    handles = [scheduler.submit(GenerationRequest(list(p), max_tokens=60)) for p in (PROMPT, other)]
    scheduler.run_pending()
    outs = [[e.token_id for e in h.events() if isinstance(e, TokenEvent)] for h in handles]
    assert outs[0] == reference[0][:60]
    assert outs[1] == mlx_lm_greedy(hf_checkpoint, other, 60, 16)[0]
    assert len(drafter.states) == 1


def test_the_bundled_draft_predicts_the_embedded_model_on_held_out_text():
    sys.path.insert(0, str(DEFAULT_MODEL.parents[2] / "scripts"))
    from train_tiny_model import corpus  # the paragraphs training held out (every tenth)

    path = default_checkpoint()
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.encode([p for p in corpus()[1].split("\n\n") if len(p) > 300][1][:200])
    pipeline = in_process_pipeline(path, (3, 3))[0]
    draft = load_draft(str(DRAFT), tokenizer)
    plain, _ = run(pipeline, path, None, [prompt], max_tokens=150)
    [tokens], batcher = run(pipeline, path, draft, [prompt], max_tokens=150)
    assert [e.token_id for e in tokens] == [e.token_id for e in plain[0]]
    stats = batcher.verifier.stats
    # Real acceptance on real text (a draft that knew nothing of the model would match
    # about one token in 2,048): this draft proposes the model's own next token 38% of the
    # time over the first 12 held-out paragraphs, 12 of 45 drafts here.
    assert stats.accepted >= 0.2 * stats.drafted and stats.accepted >= 10, stats


def test_a_draft_with_another_tokenizer_is_refused(hf_checkpoint):
    with pytest.raises(TrinityError, match="tokenizer is not the model's"):
        load_draft(str(DRAFT), load_tokenizer(hf_checkpoint))
