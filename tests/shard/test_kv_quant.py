"""--kv-bits: the full-attention caches kept quantized, on every path a cache takes (one sequence,
stages, batches merged, filtered and left-padded, prefill chunks beside decode steps, speculation's
trims, prefix-cache restores), held to mlx-lm's own parts: its model run by generate_step with
KVCache.to_quantized caches on the full-attention layers from the first token."""

import re

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

from conftest import run_cli, run_json
from distributed.runtime.memory_guard import MemoryAdmission
from distributed.runtime.request import GenerationRequest, TokenEvent
from distributed.runtime.scheduler import Scheduler
from distributed.runtime.speculation import SpeculationOptions
from distributed.shard.config import read_config
from distributed.shard.kv_quant import BatchQuantizedKVCache, QuantizedKVCache
from distributed.shard.sizes import kv_bytes_per_token, kv_quantization, model_sizes, with_kv_quantization
from distributed.shard.tiny_checkpoint import make_checkpoint
from reference import EOS, PROMPT, mlx_lm_greedy
from runtime.test_speculation import Oracle
from stages import in_process_pipeline

GROUP = 32  # the test checkpoint's head size: the group divides it
PROMPTS = [[(k * i + 5 * k) % 250 + 1 for i in range(n)] for k, n in [(3, 5), (7, 17), (11, 40), (13, 70)]]
MAX_TOKENS = [30, 12, 40, 25]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny HF checkpoint (S S S F twice, window 16) with 32-value heads."""
    return make_checkpoint(tmp_path_factory.mktemp("kv_quant"), layout="hf", seed=0, head_dim=GROUP)


def quantized_config(path, bits):
    return with_kv_quantization(read_config(path), bits, GROUP)


def scheduler(path, split, bits, memory_limit=None, **kwargs):
    pipeline, _ = in_process_pipeline(path, split, quantized_config(path, bits), memory_limit)
    return Scheduler(pipeline, load_tokenizer(path), prefill_step_size=8, **kwargs)


def run(scheduler, requests):
    handles = [scheduler.submit(r) for r in requests]
    scheduler.run_pending()
    assert scheduler.failure is None, scheduler.failure
    return [list(h.events()) for h in handles]


def assert_reference(path, prompt, max_tokens, bits, events, bound=1e-4, start=0):
    """Greedy tokens as the reference's (which ends at any of reference.EOS), logprobs within `bound`
    (`start`: --quantized-kv-start, late_reference's). A row of a batch may differ from the row
    alone by a float rounding in its keys (~1e-7), which quantization turns into a step of the
    group's scale now and then: there the bound is 1e-3."""
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    ref_tokens, ref_logprobs = (late_reference(path, prompt, max_tokens, bits, start) if start else
                                mlx_lm_greedy(path, prompt, max_tokens, 8, kv_bits=bits, kv_group_size=GROUP))
    ids = [e.token_id for e in tokens]
    assert ids[:len(ref_tokens)] == ref_tokens
    assert len(ids) == len(ref_tokens) or ids[len(ref_tokens)] in EOS
    assert max(abs(e.logprob - lp) for e, lp in zip(tokens, ref_logprobs)) < bound


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("split", [(8,), (3, 5)])
def test_one_sequence_equals_the_reference(checkpoint, bits, split):
    (events,) = run(scheduler(checkpoint, split, bits), [GenerationRequest(PROMPT, max_tokens=30)])
    assert_reference(checkpoint, PROMPT, 30, bits, events)


@pytest.mark.parametrize("bits, ranks, extra", [(8, 2, []), (4, 2, []), (4, 1, ["--stages", "2"]),
                                                (8, 2, ["--tensor-parallel-size", "2"]),
                                                (4, 2, ["--tensor-parallel-size", "2"])])
def test_run_trinity_equals_the_reference(checkpoint, bits, ranks, extra):
    """A ring of two, --stages 2 and a tensor group of two: each rank quantizes its own layers'
    caches, or its share of their heads."""
    out = run_json(["--model", str(checkpoint), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "30",
                    "--kv-bits", str(bits), "--kv-group-size", str(GROUP), *extra], ranks)
    assert out["kv_bits"] == bits
    events = [TokenEvent(t, lp, "") for t, lp in zip(out["token_ids"], out["logprobs"])]
    assert_reference(checkpoint, PROMPT, 30, bits, events, bound=1e-3)


@pytest.mark.slow
def test_a_restarted_ring_restores_quantized_entries_from_disk(checkpoint, tmp_path):
    """A ring of two serves a prompt, stops, starts again: the prompt and one sharing its first 300
    tokens restore from every rank's disk tier, their caches quantized as they were stored."""
    from startup.test_disk_tier import MAX_TOKENS, PROMPT as LONG, SHARED, served

    extra = ["--kv-bits", "8", "--kv-group-size", str(GROUP)]
    served(checkpoint, 2, extra, tmp_path, [LONG])
    outs, log = served(checkpoint, 2, extra, tmp_path, [LONG, SHARED])
    for (tokens, logprobs, _), prompt in zip(outs, (LONG, SHARED)):
        events = [TokenEvent(t, lp, "") for t, lp in zip(tokens, logprobs)]
        assert_reference(checkpoint, prompt, MAX_TOKENS, 8, events, bound=1e-3)
    assert [cached for _, _, cached in outs] == [len(LONG) - 1, 300], log
    assert "disk tier: 2 loads" in log


def late_reference(path, prompt, max_tokens, bits, start, step=8):
    """mlx-lm's parts as generate_step runs them with quantized_kv_start (which AFMoE's sliding
    caches stop: RotatingKVCache.to_quantized raises): the prompt but its last token in chunks of
    `step`, then one token at a time, each full-attention KVCache turned into a QuantizedKVCache
    by to_quantized after the call that brought it to `start` tokens or more."""
    from mlx_lm.models.cache import KVCache

    from reference import mlx_lm_model

    model = mlx_lm_model(path)
    cache = model.make_cache()

    def call(tokens):
        logits = model(mx.array(tokens)[None], cache=cache)[0, -1]
        cache[:] = [c.to_quantized(GROUP, bits) if type(c) is KVCache and c.offset >= start else c for c in cache]
        return logits - mx.logsumexp(logits)

    for i in range(0, len(prompt) - 1, step):
        call(prompt[i:min(i + step, len(prompt) - 1)])
    tokens, logprobs, lp = [], [], call(prompt[-1:])
    while len(tokens) < max_tokens:
        token = mx.argmax(lp).item()
        if token in EOS:
            break
        tokens.append(token)
        logprobs.append(lp[token].item())
        lp = call([token])
    return tokens, logprobs


@pytest.mark.parametrize("start", [16, 48])  # in the prompt (40 tokens), in decoding
@pytest.mark.parametrize("split", [(8,), (3, 5)])
def test_quantized_from_a_start_equals_the_reference(checkpoint, split, start):
    config = with_kv_quantization(read_config(checkpoint), 4, GROUP, start)
    pipeline, _ = in_process_pipeline(checkpoint, split, config)
    s = Scheduler(pipeline, load_tokenizer(checkpoint), prefill_step_size=8)
    (events,) = run(s, [GenerationRequest(PROMPT, max_tokens=30)])
    assert_reference(checkpoint, PROMPT, 30, 4, events, start=start)
    assert late_reference(checkpoint, PROMPT, 30, 4, start)[0] != mlx_lm_greedy(checkpoint, PROMPT, 30, 8)[0]


def test_batched_rows_quantized_from_a_start(checkpoint):
    """Rows past the start when their prompts end are quantized at its chunk boundary, as alone;
    a shorter one's caches are quantized when it joins them (earlier than alone: it only finishes)."""
    config = with_kv_quantization(read_config(checkpoint), 8, GROUP, 16)
    pipeline, _ = in_process_pipeline(checkpoint, (3, 5), config)
    s = Scheduler(pipeline, load_tokenizer(checkpoint), prefill_step_size=8, max_batch=4)
    results = run(s, [GenerationRequest(p, max_tokens=m) for p, m in zip(PROMPTS, MAX_TOKENS)])
    assert results[0][-1].finish_reason in ("length", "stop")
    for prompt, max_tokens, events in list(zip(PROMPTS, MAX_TOKENS, results))[1:]:
        assert_reference(checkpoint, prompt, max_tokens, 8, events, bound=1e-3, start=16)


def test_a_server_says_its_kv_bits(checkpoint, tmp_path):
    """Through the launcher's router (rank 0's GetModelInfo, read into the router's model facts):
    GetModelInfo and GET /v1/status (the status page's document) name the caches' bits."""
    import json
    import urllib.request

    from grpc_server import pb
    from router_launcher import Launcher, serving

    la = Launcher(checkpoint, tmp_path / "launch.log", 2, serve_args=["--kv-bits", "8", "--kv-group-size", str(GROUP)])
    with serving(la):
        assert la.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60).kv_bits == 8
        with urllib.request.urlopen(f"http://{la.http}/v1/status", timeout=60) as r:
            assert json.loads(r.read())["kv_bits"] == 8


