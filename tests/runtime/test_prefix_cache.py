"""The prefix cache: rank 0's index over real caches of the tiny model (LRU order,
byte bound, longest prefix, trimmable vs wrapped); the index's radix tree alone, answering
as a scan over every entry would (the spec below) through random inserts, lookups and
evictions of entries with shared prefixes, the tree staying well formed (counts right, no
dead nodes); and greedy output with the cache equal to a cold run, in-process (1-3 stages)
and on a real 2-rank server (HTTP, gRPC)."""

import random
import re
import time

import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from distributed.runtime.caches import SlotCaches
from distributed.runtime.prefix_cache import Entry, PrefixCache, PrefixIndex, common_prefix, default_budget
from distributed.runtime.request import GenerationRequest, TokenEvent
from distributed.runtime.scheduler import Scheduler
from distributed.serving.proto import generation_pb2 as pb
from distributed.shard.config import read_config
from distributed.transport import Op, Reply
from grpc_server import SERVER_ARGS, Server
from prefill_frames import FrameLog
from stages import in_process_pipeline

WINDOW = 16  # the tiny model's sliding window: prompts longer than this wrap it
P = [(7 * i + 3) % 250 + 1 for i in range(40)]
SYSTEM = [(5 * i + 2) % 250 + 1 for i in range(40)]  # shared by several prompts


def other(n, k=0):
    return [(11 * i + 13 * k + 7) % 250 + 1 for i in range(n)]


def rank_caches(pipeline):
    """Every rank's SlotCaches, rank 0 first."""
    workers = getattr(pipeline.transport, "handlers", [])
    return [pipeline.caches] + [w.__self__.caches for w in workers]


def held_bytes(caches: SlotCaches) -> int:
    return sum(entry.nbytes for entry in caches.entries.values())


def assert_every_rank_agrees(prefix):
    """Every rank keeps exactly the index's entries, and the bytes the index counts."""
    ranks = rank_caches(prefix.pipeline)
    for caches, counted in zip(ranks, prefix.index.bytes):
        assert set(caches.entries) == set(prefix.index.entries)
        assert held_bytes(caches) == counted <= prefix.budget


def prefill(pipeline, slot, tokens):
    pipeline.forward(mx.array(tokens, dtype=mx.uint32)[None], Reply.LAST, slot)


def stored(prefix, tokens, slot=100):
    """Prefill `tokens` in a slot of their own and store them as an entry."""
    prefill(prefix.pipeline, slot, tokens)
    prefix.store([(tokens, 0)], slot)
    prefix.pipeline.release(slot)


def found(prefix, prompt):
    entry, tokens = prefix.index.find(np.array(prompt, dtype=np.int32))
    return (None if entry is None else list(entry.tokens)), tokens


