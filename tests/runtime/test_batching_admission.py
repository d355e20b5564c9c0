"""Batched admission: prompts admitted together prefill in one batch, then take their first tokens in
the decode groups' next steps, and each request still gets exactly what it gets alone."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

from distributed.runtime import scheduler as scheduler_module
from distributed.runtime.prefix_cache import PrefixHooks
from distributed.runtime.caches import SlotCaches, is_batch
from distributed.runtime.request import FinishEvent, GenerationRequest
from distributed.transport import Op, Reply
from prefill_frames import (EOS_FIRST, PROMPTS, STEP, FrameLog, admitted_together, assert_alone,
                            assert_no_caches_left, run_admitted, scheduler_for, tokens_of)
from reference import mlx_lm_greedy

@pytest.mark.parametrize("split", [(8,), (4, 4), (3, 1, 4)])
def test_prompts_admitted_together_prefill_in_one_batch_and_stay_exact(hf_checkpoint, split):
    scheduler = scheduler_for(hf_checkpoint, split)
    log = FrameLog(scheduler)
    results = run_admitted(scheduler, [GenerationRequest(p, max_tokens=20) for p in PROMPTS])
    for prompt, events in zip(PROMPTS, results):
        assert_alone(hf_checkpoint, prompt, events, 20)
    assert log.batch_rows() == [len(PROMPTS)]
    assert not [s for s in log.prefill() if s.reply == Reply.LAST], "no frame of last prompt tokens alone"
    # The rows join the groups, evenly, and their first steps give their first tokens.
    assert log.first_rows() == [len(PROMPTS) // len(split)] * len(split)
    ops = [o.op for o in log.ops]
    assert ops[:4] == [Op.MERGE, Op.PREPARE, Op.FINALIZE, Op.JOIN]
    chunks = [s.shape for s in log.prefill() if s.reply == Reply.ACK]
    # Right-padded to the longest (69 tokens before its last) in 2-column chunks (6 rows x 2 <= 16),
    # plus one column of padding: a chunk of one column would be taken for a decode step.
    assert all(cols == 2 for _, cols in chunks) and sum(cols for _, cols in chunks) == 70
    assert all(rows * cols <= STEP for rows, cols in chunks), "a frame over the token budget"
    # Nothing decodes yet: chunks follow each other along the ring, one per rank.
    in_ring = [len(s.in_ring) for s in log.prefill() if not s.decoding]
    assert max(in_ring) == len(split) - 1
    # Then the rows join the decode groups at once, evenly.
    steps = [s.shape[0] for s in log.sends if s.slot < len(split)]
    assert steps[:len(split)] == [len(PROMPTS) // len(split)] * len(split)
    assert_no_caches_left(scheduler.pipeline)


def test_a_burst_still_arriving_prefills_as_one_batch(hf_checkpoint, monkeypatch):
    """The loop woken by a burst's first request waits for the requests front ends are still
    building (Scheduler.arriving, each on its own thread until it submits) before the batch's
    first frame: the burst prefills together."""
    monkeypatch.setattr(scheduler_module, "GATHER_S", 600.0)  # the wait ends when they have come
    scheduler = scheduler_for(hf_checkpoint, (8,))
    log = FrameLog(scheduler)
    building, release = threading.Barrier(len(PROMPTS)), threading.Event()

    def front_end(prompt):  # one of the burst's other requests, built on a thread of its own
        with scheduler.arriving():
            building.wait(30)
            release.wait(30)
            return scheduler.submit(GenerationRequest(prompt, max_tokens=6))

    scheduler.start()
    try:
        with ThreadPoolExecutor(len(PROMPTS) - 1) as pool:
            rest = [pool.submit(front_end, p) for p in PROMPTS[1:]]
            building.wait(30)
            handles = [scheduler.submit(GenerationRequest(PROMPTS[0], max_tokens=6))]
            while scheduler.waiting:  # the loop took the first: without the wait it would prefill it alone
                time.sleep(0.001)
            release.set()
            handles += [f.result() for f in rest]
        results = [list(h.events()) for h in handles]
    finally:
        scheduler.close()
    for prompt, events in zip(PROMPTS, results):
        assert_alone(hf_checkpoint, prompt, events, 6)
    assert log.batch_rows() == [len(PROMPTS)]
    assert_no_caches_left(scheduler.pipeline)


def test_batch_token_budget_splits_in_arrival_order(hf_checkpoint):
    scheduler = scheduler_for(hf_checkpoint, (3, 5), prefill_batch_tokens=100)
    log = FrameLog(scheduler)
    results = run_admitted(scheduler, [GenerationRequest(p, max_tokens=6) for p in PROMPTS])
    for prompt, events in zip(PROMPTS, results):
        assert_alone(hf_checkpoint, prompt, events, 6)
    # Padded sizes within 100 tokens, in arrival order: 5+17 (2x17), 40, 70, 9+33 (2x33).
    assert log.batch_rows() == [2, 1, 1, 2]
    assert sum(log.first_rows()) == len(PROMPTS)
    # Each batch's rows take their first tokens before the next batch's chunks go.
    assert log.order()[1::2] == ["first"] * 4, log.order()
    assert_no_caches_left(scheduler.pipeline)


def test_arrival_during_a_batch_waits_for_the_next(hf_checkpoint):
    late = []

    def submit_late(slot, shape, reply):  # once the first batch is in the ring
        if not late:
            late.append(scheduler.submit(GenerationRequest(PROMPTS[0], max_tokens=6)))

    scheduler = scheduler_for(hf_checkpoint, (3, 5))
    log = FrameLog(scheduler, submit_late)
    scheduler.start()
    try:
        first = admitted_together(scheduler, [GenerationRequest(PROMPTS[3], max_tokens=6)])[0]
        results = [list(first.events())] + [list(h.events()) for h in late]  # late: sent while first ran
    finally:
        scheduler.close()
    assert log.batch_rows() == [1, 1]
    for prompt, events in zip([PROMPTS[3], PROMPTS[0]], results):
        assert_alone(hf_checkpoint, prompt, events, 6)


@pytest.mark.parametrize("split", [(8,), (4, 4)])
def test_a_prompt_arriving_while_others_decode_takes_its_first_token_in_their_step(hf_checkpoint, split):
    late = []

    def submit_late(slot, shape, reply):  # once the first requests decode
        if slot < len(split) and not late:
            late.append(scheduler.submit(GenerationRequest(PROMPTS[2], max_tokens=8)))

    scheduler = scheduler_for(hf_checkpoint, split)
    log = FrameLog(scheduler, submit_late)
    scheduler.start()
    try:
        running = PROMPTS[3:3 + len(split)]  # one per decode group
        handles = admitted_together(scheduler, [GenerationRequest(p, max_tokens=24) for p in running])
        results = [list(h.events()) for h in handles]
        results += [list(h.events()) for h in late]  # submitted while those ran
    finally:
        scheduler.close()
    for prompt, events in zip(running + [PROMPTS[2]], results):
        assert_alone(hf_checkpoint, prompt, events, 24 if prompt is not PROMPTS[2] else 8)
    # Its last prompt token went in a decode step of a running row, not in a frame of its own.
    assert log.batch_rows() == [len(split), 1]
    assert (log.first[-1].rows, log.first[-1].fresh) == (2, 1)
    assert_no_caches_left(scheduler.pipeline)


def test_a_prefilled_batch_takes_its_first_tokens_before_the_next_batch_prefills(hf_checkpoint):
    late = []

    def submit_late(slot, shape, reply):  # once the first request decodes: two batches (budget)
        if slot == 0 and not late:
            late.extend(scheduler.submit(GenerationRequest(p, max_tokens=8)) for p in (PROMPTS[2], PROMPTS[5]))

    scheduler = scheduler_for(hf_checkpoint, (8,), prefill_batch_tokens=40)
    log = FrameLog(scheduler, submit_late)
    scheduler.start()
    try:
        first = scheduler.submit(GenerationRequest(PROMPTS[3], max_tokens=40))
        results = [list(first.events())] + [list(h.events()) for h in late]  # late: sent while first ran
    finally:
        scheduler.close()
    for prompt, events, n in zip([PROMPTS[3], PROMPTS[2], PROMPTS[5]], results, [40, 8, 8]):
        assert_alone(hf_checkpoint, prompt, events, n)
    # The second batch's chunks wait until the first batch's rows have joined the running
    # row's group and taken their first token (which a chunk sent first would delay).
    batches = [m for m in log.order() if m != "first"]
    assert len(batches) == 3 and log.order() == [batches[0], "first", batches[1], "first", batches[2], "first"]
    assert log.unserved == [0] * len(log.unserved), log.unserved
    assert_no_caches_left(scheduler.pipeline)


@pytest.mark.parametrize("split", [(8,), (4, 4), (3, 1, 4)])
def test_prompts_arriving_while_others_decode_prefill_inside_their_steps(hf_checkpoint, split):
    """Chunked prefill beside decoding: with several ranks each chunk rides in a running group's
    decode step, in its frame, so the running rows take a token per chunk (with one, each goes
    alone, first); every request stays exact."""
    late = []

    def submit_late(slot, shape, reply):  # once the running requests decode
        if slot < len(split) and not late:
            late.extend(scheduler.submit(GenerationRequest(p, max_tokens=8)) for p in (PROMPTS[3], PROMPTS[2]))

    scheduler = scheduler_for(hf_checkpoint, split)
    log = FrameLog(scheduler, submit_late)
    scheduler.start()
    try:
        running = [PROMPTS[4], PROMPTS[5], PROMPTS[0]][:len(split)]  # one per decode group
        handles = admitted_together(scheduler, [GenerationRequest(p, max_tokens=40) for p in running])
        results = [list(h.events()) for h in handles] + [list(h.events()) for h in late]
    finally:
        scheduler.close()
    for prompt, events, n in zip(running + [PROMPTS[3], PROMPTS[2]], results, [40] * len(split) + [8, 8]):
        assert_alone(hf_checkpoint, prompt, events, n)
    late_slot = log.prefill()[-1].slot
    chunks = [i for i, s in enumerate(log.sends) if s.slot == late_slot]
    # The late pair (69 and 39 tokens before their last) in 2-row chunks of 8 columns: 9 chunks,
    # each logged just before the decode step whose frame carried it.
    assert [log.sends[i].shape for i in chunks] == [(2, 8)] * 8 + [(2, 5)]
    if len(split) == 1:
        assert log.mixed == [] and all(log.sends[i].decoding for i in chunks), "one rank: alone, beside decoding"
    else:
        assert chunks == log.mixed and all(log.sends[i + 1].slot < len(split) for i in chunks)
    assert_no_caches_left(scheduler.pipeline)


def test_a_scored_prompt_arriving_while_two_ranks_decode_goes_in_frames_of_its_own(hf_checkpoint):
    """A prompt whose logprobs are asked for needs every position back: its chunks cannot ride in
    a step, and go beside decoding (not once the running rows are done) in frames of their own."""
    late = []

    def submit_late(slot, shape, reply):  # once the running requests decode
        if slot < 2 and not late:
            late.append(scheduler.submit(GenerationRequest(PROMPTS[2], max_tokens=4, prompt_logprobs=True)))
            submitted.append(len(log.sends) - 1)

    submitted = []
    scheduler = scheduler_for(hf_checkpoint, (4, 4))
    log = FrameLog(scheduler, submit_late)
    scheduler.start()
    try:
        running = [PROMPTS[4], PROMPTS[5]]
        handles = admitted_together(scheduler, [GenerationRequest(p, max_tokens=40) for p in running])
        results = [list(h.events()) for h in handles] + [list(late[0].events())]
    finally:
        scheduler.close()
    for prompt, events, n in zip(running + [PROMPTS[2]], results, [40, 40, 4]):
        assert_alone(hf_checkpoint, prompt, events, n)
    # Its 39 tokens before the last in chunks of 16, right after it came (the two running steps
    # in the ring at once would otherwise leave no room for a frame until they ended).
    scored = [i for i, s in enumerate(log.sends) if s.reply == Reply.ALL]
    assert [log.sends[i].shape for i in scored] == [(1, 16), (1, 16), (1, 7)] and log.mixed == []
    assert all(log.sends[i].decoding for i in scored) and scored[-1] - submitted[0] <= 12, (submitted, scored)
    assert_no_caches_left(scheduler.pipeline)


@pytest.mark.parametrize("split", [(8,), (4, 4)])
def test_one_token_prompts_alone_and_beside_running_rows(hf_checkpoint, split):
    """A batch of one one-token prompt sends no chunk: its row joins a group with fresh caches."""
    one = [PROMPTS[0][2]]
    late = []

    def submit_late(slot, shape, reply):  # once the running request decodes
        if slot < len(split) and not late and running:
            late.append(scheduler.submit(GenerationRequest(one, max_tokens=8)))

    scheduler = scheduler_for(hf_checkpoint, split)
    running = []
    log = FrameLog(scheduler, submit_late)
    scheduler.start()
    try:
        alone = list(scheduler.submit(GenerationRequest(one, max_tokens=8)).events())
        running.append(scheduler.submit(GenerationRequest(PROMPTS[3], max_tokens=24)))
        results = [alone] + [list(h.events()) for h in running]
        results += [list(h.events()) for h in late]  # submitted while that ran
    finally:
        scheduler.close()
    for prompt, events, n in zip([one, PROMPTS[3], one], results, [8, 24, 8]):
        assert_alone(hf_checkpoint, prompt, events, n)
    # The late one shares the running row's group with one rank; with two, it takes the empty one.
    assert (log.first[0].rows, log.first[0].fresh) == (1, 1)
    assert (log.first[-1].rows, log.first[-1].fresh) == ((2, 1) if len(split) == 1 else (1, 1))
    assert_no_caches_left(scheduler.pipeline)


def test_a_one_token_prompt_cancelled_before_it_joins_a_group(hf_checkpoint):
    """Its row waits to join (the group's step is in flight) and is cancelled there: with the
    prefix cache on, the cancel stores nothing from a slot no frame has reached."""
    scheduler = scheduler_for(hf_checkpoint, (8,), prefix_cache_bytes=1 << 30)
    batcher, late = scheduler.batcher, []
    prefilled = batcher._prefilled

    def cancel_while_waiting(batch):  # the late prompt's batch is done: cancel it before it joins
        prefilled(batch)
        if batch.members[0].handle in late:
            late[0].cancel()

    steps = []

    def submit_late(slot, shape, reply):  # at the running request's third step: the group stays busy
        steps.append(slot)
        if steps.count(0) == 3:
            late.append(scheduler.submit(GenerationRequest([PROMPTS[0][2]], max_tokens=8)))

    batcher._prefilled = cancel_while_waiting
    FrameLog(scheduler, submit_late)
    scheduler.start()
    try:
        running = list(scheduler.submit(GenerationRequest(PROMPTS[3], max_tokens=24)).events())
        cancelled = list(late[0].events())  # submitted while `running` decoded
    finally:
        scheduler.close()
    assert_alone(hf_checkpoint, PROMPTS[3], running, 24)
    assert tokens_of(cancelled) == [] and cancelled[-1].finish_reason == "cancelled"
    assert_no_caches_left(scheduler.pipeline)


class Preloaded(PrefixHooks):
    """Stands in for a prefix cache: prefills the first `cut` prompt tokens into the
    sequence's own slot at admission."""

    def __init__(self, pipeline, cuts):
        self.pipeline, self.cuts = pipeline, cuts

    def restore(self, seq, settle=None):
        n = self.cuts[len(seq.unsent)]
        if n:  # the ring is empty: every request is admitted in the same turn, before any frame
            self.pipeline.forward(mx.array(seq.unsent[:n], dtype=mx.uint32)[None], Reply.ACK, seq.slot)
            seq.unsent = seq.unsent[n:]


@pytest.mark.parametrize("split", [(8,), (3, 1, 4)])
def test_prefill_starts_from_histories_of_different_lengths(hf_checkpoint, split):
    # prompt length -> tokens already in the slot: none, short, longer than the window, all but one
    cuts = {5: 0, 17: 3, 40: 20, 70: 33, 9: 0, 33: 32}
    scheduler = scheduler_for(hf_checkpoint, split)
    scheduler.batcher.prefix = Preloaded(scheduler.pipeline, cuts)
    log = FrameLog(scheduler)
    results = run_admitted(scheduler, [GenerationRequest(p, max_tokens=20) for p in PROMPTS])
    for prompt, events in zip(PROMPTS, results):
        assert_alone(hf_checkpoint, prompt, events, 20)
    merged = [o.values for o in log.ops if o.op == Op.MERGE]  # (the restores' frames go first)
    assert [len(m) for m in merged] == [len(PROMPTS)] and sum(log.first_rows()) == len(PROMPTS)
    chunks = [cols for _, (rows, cols), reply, _, _ in log.prefill() if reply == Reply.ACK and rows > 1]
    assert sum(chunks) == max(len(p) - cuts[len(p)] for p in PROMPTS) - 1  # only what is not restored
    assert_no_caches_left(scheduler.pipeline)


def test_cancelled_mid_prefill_leaves_the_batch_exact(hf_checkpoint):
    chunks = []

    def cancel_on_second_chunk(slot, shape, reply):
        if reply == Reply.ACK and slot >= 2:
            chunks.append(slot)
            batches = list(dict.fromkeys(chunks))
            if chunks.count(slot) == 2 and slot == batches[0]:
                handles[3].cancel()  # the longest prompt: its batch is still prefilling
            if chunks.count(slot) == 2 and slot == batches[-1] and len(batches) == 2:
                handles[6].cancel()  # the second batch, of two: both go
                handles[7].cancel()

    scheduler = scheduler_for(hf_checkpoint, (4, 4), max_batch=8)
    log = FrameLog(scheduler, cancel_on_second_chunk)
    scheduler.start()
    try:
        requests = [GenerationRequest(p, max_tokens=12) for p in PROMPTS]
        handles = admitted_together(scheduler, requests)
        handles += admitted_together(scheduler, [GenerationRequest(PROMPTS[3], max_tokens=12)] * 2)
        results = [list(h.events()) for h in handles]
        after = list(scheduler.submit(GenerationRequest(PROMPTS[1], max_tokens=12)).events())
    finally:
        scheduler.close()
    for i in (3, 6, 7):
        assert tokens_of(results[i]) == [] and results[i][-1].finish_reason == "cancelled"
    for i in (0, 1, 2, 4, 5):
        assert_alone(hf_checkpoint, PROMPTS[i], results[i], 12)
    assert_alone(hf_checkpoint, PROMPTS[1], after, 12)
    # The first batch's cancelled row left it before its rows joined the groups; the second
    # batch, all cancelled, was abandoned and never joined; then the later request joined.
    assert log.batch_rows() == [6, 2, 1]
    first_slot = log.sends[0].slot
    dropped = [o.values for o in log.ops if o.op == Op.FILTER and o.slot == first_slot]
    joins = [(o.slot, o.arg) for o in log.ops if o.op == Op.JOIN]
    assert dropped == [[0, 1, 2, 4, 5]] and joins[0][1] == first_slot
    assert sum(log.first_rows()) == 5 + 1
    assert_no_caches_left(scheduler.pipeline)


def test_first_token_endings_in_one_batch(hf_checkpoint):
    """max_tokens=1, EOS as the first token and a stop string, beside a request that runs on."""
    assert mlx_lm_greedy(hf_checkpoint, EOS_FIRST, 4, STEP)[0] == []
    scheduler = scheduler_for(hf_checkpoint, (3, 5))
    scheduler.start()
    try:
        alone = list(scheduler.submit(GenerationRequest(PROMPTS[2], max_tokens=20)).events())
        text = "".join(e.text for e in alone)
        stop = text[6:8]
        requests = [GenerationRequest(PROMPTS[1], max_tokens=1), GenerationRequest(EOS_FIRST, max_tokens=4),
                    GenerationRequest(PROMPTS[2], max_tokens=20, stop=[stop]), GenerationRequest(PROMPTS[3], max_tokens=20)]
        results = [list(h.events()) for h in admitted_together(scheduler, requests)]
    finally:
        scheduler.close()
    one, eos, stopped, runs_on = results
    assert len(tokens_of(one)) == 1 and one[-1].finish_reason == "length"
    assert_alone(hf_checkpoint, PROMPTS[1], one, 1)
    assert tokens_of(eos) == [] and eos[-1].finish_reason == "stop"
    assert stopped[-1].finish_reason == "stop" and "".join(e.text for e in stopped) == text[: text.index(stop)]
    assert_alone(hf_checkpoint, PROMPTS[3], runs_on, 20)
    assert isinstance(runs_on[-1], FinishEvent)
    assert_no_caches_left(scheduler.pipeline)


class Snapshots(PrefixHooks):
    """Checks the snapshot hook's promise: the finished sequence's row still holds
    its prompt and the tokens drawn since (all, or all but the last: the batcher's
    lookahead may have fed the last one already)."""

    def __init__(self, pipeline):
        self.pipeline, self.seen = pipeline, []

    def snapshot(self, rows, slot):
        caches = self.pipeline.caches.slots[slot]
        for seq, row in rows:
            plain = [c.extract(row) for c in caches] if is_batch(caches) else caches
            layer = next(i for i, layer in enumerate(self.pipeline.stage.layers) if not layer.use_sliding)
            full = plain[layer]
            keys = mx.array(full.keys[..., : full.offset, :])
            mx.eval(keys)  # here: the hook runs on the scheduler's thread
            self.seen.append((list(seq.request.prompt_ids) + seq.sampled, len(seq.request.prompt_ids), layer, keys))


def test_snapshot_hook_sees_the_finished_row(hf_checkpoint):
    scheduler = scheduler_for(hf_checkpoint, (4, 4))
    hooks = scheduler.batcher.prefix = Snapshots(scheduler.pipeline)
    run_admitted(scheduler, [GenerationRequest(p, max_tokens=m) for p, m in zip(PROMPTS, [1, 7, 3, 12, 5, 9])])
    assert len(hooks.seen) == len(PROMPTS)
    stage = scheduler.pipeline.stage
    for tokens, prompt, layer, keys in hooks.seen:
        fed = keys.shape[2]
        assert len(tokens) - 1 <= fed <= len(tokens) and fed >= prompt
        # The row's keys are those of its tokens fed alone into fresh caches.
        fresh = SlotCaches(stage).get(0)
        mx.eval(stage(stage.embed(mx.array([tokens[:fed]], dtype=mx.uint32)), fresh))
        assert mx.allclose(keys, fresh[layer].keys[..., :fed, :], atol=1e-4).item()


def test_real_two_rank_server_batches_exactly(hf_checkpoint):
    from grpc_server import SERVER_ARGS, Server, generate

    server = Server(hf_checkpoint, 2, ["--prefill-step-size", str(STEP), "--max-batch", "8", *SERVER_ARGS])
    try:
        server.wait_serving()
        prompts = PROMPTS + [EOS_FIRST]
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: generate(server.stub, token_ids=p, max_tokens=16), prompts))
    finally:
        server.stop()
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = mlx_lm_greedy(hf_checkpoint, prompt, 16, STEP)
        assert out["token_ids"] == ref_tokens
        assert max((abs(a - b) for a, b in zip(out["logprobs"], ref_logprobs)), default=0) < 1e-4