def test_the_quantized_reference_differs_from_the_whole_one(checkpoint):
    """So the tests above tell the paths apart."""
    whole = mlx_lm_greedy(checkpoint, PROMPT, 30, 8)[0]
    assert mlx_lm_greedy(checkpoint, PROMPT, 30, 8, kv_bits=4, kv_group_size=GROUP)[0] != whole


@pytest.mark.parametrize("bits", [8, 4])
def test_batched_rows_equal_the_reference_alone(checkpoint, bits):
    """Rows of different lengths merged (left padding), prefilled in chunks beside decode
    steps, joined into and filtered out of a decode group, back to one row; each frame checked
    against a --memory-limit (memory_guard.frame_bytes over quantized caches)."""
    requests = [GenerationRequest(p, max_tokens=m) for p, m in zip(PROMPTS, MAX_TOKENS)]
    results = run(scheduler(checkpoint, (3, 5), bits, memory_limit=1 << 34, max_batch=4), requests)
    for prompt, max_tokens, events in zip(PROMPTS, MAX_TOKENS, results):
        assert_reference(checkpoint, prompt, max_tokens, bits, events, bound=1e-3)


def test_speculation_trims_the_quantized_caches(checkpoint):
    """Drafts wrong at every offset in turn (test_speculation's Oracle): each rejection trims them."""
    reference = mlx_lm_greedy(checkpoint, PROMPT, 30, 8, kv_bits=8, kv_group_size=GROUP)[0]
    s = scheduler(checkpoint, (3, 5), 8, speculation=SpeculationOptions(num_draft_tokens=3, measured=False))
    s.batcher.verifier.drafter = Oracle(reference, 3)
    (events,) = run(s, [GenerationRequest(PROMPT, max_tokens=30)])
    assert_reference(checkpoint, PROMPT, 30, 8, events)
    stats = s.batcher.verifier.stats
    assert stats.drafted > stats.accepted > 0


