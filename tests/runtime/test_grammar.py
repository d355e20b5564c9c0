"""Constrained decoding (grammar.py through the Batcher): each constrained row keeps to its
grammar and equals mlx-lm's generate_step masked by llguidance directly (a reference that
does not use grammar.py: reference.mlx_lm_masked_greedy), beside unconstrained rows that stay as they are; with speculative
decoding too; max_tokens before the JSON closes; grammars the library rejects."""

import json
import re

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_tokenizer

from distributed.runtime.grammar import json_schema_grammar, lark_grammar, regex_grammar
from distributed.runtime.request import GenerationRequest, RequestError, TokenEvent
from distributed.runtime.scheduler import Scheduler
from distributed.runtime.speculation import SpeculationOptions
from reference import PROMPT, mlx_lm_greedy, mlx_lm_masked_greedy, mlx_lm_model
from stages import in_process_pipeline

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def pipeline(hf_checkpoint):
    return in_process_pipeline(hf_checkpoint, (4, 4))[0]


def run(pipeline, path, requests, speculation=None, drafter=None):
    scheduler = Scheduler(pipeline, load_tokenizer(path), prefill_step_size=16, speculation=speculation)
    if drafter is not None:
        scheduler.batcher.verifier.drafter = drafter
    handles = [scheduler.submit(r) for r in requests]
    scheduler.run_pending()
    assert scheduler.failure is None, scheduler.failure
    out = []
    for handle in handles:
        events = list(handle.events())
        out.append(([e.token_id for e in events if isinstance(e, TokenEvent)], events[-1]))
    return out, scheduler


def test_constrained_rows_keep_to_their_grammar_beside_rows_that_do_not(pipeline, hf_checkpoint):
    grammar = json_schema_grammar(SCHEMA)
    reference = mlx_lm_masked_greedy(hf_checkpoint, PROMPT, grammar, 80)
    plain = mlx_lm_greedy(hf_checkpoint, PROMPT, 40, 16)[0]
    requests = [GenerationRequest(list(PROMPT), max_tokens=80, grammar=grammar),
                GenerationRequest(list(PROMPT), max_tokens=40),
                GenerationRequest(list(PROMPT), max_tokens=80, grammar=grammar)]
    (a, fa), (b, _), (c, _) = run(pipeline, hf_checkpoint, requests)[0]
    tokenizer = load_tokenizer(hf_checkpoint)
    assert a == c == reference and fa.finish_reason == "stop"  # the grammar closed, then EOS
    jsonschema.validate(json.loads(tokenizer.decode(a)), SCHEMA)
    assert b == plain  # the unconstrained row beside them: as on its own


def test_sampled_rows_keep_to_lark_and_regex_grammars(pipeline, hf_checkpoint):
    tokenizer = load_tokenizer(hf_checkpoint)
    lark = lark_grammar('start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]{1,3}/')
    regex = regex_grammar(r"[a-c]{2,5}-[0-9]{2}")
    requests = [GenerationRequest(list(PROMPT), max_tokens=20, temperature=1.5, seed=s, grammar=g)
                for s in range(4) for g in (lark, regex)]
    outs, _ = run(pipeline, hf_checkpoint, requests)
    for k, (tokens, finish) in enumerate(outs):
        text = tokenizer.decode(tokens)
        pattern = r"yes|no|maybe [0-9]{1,3}" if k % 2 == 0 else r"[a-c]{2,5}-[0-9]{2}"
        assert re.fullmatch(pattern, text), text
        assert finish.finish_reason == "stop"


class Drafter:
    """Drafts the reference continuation, a wrong token in every second pass; half the
    wrong ones are tokens the grammar forbids (a letter where JSON needs a quote)."""

    def __init__(self, reference, forbidden):
        self.reference, self.forbidden, self.passes = reference, forbidden, 0

    def propose(self, seq, k, after=()):
        at = len(seq.generated) + len(after)
        drafts = list(self.reference[at:at + k])
        self.passes += 1
        if self.passes % 2 and drafts:
            drafts[-1] = self.forbidden if self.passes % 4 == 1 else (drafts[-1] + 1) % 250
        return drafts


def test_speculation_checks_drafts_against_the_grammar(pipeline, hf_checkpoint):
    grammar = json_schema_grammar(SCHEMA)
    reference = mlx_lm_masked_greedy(hf_checkpoint, PROMPT, grammar, 80)
    forbidden = load_tokenizer(hf_checkpoint).encode("z", add_special_tokens=False)[0]
    drafter = Drafter(reference, forbidden)
    spec = SpeculationOptions(prompt_lookup=True, num_draft_tokens=3, measured=False)
    [(tokens, finish)], scheduler = run(pipeline, hf_checkpoint, [GenerationRequest(list(PROMPT), max_tokens=80,
                                                                                    grammar=grammar)], spec, drafter)
    assert tokens == reference and finish.finish_reason == "stop"
    stats = scheduler.batcher.verifier.stats
    assert stats.passes > 0 and 0 < stats.accepted < stats.drafted


def test_max_tokens_before_the_json_closes_is_length(pipeline, hf_checkpoint):
    grammar = json_schema_grammar(SCHEMA)
    reference = mlx_lm_masked_greedy(hf_checkpoint, PROMPT, grammar, 80)
    [(tokens, finish)], _ = run(pipeline, hf_checkpoint, [GenerationRequest(list(PROMPT), max_tokens=5, grammar=grammar)])
    assert tokens == reference[:5] and finish.finish_reason == "length"