@pytest.mark.parametrize("split", [(8,), (4, 4), (3, 1, 4)])
def test_a_long_prompt_alone_gives_every_stage_chunks(hf_checkpoint, split):
    """A prompt alone in a ring of P stages is cut into CHUNKS_PER_STAGE * P chunks (none under
    MIN_CHUNK), P of them in the ring at once, so every stage computes while the others do; one
    stage keeps prefill_step_size. The tokens equal the prompt alone in mlx-lm."""
    from distributed.runtime.frames import CHUNKS_PER_STAGE, MIN_CHUNK
    prompt = [(13 * i + 5) % 250 + 1 for i in range(2600)]
    scheduler = scheduler_for(hf_checkpoint, split, prefill_step_size=2048)
    log = FrameLog(scheduler)
    (events,) = run_admitted(scheduler, [GenerationRequest(prompt, max_tokens=3)])
    assert_alone(hf_checkpoint, prompt, events, 3)
    chunks = [shape[1] for _, shape, reply, _, _ in log.prefill() if reply == Reply.ACK]
    assert sum(chunks) == len(prompt) - 1
    P = len(split)
    if P == 1:
        assert chunks == [2048, len(prompt) - 1 - 2048]
    else:
        assert len(chunks) == CHUNKS_PER_STAGE * P if len(prompt) // (CHUNKS_PER_STAGE * P) >= MIN_CHUNK else len(chunks) >= P
        assert min(chunks[:-1]) >= MIN_CHUNK
        assert max(len(kinds) for _, _, _, kinds, _ in log.prefill()) == P - 1  # P chunks in the ring at once