def test_a_prompt_restored_from_the_prefix_cache_equals_the_reference(checkpoint):
    warm = scheduler(checkpoint, (3, 5), 8, prefix_cache_bytes=1 << 30)
    first = PROMPT
    (events,) = run(warm, [GenerationRequest(first, max_tokens=10)])
    second = first + [e.token_id for e in events if isinstance(e, TokenEvent)] + PROMPTS[1]
    (events,) = run(warm, [GenerationRequest(second, max_tokens=20)])
    assert events[-1].cached_tokens >= len(first)
    assert_reference(checkpoint, second, 20, 8, events, bound=1e-3)


@pytest.mark.parametrize("bits", [8, 4])
def test_bytes_per_token_are_what_the_caches_hold(checkpoint, bits):
    config = quantized_config(checkpoint, bits)
    q = kv_quantization(config)
    cache = QuantizedKVCache(q.group_size, q.bits)
    cache.update_and_fetch(*(mx.zeros((1, 2, 256, GROUP)),) * 2)
    args = model_sizes(config)
    assert cache.nbytes == 256 * args.full_kv_bytes_per_token
    assert args.full_kv_bytes_per_token < args.kv_bytes_per_token  # the sliding layers' stay whole
    assert kv_bytes_per_token(SimpleArgs(), 2, q) == int(2 * 4 * 128 * (bits / 8 + 4 / GROUP))