def test_lru_order_and_byte_bound_on_every_rank(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (3, 5))
    probe = PrefixCache(pipeline, 1 << 30)
    stored(probe, P[:20])
    one = max(probe.index.bytes)  # a wrapped 20-token entry on the fullest rank (rank 1 here)
    assert probe.index.bytes[1] > probe.index.bytes[0]
    pipeline.evict(list(probe.index.entries))

    prefix = PrefixCache(pipeline, one * 5 // 2)  # room for two such entries
    a, b, c = P[:20], other(20, 1), other(20, 2)
    stored(prefix, a)
    stored(prefix, b)
    assert found(prefix, a + [1, 2]) == (a, 20)  # a is used: b is now the least recently used
    stored(prefix, c)
    assert [list(e.tokens) for e in prefix.index.entries.values()] == [a, c]
    assert prefix.evicted == 1
    assert_every_rank_agrees(prefix)
    # An entry larger than the whole budget is not kept, on any rank.
    stored(prefix, P + other(60))
    assert [list(e.tokens) for e in prefix.index.entries.values()] == [a, c]
    assert_every_rank_agrees(prefix)


def test_the_default_budget_is_a_share_of_the_tightest_rank():
    assert default_budget([8 << 30, 2 << 30, 12 << 30]) == (2 << 30) // 4
    assert default_budget([0, 1 << 30]) == 0


def test_longest_prefix_and_wrapped_entries(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (8,))
    prefix = PrefixCache(pipeline, 1 << 30)
    stored(prefix, P[:20])
    stored(prefix, P[:30])
    assert found(prefix, P) == (P[:30], 30)  # the longest entry the prompt extends
    # Both wrapped the window: an entry that the prompt leaves before its end is no use.
    assert found(prefix, P[:25] + [1, 2, 3]) == (P[:20], 20)
    # The same tokens again: at least the last one is computed, and a wrapped entry
    # cannot be cut back by one, so the shorter entry serves.
    assert found(prefix, P[:30]) == (P[:20], 20)
    assert found(prefix, other(30)) == (None, 0)
    assert prefix.index.covered(np.array(P[:30], dtype=np.int32))
    assert not prefix.index.covered(np.array(P[:25], dtype=np.int32))


def test_trimmable_entries_are_cut_to_the_common_prefix(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (3, 5))
    prefix = PrefixCache(pipeline, 1 << 30)
    short = P[:10]  # shorter than the window: every cache can be cut back
    stored(prefix, short)
    assert found(prefix, short[:6] + [1, 2, 3]) == (short, 6)
    assert found(prefix, short) == (short, 9)
    assert prefix.index.covered(np.array(short[:4], dtype=np.int32))  # a cut serves it
    # A longer trimmable entry makes the shorter one useless: it replaces it, on every rank.
    stored(prefix, short + [5, 6])
    assert [list(e.tokens) for e in prefix.index.entries.values()] == [short + [5, 6]]
    assert_every_rank_agrees(prefix)

    # A restored, cut entry continues exactly as the prompt computed from scratch.
    prompt = short[:6] + other(14)
    entry, tokens = prefix.index.find(np.array(prompt, dtype=np.int32))
    pipeline.restore(7, entry.id, tokens)
    warm = pipeline.logits(mx.array(prompt[tokens:], dtype=mx.uint32)[None], slot=7)
    cold = pipeline.logits(mx.array(prompt, dtype=mx.uint32)[None], slot=8)
    assert mx.abs(warm[:, -1] - cold[:, -1]).max().item() < 1e-4
    # The entry itself is unchanged by the restored slot's updates: restore it again.
    pipeline.restore(9, entry.id, tokens)
    again = pipeline.logits(mx.array(prompt[tokens:], dtype=mx.uint32)[None], slot=9)
    assert mx.array_equal(again, warm)


def best_tokens(entries, prompt) -> int:
    """The most of `prompt` any entry saves: a prefix of all but its last token whole, or an
    entry cut to the common prefix as far as it can be cut (at most all but the last token)."""
    best = 0
    for e in entries:
        common = common_prefix(e.tokens, prompt)
        if common == len(e.tokens) < len(prompt):
            best = max(best, common)
        else:
            best = max(best, min(common, len(prompt) - 1, e.cuttable))
    return best


def serves(entries, tokens) -> bool:
    """An entry of the same tokens, or one that extends them and can be cut to them."""
    return any(common_prefix(e.tokens, tokens) == len(tokens)
               and (len(e.tokens) == len(tokens) or e.cuttable >= len(tokens)) for e in entries)


def check_tree(index: PrefixIndex) -> None:
    seen = []

    def visit(node, prefix):
        tokens = np.concatenate([prefix, node.run])
        if node is not index._root:
            assert node.entry is not None or len(node.children) >= 2, "a dead or unmerged node"
        if node.entry is not None:
            assert np.array_equal(node.entry.tokens, tokens) and index._nodes[node.entry.id] is node
            seen.append(node.entry.id)
        for key, child in node.children.items():
            assert child.parent is node and int(child.run[0]) == key
            visit(child, tokens)
        own = node.entry.cuttable if node.entry is not None else -1
        assert node.cuttable == max([own] + [c.cuttable for c in node.children.values()])

    visit(index._root, np.zeros(0, dtype=np.int32))
    assert sorted(seen) == sorted(index.entries)


def test_random_operations_match_a_scan_over_every_entry():
    rng = random.Random(0)
    index = PrefixIndex(budget=12, ranks=2)
    stems = [[rng.randrange(4) for _ in range(rng.randrange(1, 8))] for _ in range(5)]

    def tokens():  # a shared stem and a tail: prefixes overlap often, at any length
        return np.array(rng.choice(stems)[:rng.randrange(0, 8)] + [rng.randrange(4) for _ in range(rng.randrange(4))]
                        or [rng.randrange(4)], dtype=np.int32)

    next_id = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.4:
            prompt = tokens()
            entries = list(index.entries.values())
            entry, got = index.find(prompt)
            assert got == best_tokens(entries, prompt), (step, prompt, [e.tokens for e in entries])
            if entry is not None:  # the entry it names gives those tokens
                assert common_prefix(entry.tokens, prompt) >= got
                assert entry.cuttable >= got or len(entry.tokens) == got
                assert next(reversed(index.entries)) == entry.id  # most recently used now
        elif op < 0.6:
            t = tokens()
            assert index.covered(t) == serves(list(index.entries.values()), t), step
        else:
            t = tokens()
            if serves(list(index.entries.values()), t):
                continue  # prefix_cache.store() never inserts what is covered
            before = dict(index.entries)
            cuttable = rng.choice([0, rng.randrange(len(t) + 1), len(t), len(t)])  # none, some, all
            entry = Entry(next_id, t, cuttable, [rng.randrange(1, 3), rng.randrange(1, 3)])
            next_id += 1
            dropped = index.insert(entry)
            useless = {e.id for e in before.values() if common_prefix(e.tokens, t) == len(e.tokens)
                       and (len(e.tokens) == len(t) or len(e.tokens) <= entry.cuttable)}
            assert useless <= set(dropped) and set(dropped) <= set(before)
            assert set(index.entries) == set(before) - set(dropped) | {entry.id}
            assert index.bytes == [sum(e.nbytes[r] for e in index.entries.values()) for r in range(2)]
            assert max(index.bytes) <= index.budget or len(index.entries) == 1
            evicted = [i for i in dropped if i not in useless]
            assert evicted == [i for i in before if i not in useless][:len(evicted)]  # least recently used first
        check_tree(index)
    assert next_id > 300


def test_a_lookup_walks_branches_not_entries():
    # Thousands of entries under one shared system prompt: the tree has a node per entry,
    # and a lookup passes two of them.
    index = PrefixIndex(budget=1 << 40, ranks=1)
    system = list(range(1000, 1500))
    for i in range(3000):
        index.insert(Entry(i, np.array(system + [i, i + 1, i + 2], dtype=np.int32), 0, [1]))
    path, matched, below = index._walk(np.array(system + [7, 8, 9, 10], dtype=np.int32))
    assert [depth for _, depth in path] == [500, 503] and matched == 503 and below is None
    assert index.find(np.array(system + [7, 8, 9, 10], dtype=np.int32))[1] == 503
    assert len(index._root.children) == 1 and len(path[0][0].children) == 3000


def test_an_entry_of_the_same_tokens_replaces_the_old_one():
    index = PrefixIndex(budget=100, ranks=1)
    index.insert(Entry(0, np.array([1, 2, 3], dtype=np.int32), 0, [1]))
    assert index.insert(Entry(1, np.array([1, 2, 3], dtype=np.int32), 0, [1])) == [0]
    check_tree(index)
    assert list(index.entries) == [1] and index.find(np.array([1, 2, 3, 4], dtype=np.int32))[0].id == 1



def run(scheduler, prompt, max_tokens=12):
    """(tokens, logprobs, FinishEvent) of one request, on this thread."""
    handle = scheduler.submit(GenerationRequest(list(prompt), max_tokens=max_tokens))
    scheduler.run_pending()
    return split_events(list(handle.events()))


def split_events(events):
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    return [e.token_id for e in tokens], [e.logprob for e in tokens], events[-1]


def assert_same(warm, cold):
    assert warm[0] == cold[0]
    assert max((abs(a - b) for a, b in zip(warm[1], cold[1])), default=0) < 1e-4


def cold_scheduler(path, split):
    return Scheduler(in_process_pipeline(path, split)[0], load_tokenizer(path), prefill_step_size=8)


@pytest.mark.parametrize("split", [(8,), (3, 5), (2, 3, 3)])
def test_chat_turns_equal_a_cold_run(hf_checkpoint, split):
    """Each turn extends the last (its prompt, its reply, a new message): it restores
    the last turn's entry and prefills only the new tokens, with the same output."""
    pipeline, _ = in_process_pipeline(hf_checkpoint, split)
    warm = Scheduler(pipeline, load_tokenizer(hf_checkpoint), prefill_step_size=8, prefix_cache_bytes=1 << 30)
    cold = cold_scheduler(hf_checkpoint, split)
    eos = load_tokenizer(hf_checkpoint).eos_token_id
    prompt, fed = P, 0
    for turn in range(4):
        got = run(warm, prompt)
        assert_same(got, run(cold, prompt))
        assert got[2].cached_tokens == fed
        # What the next turn restores: all this turn fed. A turn that drew an EOS was
        # fed it too (the batcher's lookahead fed it before seeing that the turn had
        # ended), and the next turn's prompt holds it, as a chat template would. A turn
        # that max_tokens ended was fed all but its last token (no step follows it).
        stopped = got[2].finish_reason == "stop"
        reply = got[0] + ([eos] if stopped else [])
        fed = len(prompt) + len(reply) - (0 if stopped else 1)
        prompt = prompt + reply + other(10, turn)
    assert_every_rank_agrees(warm.prefix_cache)


def test_concurrent_requests_sharing_a_system_prompt(hf_checkpoint):
    """Five requests arrive together: they prefill as one batch (so none restores
    another's entry), decode as batch rows, and each row stored when it ends serves
    that chat's next turn."""
    pipeline, _ = in_process_pipeline(hf_checkpoint, (3, 5))
    warm = Scheduler(pipeline, load_tokenizer(hf_checkpoint), prefill_step_size=8, max_batch=5,
                     prefix_cache_bytes=1 << 30)
    prompts = [SYSTEM + other(6 + k, k) for k in range(5)]
    max_tokens = [10, 14, 6, 12, 8]
    handles = [warm.submit(GenerationRequest(p, max_tokens=m)) for p, m in zip(prompts, max_tokens)]
    warm.start()
    try:
        results = [split_events(list(h.events())) for h in handles]
        cold = cold_scheduler(hf_checkpoint, (3, 5))
        for prompt, m, got in zip(prompts, max_tokens, results):
            assert_same(got, run(cold, prompt, m))
        assert [r[2].cached_tokens for r in results] == [0] * 5
        # The next turn of chat 1, whose reply ended as a row of a batch.
        follow = prompts[1] + results[1][0] + other(5, 9)
        handle = warm.submit(GenerationRequest(follow, max_tokens=8))
        got = split_events(list(handle.events()))
        assert_same(got, run(cold, follow, 8))
        # It ran longest, alone at the end: no step followed its last token, so that
        # token is prefilled again.
        assert got[2].cached_tokens == len(prompts[1]) + max_tokens[1] - 1
    finally:
        warm.close()
    assert_every_rank_agrees(warm.prefix_cache)


def test_a_restored_turn_prefills_inside_a_running_requests_steps(hf_checkpoint):
    """Chunked prefill on a restored history: a chat's next turn arrives while another request
    decodes on two ranks; its new tokens ride in that request's steps, after the restored
    entry, and both equal a cold run."""
    pipeline, _ = in_process_pipeline(hf_checkpoint, (3, 5))
    warm = Scheduler(pipeline, load_tokenizer(hf_checkpoint), prefill_step_size=8, prefix_cache_bytes=1 << 30)
    log = FrameLog(warm)
    first = SYSTEM + other(6)
    warm.start()
    try:
        reply = split_events(list(warm.submit(GenerationRequest(first, max_tokens=4)).events()))
        follow = first + reply[0] + other(20, 5)
        running = warm.submit(GenerationRequest(other(9, 3), max_tokens=40))
        events, late = [], None
        for event in running.events():
            events.append(event)
            if late is None and isinstance(event, TokenEvent):
                late = warm.submit(GenerationRequest(follow, max_tokens=8))
        got = split_events(list(late.events()))
    finally:
        warm.close()
    cold = cold_scheduler(hf_checkpoint, (3, 5))
    assert_same(split_events(events), run(cold, other(9, 3), 40))
    assert_same(got, run(cold, follow, 8))
    assert got[2].cached_tokens >= len(first)
    assert len(log.mixed) >= 2, "its 20-odd new tokens went in 8-token chunks beside the running steps"


def test_eviction_under_a_small_budget(hf_checkpoint):
    """A budget of about two entries: entries come and go on every rank, never above
    it, and outputs stay exact."""
    pipeline, _ = in_process_pipeline(hf_checkpoint, (2, 3, 3))
    probe = PrefixCache(pipeline, 1 << 30)
    stored(probe, P + other(10))  # 50 tokens
    budget = max(probe.index.bytes) * 2  # a prompt's two entries (its end, its finish), not more
    pipeline.evict(list(probe.index.entries))
    warm = Scheduler(pipeline, load_tokenizer(hf_checkpoint), prefill_step_size=8, prefix_cache_bytes=budget)
    cold = cold_scheduler(hf_checkpoint, (2, 3, 3))
    prompts = [P, other(40, 1), other(40, 1) + other(5, 3), P + other(5, 2)]
    cached = []
    for prompt in prompts:
        got = run(warm, prompt)
        assert_same(got, run(cold, prompt))
        assert_every_rank_agrees(warm.prefix_cache)
        cached.append(got[2].cached_tokens)
    # The third prompt restores the second's entry (its whole prompt, stored once it had its
    # first token); the first's were evicted before the fourth.
    assert cached == [0, 0, 40, 0] and warm.prefix_cache.evicted > 0


@pytest.fixture(scope="module")
def chats(hf_checkpoint):
    """A 3-turn chat over HTTP and one over gRPC on a real 2-rank server, once with the
    prefix cache (its default size) and once with --prefix-cache-bytes 0."""
    return {cache: chat_on_server(hf_checkpoint, [] if cache else ["--prefix-cache-bytes", "0"])
            for cache in (True, False)}


def chat_on_server(model, extra):
    server = Server(model, 2, [*SERVER_ARGS, "--http", "127.0.0.1:0", *extra])
    try:
        server.wait_serving()
        while not (listening := re.search(r"and \S+:(\d+) \(HTTP\)", server.output())):
            time.sleep(0.01)  # health turns SERVING just before rank 0 logs its addresses
        port = listening.group(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        http, grpc_turns = [], []
        messages = [{"role": "system", "content": "You are a terse assistant. " * 3}]
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn}: what is {turn} + {turn}?"})
            r = client.chat.completions.create(model=str(model), messages=messages, max_tokens=12, logprobs=True,
                                               temperature=0)
            text = r.choices[0].message.content
            http.append((text, [e.logprob for e in r.choices[0].logprobs.content],
                         r.usage.prompt_tokens_details.cached_tokens))
            messages.append({"role": "assistant", "content": text})
        history = [pb.ChatMessage(role="user", content="Tell me about rings. " * 3)]
        for turn in range(3):
            out = {"token_ids": [], "logprobs": []}
            for response in server.stub.Generate(pb.GenerateRequest(messages=history, max_tokens=12), timeout=120):
                out["token_ids"] += list(response.token_ids)
                out["logprobs"] += list(response.logprobs)
                out["text"] = out.get("text", "") + response.text
                if response.finish_reason:
                    out["cached"] = response.usage.cached_tokens
            grpc_turns.append(out)
            history += [pb.ChatMessage(role="assistant", content=out["text"]),
                        pb.ChatMessage(role="user", content=f"And turn {turn}?")]
    finally:
        server.stop()
    log = server.output(100000)  # with the summary rank 0 prints as it stops
    server.log.close()
    return {"http": http, "grpc": grpc_turns, "log": log}


def test_a_real_two_rank_server_over_http_and_grpc(chats):
    on, off = chats[True], chats[False]
    assert "prefix cache: up to" in on["log"] and "prefix cache: off" in off["log"]
    for (text, logprobs, cached), (text0, logprobs0, cached0) in zip(on["http"], off["http"]):
        assert text == text0 and cached0 == 0
        assert max(abs(a - b) for a, b in zip(logprobs, logprobs0)) < 1e-4
    assert [c for _, _, c in on["http"]][0] == 0 and all(c > 0 for _, _, c in on["http"][1:])
    for turn, (got, ref) in enumerate(zip(on["grpc"], off["grpc"])):
        assert got["token_ids"] == ref["token_ids"] and ref["cached"] == 0
        assert max(abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"])) < 1e-4
        # Its first turn shares only the template's opening with the HTTP chat's entries.
        assert got["cached"] < 5 if turn == 0 else got["cached"] > 20
    assert "prefix cache: " in on["log"] and re.search(r"[1-9]\d* of \d+ prompts hit", on["log"])



# -- any shared prefix, on a hybrid model (caches.Log, caches.Stored) -------------------------

LONG = other(70, 4)  # several windows of the tiny model (16)


def warm_scheduler(path, split, **kwargs):
    pipeline, _ = in_process_pipeline(path, split)
    return Scheduler(pipeline, load_tokenizer(path), prefill_step_size=8, prefix_cache_bytes=1 << 30, **kwargs)


@pytest.mark.parametrize("split", [(8,), (3, 5), (2, 3, 3)])
def test_a_shared_prefix_is_restored_whatever_follows(hf_checkpoint, split):
    """Prompts sharing LONG (70 tokens: wrapped windows), then differing: each restores all of
    the shared part from the other's entry, the same prompt again all but its last token, and
    the outputs equal a cold run's."""
    warm, cold = warm_scheduler(hf_checkpoint, split), cold_scheduler(hf_checkpoint, split)
    first, second, third = LONG + other(9, 1), LONG + other(12, 2), LONG[:50] + other(20, 3)
    for prompt, cached in [(first, 0), (second, len(LONG)), (third, 50), (second, len(second) - 1)]:
        got = run(warm, prompt)
        assert_same(got, run(cold, prompt))
        assert got[2].cached_tokens == cached, (len(prompt), got[2].cached_tokens)
    assert_every_rank_agrees(warm.prefix_cache)
    assert all(e.cuttable >= len(LONG) for e in warm.prefix_cache.index.entries.values())


def test_a_restored_prompt_is_recorded_in_turn(hf_checkpoint):
    """A prompt that restores part of an entry is recorded from there on: its own entries can
    be cut past the first one's tokens (a chain of sessions, each extending the last)."""
    warm, cold = warm_scheduler(hf_checkpoint, (3, 5)), cold_scheduler(hf_checkpoint, (3, 5))
    base = LONG[:30]
    one = base + other(40, 5)  # restores nothing
    two = one[:60] + other(40, 6)  # restores 60 of one's
    three = two[:90] + other(10, 7)  # restores 90 of two's: 30 past what it took from one
    for prompt, cached in [(one, 0), (two, 60), (three, 90)]:
        got = run(warm, prompt, 6)
        assert_same(got, run(cold, prompt, 6))
        assert got[2].cached_tokens == cached


def test_batched_rows_are_recorded_apart(hf_checkpoint):
    """Prompts of different lengths prefilled as one padded batch: each row's log holds its own
    tokens only, so a later prompt sharing any of them restores that much, exactly."""
    warm = warm_scheduler(hf_checkpoint, (3, 5), max_batch=4)
    prompts = [LONG[:40] + other(5 + 7 * k, k) for k in range(3)]
    handles = [warm.submit(GenerationRequest(p, max_tokens=5)) for p in prompts]
    warm.run_pending()
    for h in handles:
        list(h.events())
    cold = cold_scheduler(hf_checkpoint, (3, 5))
    for k, prompt in enumerate(prompts):
        follow = prompt[:-2] + other(6, 10 + k)  # differs in the row's own last tokens
        got = run(warm, follow, 6)
        assert_same(got, run(cold, follow, 6))
        assert got[2].cached_tokens == len(prompt) - 2


def test_a_recorded_prompt_prefills_inside_running_steps(hf_checkpoint):
    """A long prompt's chunks ride in a running request's decode steps (mixed frames, two
    ranks): its log is still whole, and a prompt sharing part of it restores that part."""
    warm = warm_scheduler(hf_checkpoint, (3, 5))
    log = FrameLog(warm)
    warm.start()
    try:
        running = warm.submit(GenerationRequest(other(9, 3), max_tokens=60))
        late = None
        for event in running.events():
            if late is None and isinstance(event, TokenEvent):
                late = warm.submit(GenerationRequest(LONG + other(5, 8), max_tokens=4))
        split_events(list(late.events()))
        assert len(log.mixed) >= 4
        follow = LONG[:66] + other(8, 9)
        got = split_events(list(warm.submit(GenerationRequest(follow, max_tokens=6)).events()))
    finally:
        warm.close()
    assert_same(got, run(cold_scheduler(hf_checkpoint, (3, 5)), follow, 6))
    assert got[2].cached_tokens == 66


def test_a_prompt_whose_log_would_not_fit_is_not_recorded(hf_checkpoint):
    """Under a budget smaller than a recorded entry, prompts are not recorded (no log is kept
    on any rank) and their entries serve whole extensions only, as before."""
    pipeline, _ = in_process_pipeline(hf_checkpoint, (3, 5))
    probe = PrefixCache(pipeline, 1 << 30)
    stored(probe, LONG)  # not recorded: its wrapped windows and full layers only
    small = max(probe.index.bytes) + 1
    pipeline.evict(list(probe.index.entries))
    warm = Scheduler(pipeline, load_tokenizer(hf_checkpoint), prefill_step_size=8, prefix_cache_bytes=small * 3 // 2)
    run(warm, LONG, 4)
    assert all(not caches.logs for caches in rank_caches(pipeline))
    assert [e.cuttable for e in warm.prefix_cache.index.entries.values()] == [0]
    assert run(warm, LONG[:60] + other(5), 4)[2].cached_tokens == 0


# -- the disk tier (runtime/disk_cache.py under the index: PrefixCache._load, Pipeline.load) -----

LONGER = other(300, 11)  # past DISK_MIN_TOKENS: written to disk


def disk_pipeline(path, split, folder, **kwargs):
    """An in-process pipeline whose stages each keep a disk tier in `folder` (as --stages N)."""
    from distributed.runtime.disk_cache import DiskCache, fingerprint
    from distributed.runtime.pipeline import in_process_pipeline as pipeline_of
    from distributed.shard.checkpoint import load_config
    from distributed.shard.loader import load_stage
    from distributed.shard.plan import layer_ranges

    config = load_config(str(path))[2]
    stages = [load_stage(path, s, e, i == 0) for i, (s, e) in enumerate(layer_ranges(8, len(split), list(split)))]
    disks = [DiskCache(folder, kwargs.get("disk_bytes", 1 << 30),
                       fingerprint(path, config, "float32", (s.start, s.end), kwargs.get("tensor")))
             for s in stages]
    return pipeline_of(stages, disks=disks)


@pytest.mark.parametrize("split", [(8,), (3, 5)])
def test_a_restart_restores_from_disk(hf_checkpoint, tmp_path, split):
    """A prompt's entries are written to every stage's disk; after a restart (new processes'
    worth of state: a new pipeline, scheduler and index) the same prompt and one sharing its
    prefix restore from disk, with the outputs of a cold run."""
    first = disk_pipeline(hf_checkpoint, split, tmp_path)
    warm = Scheduler(first, load_tokenizer(hf_checkpoint), prefill_step_size=64, prefix_cache_bytes=1 << 30)
    # One token (its entry at the end holds the prompt alone, as the one stored at its first token), or four.
    run(warm, LONGER, 1 if len(split) > 1 else 4)
    assert warm.prefix_cache.disk_written == 1  # one entry a request
    first.close()  # writes what is queued
    again = disk_pipeline(hf_checkpoint, split, tmp_path)
    warm = Scheduler(again, load_tokenizer(hf_checkpoint), prefill_step_size=64, prefix_cache_bytes=1 << 30)
    cold = cold_scheduler(hf_checkpoint, split)
    window = read_config(hf_checkpoint)["sliding_window"]
    for prompt, cached, from_disk in [(LONGER, len(LONGER) - 1, True), (LONGER[:280] + other(9, 2), 280, True),
                                      (LONGER, len(LONGER) - 1, False)]:
        loads = warm.prefix_cache.disk_hits
        got = run(warm, prompt, 6)
        assert_same(got, run(cold, prompt, 6))
        assert got[2].cached_tokens == cached and got[2].disk_tokens == (cached if from_disk else 0)
        if from_disk:  # read from disk: the windows at its cut only (Stored.from_file), on every stage; the
            # request's own entries log on from there, and no entry holds a whole log
            for stage in rank_caches(again):
                starts = {e.log_start for e in stage.entries.values() if e.logged}
                assert cached - window in starts and 0 not in starts
        assert warm.prefix_cache.disk_hits == loads + from_disk
    # The second, cut further back than the first's RAM entry can be, read the disk entry again;
    # the third found the first's request's own entry in RAM, recorded on from that window.
    again.close()


def test_a_disk_entry_missing_on_one_rank_is_restored_on_none(hf_checkpoint, tmp_path):
    """A rank whose file is gone (or damaged) answers no: no rank keeps the entry, the prompt is
    prefilled whole, exactly, and rank 0 forgets the entry."""
    first = disk_pipeline(hf_checkpoint, (3, 5), tmp_path)
    warm = Scheduler(first, load_tokenizer(hf_checkpoint), prefill_step_size=64, prefix_cache_bytes=1 << 30)
    run(warm, LONGER, 4)
    first.close()
    again = disk_pipeline(hf_checkpoint, (3, 5), tmp_path)
    worker = rank_caches(again)[1]
    for f in worker.disk.sub.iterdir():  # rank 1's files: a truncated one, the others gone
        f.unlink() if f.name != sorted(p.name for p in worker.disk.sub.iterdir())[0] else f.write_bytes(b"x" * 10)
    warm = Scheduler(again, load_tokenizer(hf_checkpoint), prefill_step_size=64, prefix_cache_bytes=1 << 30)
    got = run(warm, LONGER, 6)
    assert_same(got, run(cold_scheduler(hf_checkpoint, (3, 5)), LONGER, 6))
    assert got[2].cached_tokens == 0 and warm.prefix_cache.disk_failed >= 1
    assert all(not caches.entries or set(caches.entries) == set(warm.prefix_cache.index.entries)
               for caches in rank_caches(again))
    again.close()


def test_another_split_restores_nothing(hf_checkpoint, tmp_path):
    first = disk_pipeline(hf_checkpoint, (3, 5), tmp_path)
    run(Scheduler(first, load_tokenizer(hf_checkpoint), prefill_step_size=64, prefix_cache_bytes=1 << 30), LONGER, 4)
    first.close()
    other_split = disk_pipeline(hf_checkpoint, (4, 4), tmp_path)
    warm = Scheduler(other_split, load_tokenizer(hf_checkpoint), prefill_step_size=64, prefix_cache_bytes=1 << 30)
    got = run(warm, LONGER, 6)
    assert_same(got, run(cold_scheduler(hf_checkpoint, (4, 4)), LONGER, 6))
    assert got[2].cached_tokens == 0
    other_split.close()


@pytest.mark.parametrize("trouble", ["full", "read-only"])
def test_a_full_or_read_only_disk_costs_the_disk_tier_only(hf_checkpoint, tmp_path, trouble):
    """Every stage's disk tier on a tmpfs too small for one entry, or remounted read-only after
    a first server wrote there: serving goes on from RAM (the same prompt again restores from
    RAM), tokens exact; the read-only one still reads what it holds."""
    from mounts import remount, tmpfs

    with tmpfs(tmp_path / "disk", "64k" if trouble == "full" else "8m") as folder:
        if trouble == "read-only":
            first = disk_pipeline(hf_checkpoint, (3, 5), folder)
            run(Scheduler(first, load_tokenizer(hf_checkpoint), prefill_step_size=64, prefix_cache_bytes=1 << 30),
                LONGER, 4)
            first.close()
            remount(folder, "ro")
        pipeline = disk_pipeline(hf_checkpoint, (3, 5), folder)
        warm = Scheduler(pipeline, load_tokenizer(hf_checkpoint), prefill_step_size=64, prefix_cache_bytes=1 << 30)
        cold = cold_scheduler(hf_checkpoint, (3, 5))
        restored = len(LONGER) - 1 if trouble == "read-only" else 0
        for prompt, cached in [(LONGER, restored), (LONGER, len(LONGER) - 1)]:
            got = run(warm, prompt, 6)
            assert_same(got, run(cold, prompt, 6))
            assert got[2].cached_tokens == cached
        ranks = rank_caches(pipeline)
        pipeline.close()  # writes what is queued
        stats = [caches.disk.stats() for caches in ranks if caches.disk is not None]
        assert len(stats) == 2
        if trouble == "full":
            assert all(s["write_errors"] + s["write_drops"] >= 1 and s["writes"] == 0 for s in stats), stats


def test_rows_of_a_batch_are_stored_in_one_op_and_a_repeat_once(hf_checkpoint):
    """Three rows of one batch slot stored together (one SNAPSHOT op round the ring): the two distinct
    prompts are kept, each restoring as it was computed alone, and the repeated prompt is kept once."""
    pipeline, _ = in_process_pipeline(hf_checkpoint, (3, 5))
    prefix = PrefixCache(pipeline, 1 << 30)
    a, b = P[:12], other(12, 1)
    for slot, tokens in ((10, a), (11, b), (12, a)):
        prefill(pipeline, slot, tokens)
    pipeline.merge(0, [10, 11, 12])
    ops = []
    tell = pipeline._tell_others
    pipeline._tell_others = lambda op, *rest, **kw: ops.append(op) or tell(op, *rest, **kw)
    prefix.store([(a, 0), (b, 1), (a, 2)], 0)
    pipeline._tell_others = tell
    assert ops.count(Op.SNAPSHOT) == 1
    assert sorted(list(e.tokens) for e in prefix.index.entries.values()) == sorted([a, b])
    assert_every_rank_agrees(prefix)
    pipeline.release(0)
    for tokens in (a, b):
        entry, n = prefix.index.find(np.array(tokens + [5], dtype=np.int32))
        pipeline.restore(20, entry.id, n)
        restored = pipeline.logits(mx.array([[5]], dtype=mx.uint32), slot=20)
        alone = pipeline.logits(mx.array([tokens + [5]], dtype=mx.uint32), slot=21)
        assert mx.abs(restored - alone).max().item() < 1e-4
        pipeline.release(20)
        pipeline.release(21)