@pytest.mark.parametrize("grammar, message", [
    (json_schema_grammar({"type": "object", "properties": {"a": {"type": "wat"}}}), "Invalid type: wat"),
    (lark_grammar("start: undefined_rule"), "undefined_rule"),
    (regex_grammar("(unclosed"), "grammar"),
])
def test_a_grammar_the_library_rejects_is_refused_at_submit(pipeline, hf_checkpoint, grammar, message):
    scheduler = Scheduler(pipeline, load_tokenizer(hf_checkpoint))
    with pytest.raises(RequestError, match=message) as e:
        scheduler.submit(GenerationRequest(list(PROMPT), max_tokens=5, grammar=grammar))
    assert e.value.field == "grammar"


def test_a_token_the_matcher_refuses_ends_only_its_sequence(hf_checkpoint):
    """A token the grammar does not allow (only a bug could sample one) sets the error the
    sequence ends with, instead of raising in the scheduler's loop."""
    from distributed.runtime.grammar import Grammars, prepare_masks

    tokenizer = load_tokenizer(hf_checkpoint)
    constraint = Grammars(tokenizer, mlx_lm_model(hf_checkpoint).args.vocab_size).constraint(regex_grammar("ab"))
    a, z = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "az")
    prepare_masks([constraint], [[a]])
    assert constraint.words([a]) is not None and constraint.error is None
    prepare_masks([None, constraint], [[], [a, z]])  # the worker finds it
    assert constraint.words([a, z]) is None and constraint.error.startswith("the grammar cannot go on")
    logits = mx.zeros((1, 8))
    assert mx.array_equal(constraint.mask(logits, [a, z]), logits).item()
    assert constraint.valid_prefix([a, z], [a]) == []


def test_each_request_of_a_grammar_compiled_once_has_a_matcher_of_its_own(hf_checkpoint):
    """A grammar is compiled once (agents send the same tools with every request) and each
    constraint of it gets a copy: one sequence's tokens do not move another's matcher."""
    from distributed.runtime.grammar import Grammars

    tokenizer = load_tokenizer(hf_checkpoint)
    grammars = Grammars(tokenizer, mlx_lm_model(hf_checkpoint).args.vocab_size)
    grammar = regex_grammar("ab|ba")
    a, b = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "ab")

    def allows(words, token):
        return bool((words.view(np.uint32)[token // 32] >> (token % 32)) & 1)

    first, second = grammars.constraint(grammar), grammars.constraint(grammar)
    after_a = first.words([a]).copy()
    after_b = second.words([b])
    assert after_b is not None and second.error is None
    assert allows(after_a, b) and not allows(after_a, a) and allows(after_b, a) and not allows(after_b, b)
    assert np.array_equal(grammars.constraint(grammar).words([a]), after_a)


def test_masks_prepared_for_a_group_equal_masks_made_row_by_row(hf_checkpoint):
    """prepare_masks' one array for a group (rows without a grammar allow everything) is
    what each row's own mask is; apply_masks takes it as it is when the rows line up and
    gathers the rows' masks when they do not (another order, a row whose tokens moved on)."""
    from distributed.runtime.grammar import Grammars, apply_masks, prepare_masks

    tokenizer = load_tokenizer(hf_checkpoint)
    vocab = mlx_lm_model(hf_checkpoint).args.vocab_size
    grammars = Grammars(tokenizer, vocab)
    grammar = json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}}})
    tokens = tokenizer.encode('{"n": 12', add_special_tokens=False)
    histories = [tokens[:2], [], tokens[:1], tokens[:3]]

    def fresh():
        return [grammars.constraint(grammar), None, grammars.constraint(grammar), grammars.constraint(grammar)]

    alone = [c.words(h) if c is not None else None for c, h in zip(fresh(), histories)]
    logits = mx.random.normal((4, vocab))

    def masked(row, w):
        if w is None:
            return logits[row]
        return mx.where(mx.array(np.unpackbits(w.view(np.uint8), bitorder="little")[:vocab].astype(bool)), logits[row], -mx.inf)

    expected = mx.stack([masked(i, w) for i, w in enumerate(alone)])
    together = fresh()
    prepare_masks(together, histories)
    job = together[0]._mask[0]
    assert all(c._mask == (job, i) for i, c in enumerate(together) if c is not None)
    assert np.array_equal(job.result()[1], np.full_like(alone[0], -1))
    assert mx.array_equal(apply_masks(together, histories, logits), expected).item()
    # Rows in another order than prepared: each row's own mask still applies.
    order = [3, 1, 0, 2]
    assert mx.array_equal(apply_masks([together[i] for i in order], [histories[i] for i in order], logits[mx.array(order)]),
                          expected[mx.array(order)]).item()
    # A row whose history moved on since: its mask is made for the new history.
    moved = fresh()
    prepare_masks(moved, histories)
    histories[0] = tokens[:3]
    assert mx.array_equal(apply_masks(moved, histories, logits), mx.concatenate([masked(0, alone[3])[None], expected[1:]])).item()


def test_a_scheduler_on_its_own_thread_serves_a_constrained_request(pipeline, hf_checkpoint):
    """MLX streams belong to a thread: what the masks are made of must not be a lazy array
    of the thread that imported the module (the scheduler's loop runs on another)."""
    grammar = json_schema_grammar(SCHEMA)
    reference = mlx_lm_masked_greedy(hf_checkpoint, PROMPT, grammar, 12)
    scheduler = Scheduler(pipeline, load_tokenizer(hf_checkpoint), prefill_step_size=16).start()
    try:
        events = list(scheduler.submit(GenerationRequest(list(PROMPT), max_tokens=12, grammar=grammar)).events())
    finally:
        scheduler.close()
    assert events[-1].error is None and [e.token_id for e in events if isinstance(e, TokenEvent)] == reference