class SimpleArgs:
    num_key_value_heads, head_dim = 4, 128


def test_a_memory_limit_that_refuses_a_prompt_at_16_bits_serves_it_at_8(checkpoint):
    ranks = [{"layers": [0, 8], "parameter_bytes": 0}]
    request = GenerationRequest(list(range(1, 200)), max_tokens=3000)
    whole = MemoryAdmission(read_config(checkpoint), ranks, [5_000_000], chunk=8, max_context=4096)
    quantized = MemoryAdmission(quantized_config(checkpoint, 8), ranks, [5_000_000], chunk=8, max_context=4096)
    assert "out of memory" in whole.refusal(request).lower()
    assert quantized.refusal(request) is None


def test_max_context_auto_counts_the_quantized_bytes():
    """--max-context auto under a --memory-limit: the embedded model's (float32) full-attention
    caches at 8 bits (1.25 bytes a value with group 32's scales) hold over three times the tokens."""
    contexts = []
    for extra in ([], ["--kv-bits", "8", "--kv-group-size", "32"]):
        proc = run_cli(["--prompt-ids", "1,2,3", "--max-tokens", "2", "--max-context", "auto", "--memory-limit", "32M",
                        *extra])
        assert proc.returncode == 0, proc.stderr[-2000:]
        contexts.append(int(re.search(r"max context: (\d+) tokens", proc.stderr).group(1)))
    assert contexts[1] > 3 * contexts[0]


def test_a_memory_limit_that_refuses_a_prompt_whole_serves_it_at_8_bits():
    """The embedded model under --memory-limit 11M, --max-context auto: 1,024 tokens with whole
    caches refuse a 1,500-token prompt before prefill; at 8 bits (3,328) it runs, as mlx-lm's parts do."""
    from distributed.shard.tiny_checkpoint import default_checkpoint

    prompt = [(7 * i + 3) % 2000 + 1 for i in range(1500)]
    args = ["--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "8", "--max-context", "auto",
            "--memory-limit", "11M"]
    refused = run_cli(args)
    assert refused.returncode != 0 and "exceeds the context of 1024 tokens" in refused.stderr, refused.stderr[-2000:]
    out = run_json([*args, "--kv-bits", "8", "--kv-group-size", "32"])
    ref = mlx_lm_greedy(default_checkpoint(), prompt, 8, 512, kv_bits=8, kv_group_size=32)[0]
    assert out["token_ids"][:len(ref)] == ref


def test_a_batch_of_quantized_caches_keeps_each_row(checkpoint):
    """merge, extend, filter and extract move whole positions: each row comes back as it went in."""
    rows = []
    for n in (5, 9, 3):
        c = QuantizedKVCache(GROUP, 8)
        c.update_and_fetch(mx.random.normal((1, 2, n, GROUP)), mx.random.normal((1, 2, n, GROUP)))
        rows.append(c)
    batch = BatchQuantizedKVCache.merge(rows[:2])
    batch.extend(BatchQuantizedKVCache.merge(rows[2:]))
    batch.filter(mx.array([2, 0]))
    for i, row in zip((0, 1), (rows[2], rows[0])):
        got = batch.extract(i)
        assert got.offset == row.offset
        for a, b in zip(got.keys + got.values, row.keys + row.values):
            assert mx.array_equal(a, b[..., :row.offset, :])
