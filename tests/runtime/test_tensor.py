"""--tensor-parallel-size T (shard/tensor.py, runtime/tensor.py): every rank holds 1/T of every
layer. Real rings: greedy tokens and logprobs equal one-device mlx-lm's, with a history past
the sliding window (window 16, a 40-token prompt), through the command line and gRPC."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import RUN, one_error_line, run_cli, run_json, run_trinity, system_mpirun
from distributed import TrinityError
from distributed.shard.config import model_args
from distributed.shard.tensor import check_tensor_size
from distributed.startup.settings import RingSettings
from distributed.startup.tensor_start import check_tensor_args
from distributed.shard.tiny_checkpoint import make_checkpoint, tiny_config
from reference import PROMPT, mlx_lm_greedy

pytestmark = pytest.mark.slow  # about fifteen rings of 2-4 ranks, each splitting every layer

IDS = ",".join(map(str, PROMPT))
MAX_TOKENS = 12
STEP_TOKENS = 8  # --max-step-tokens of the served ring


@pytest.fixture(scope="module")
def kv4_checkpoint(tmp_path_factory) -> Path:
    """The tiny model with 4 KV heads (one per query head), so T = 4 splits it."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_kv4"), layout="hf", seed=1, num_key_value_heads=4)


@pytest.fixture(scope="module")
def quantized_checkpoint(tmp_path_factory) -> Path:
    """4-bit (groups of 64) with widths whose halves are whole groups."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_q"), layout="mlx", seed=2, head_dim=32,
                           moe_intermediate_size=128, intermediate_size=256)


def assert_reference(out, path, prompt=PROMPT, max_tokens=MAX_TOKENS):
    tokens, logprobs = mlx_lm_greedy(Path(path), prompt, max_tokens, 512)
    assert out["token_ids"] == tokens
    assert max(abs(a - b) for a, b in zip(out["logprobs"], logprobs)) < 1e-5


def test_check_tensor_size_names_the_numbers():
    args = model_args(tiny_config())  # 4 heads, 2 KV heads, widths 128 / 64
    check_tensor_size(args, 1)
    check_tensor_size(args, 2)
    with pytest.raises(TrinityError, match=r"--tensor-parallel-size 4 must divide KV heads \(num_key_value_heads\) = 2"):
        check_tensor_size(args, 4)
    with pytest.raises(TrinityError, match=r"attention heads \(num_attention_heads\) = 4, KV heads .* = 2"):
        check_tensor_size(args, 3)
    with pytest.raises(TrinityError, match="whole groups of 64.*o_proj input .* / 2 = 32"):
        check_tensor_size(args, 2, {"group_size": 64, "bits": 4})


def test_refused_without_its_ranks(hf_checkpoint):
    line = one_error_line(*run_trinity(["--model", str(hf_checkpoint), "--prompt-ids", IDS,
                                        "--tensor-parallel-size", "2"]))
    assert "--tensor-parallel-size 2 needs 2 ranks" in line


def test_ring_of_two_equals_mlx_lm(hf_checkpoint):
    out = run_json(["--model", str(hf_checkpoint), "--prompt-ids", IDS, "--max-tokens", str(MAX_TOKENS),
                    "--tensor-parallel-size", "2"], ranks=2)
    assert_reference(out, hf_checkpoint)
    one = run_json(["--model", str(hf_checkpoint), "--prompt-ids", IDS, "--max-tokens", "1"])["ranks"][0]
    ranks = out["ranks"]
    assert [(r["rank"], r["layers"], r["embed"], r["head"]) for r in ranks] == [(0, [0, 8], True, True),
                                                                                 (1, [0, 8], True, False)]
    assert [r["tensor"] for r in ranks] == SHARES  # each rank's heads and its slice of every expert
    # Each rank holds half of every layer, and the (replicated) embedding and head whole.
    assert ranks[0]["parameter_bytes"] == ranks[1]["parameter_bytes"] < 0.6 * one["parameter_bytes"]


def test_a_prompt_longer_than_one_broadcast_buffer(hf_checkpoint):
    """120 token ids in one frame: the broadcast's second all_sum carries those past its inline 51."""
    prompt = PROMPT * 3
    out = run_json(["--model", str(hf_checkpoint), "--prompt-ids", ",".join(map(str, prompt)),
                    "--max-tokens", str(MAX_TOKENS), "--tensor-parallel-size", "2"], ranks=2)
    assert_reference(out, hf_checkpoint, prompt)


def test_ring_of_four_equals_mlx_lm(kv4_checkpoint):
    # 4 tokens: on 2 cores every step of 4 ranks all-reducing twice a layer is slow, and the prompt
    # (in 16-token chunks) already runs past the sliding window
    out = run_json(["--model", str(kv4_checkpoint), "--prompt-ids", IDS, "--max-tokens", "4",
                    "--tensor-parallel-size", "4", "--prefill-step-size", "16"], ranks=4)
    assert_reference(out, kv4_checkpoint, max_tokens=4)
    assert [r["tensor"] for r in out["ranks"]] == [
        {"rank": r, "size": 4, "heads": [r, r + 1], "kv_heads": [r, r + 1], "experts": 8, "expert_width": [16 * r, 16 * r + 16]}
        for r in range(4)]


def test_quantized_ring_of_two_equals_mlx_lm(quantized_checkpoint):
    prompt = PROMPT[::-1]
    out = run_json(["--model", str(quantized_checkpoint), "--prompt-ids", ",".join(map(str, prompt)),
                    "--max-tokens", str(MAX_TOKENS), "--tensor-parallel-size", "2"], ranks=2)
    assert_reference(out, quantized_checkpoint, prompt)


def test_a_size_that_does_not_divide_is_refused(hf_checkpoint):
    proc = run_cli(["--model", str(hf_checkpoint), "--prompt-ids", IDS, "--tensor-parallel-size", "3"], ranks=3)
    assert proc.returncode != 0 and proc.stdout == ""
    assert "--tensor-parallel-size 3 must divide attention heads (num_attention_heads) = 4, KV heads " \
           "(num_key_value_heads) = 2" in proc.stderr, proc.stderr[-3000:]


def test_groups_need_a_backend_that_splits(hf_checkpoint):
    """T < N: groups of T ranks made with Group.split, which the ring backend refuses."""
    proc = run_cli(["--model", str(hf_checkpoint), "--prompt-ids", IDS, "--tensor-parallel-size", "2"], ranks=4)
    assert proc.returncode != 0
    assert "--tensor-parallel-size 2 with 4 ranks makes 2 groups of 2 with mx.distributed.Group.split, which the " \
           "ring backend refuses" in proc.stderr, proc.stderr[-3000:]


def test_a_size_must_divide_the_ranks():
    """Every rank checks the launch before it loads anything (a 3-rank run would only print this)."""
    with pytest.raises(TrinityError, match="--tensor-parallel-size 2 must divide the number of ranks, 3"):
        check_tensor_args(RingSettings(tensor_parallel_size=2), 3)
    with pytest.raises(TrinityError, match="--tensor-parallel-size 2 needs 2 ranks"):
        check_tensor_args(RingSettings(tensor_parallel_size=2), 1)
    assert check_tensor_args(RingSettings(tensor_parallel_size=2), 4) == 2


def test_mpi_two_groups_of_two_equal_mlx_lm(hf_checkpoint):
    """T = 2 of N = 4 (MPI splits the group): two pipeline stages, each two ranks holding half of its
    layers; a 120-token prompt (its hidden states past MPI's eager limit between the stages)."""
    prompt = PROMPT * 3
    out = run_json(["--model", str(hf_checkpoint), "--prompt-ids", ",".join(map(str, prompt)),
                    "--max-tokens", str(MAX_TOKENS), "--tensor-parallel-size", "2"], ranks=4, backend="mpirun")
    assert_reference(out, hf_checkpoint, prompt)
    assert [(r["rank"], r["layers"], r["embed"], r["head"], r["tensor"]) for r in out["ranks"]] == [
        (0, [0, 4], True, True, SHARES[0]), (1, [0, 4], True, False, SHARES[1]),
        (2, [4, 8], False, False, SHARES[0]), (3, [4, 8], False, False, SHARES[1])]


def test_mpi_equals_mlx_lm(hf_checkpoint):
    """T = 2 under mpirun (T = 4: the ring of four above; four MPI ranks: the two groups of two below)."""
    out = run_json(["--model", str(hf_checkpoint), "--prompt-ids", IDS, "--max-tokens", str(MAX_TOKENS),
                    "--tensor-parallel-size", "2"], ranks=2, backend="mpirun")
    assert_reference(out, hf_checkpoint)


SHARES = [{"rank": r, "size": 2, "heads": [2 * r, 2 * r + 2], "kv_heads": [r, r + 1], "experts": 8,
           "expert_width": [32 * r, 32 * r + 32]} for r in range(2)]  # the tiny model: 4 / 2 heads, 8 experts 64 wide


def test_serving_equals_mlx_lm(hf_checkpoint):
    from grpc_server import SERVER_ARGS, Server, generate

    prompts = [PROMPT, PROMPT[5:], PROMPT[:20]]
    refs = [mlx_lm_greedy(hf_checkpoint, p, MAX_TOKENS, 512) for p in prompts]
    server = Server(hf_checkpoint, ranks=2, extra=["--tensor-parallel-size", "2", "--max-step-tokens", str(STEP_TOKENS),
                                                   *SERVER_ARGS, "--http", "127.0.0.1:0"])
    try:
        server.wait_serving()
        assert_shares_shown(server)
        assert_budget_beside_decoding(server, hf_checkpoint)
        for _ in range(2):  # the second time, from the prefix cache
            out = generate(server.stub, token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
            assert out["token_ids"] == refs[0][0]
            assert max(abs(a - b) for a, b in zip(out["logprobs"], refs[0][1])) < 1e-5
        with ThreadPoolExecutor(len(prompts)) as pool:  # batched: merged, filtered as rows end
            outs = list(pool.map(lambda p: generate(server.stub, token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0),
                                 prompts))
        for out, (tokens, logprobs) in zip(outs, refs):
            assert out["token_ids"] == tokens
            assert max(abs(a - b) for a, b in zip(out["logprobs"], logprobs)) < 1e-5
        assert_constrained(server, hf_checkpoint)
        server.alive()
    finally:
        server.stop()


def assert_budget_beside_decoding(server, hf_checkpoint):
    """--max-step-tokens at T = 2: a prompt arriving while a request decodes goes in chunks of at most
    the budget (as /v1/status counts them) and still gets mlx-lm's tokens."""
    import json
    import urllib.request

    from distributed.serving.proto import generation_pb2 as pb
    from grpc_server import LONG, generate

    def budget():
        host, port = server.http_address()
        with urllib.request.urlopen(f"http://{host}:{port}/v1/status", timeout=30) as r:
            return json.loads(r.read())["requests"]["step_budget"]

    fresh = PROMPT[::-1] + PROMPT[:30]  # 70 tokens no entry holds
    before = budget()
    running = server.stub.Generate(pb.GenerateRequest(token_ids=PROMPT[3:], max_tokens=LONG), timeout=120)
    next(running)
    out = generate(server.stub, token_ids=fresh, max_tokens=6)
    running.cancel()
    assert_reference(out, hf_checkpoint, fresh, 6)
    after = budget()
    assert after["tokens"] == STEP_TOKENS and after["fixed"]
    assert after["carried_tokens"] - before["carried_tokens"] >= len(fresh) - 1
    assert 0 < after["largest_chunk"] <= STEP_TOKENS, after


def assert_constrained(server, hf_checkpoint):
    """Constrained decoding at T = 2: greedy under a JSON schema is mlx-lm's masked by llguidance
    itself; a sampled regex always matches."""
    import json
    import re

    from distributed.runtime.grammar import json_schema_grammar
    from grpc_server import generate
    from reference import mlx_lm_masked_greedy

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["n"], "additionalProperties": False}
    reference = mlx_lm_masked_greedy(hf_checkpoint, PROMPT, json_schema_grammar(schema), 40)
    out = generate(server.stub, token_ids=PROMPT, max_tokens=40, json_schema=json.dumps(schema))
    assert out["token_ids"] == reference and json.loads(out["text"])["n"] >= 0
    for seed in range(2):
        out = generate(server.stub, token_ids=PROMPT, max_tokens=20, temperature=1.3, seed=seed, regex=r"[0-9]{3}-[ab]+")
        assert re.fullmatch(r"[0-9]{3}-[ab]+", out["text"]) or out["finish_reason"] == "length", out


def assert_shares_shown(server):
    """Each rank's heads and experts: in GetModelInfo, /v1/status, and drawn on the status page."""
    import json
    import urllib.request

    from browser import Browser, page_state, ranks
    from distributed.serving.proto import generation_pb2 as pb

    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert [(r.tensor.rank, r.tensor.size, r.tensor.head_start, r.tensor.head_end, r.tensor.kv_head_start,
             r.tensor.kv_head_end, r.tensor.experts, r.tensor.expert_width_start, r.tensor.expert_width_end)
            for r in info.ranks] == [(t["rank"], t["size"], *t["heads"], *t["kv_heads"], t["experts"], *t["expert_width"])
                                     for t in SHARES]
    host, port = server.http_address()
    with urllib.request.urlopen(f"http://{host}:{port}/v1/status", timeout=30) as r:
        assert [row["tensor"] for row in json.loads(r.read())["ranks"]] == SHARES
    browser = Browser()
    try:
        browser.open(f"http://{host}:{port}/")
        browser.wait(lambda: page_state(browser) == "serving" and len(ranks(browser)) == 2, "the ring drawn")
        texts = [box["text"] for box in ranks(browser)]
        assert "tensor 0/2 · heads [0, 2) · KV [0, 1) · 8 experts, width [0, 32)" in texts[0], texts
        assert "tensor 1/2 · heads [2, 4) · KV [1, 2) · 8 experts, width [32, 64)" in texts[1], texts
        bars = browser.js("return [...document.querySelectorAll('.share-bar span')].map((n) => n.style.left)")
        assert bars == ["0%", "50%"]  # each rank's half of the heads, to scale
        assert browser.console_errors() == []
    finally:
        browser.close()


def test_mpi_two_groups_of_two_serve_a_batch(hf_checkpoint, tmp_path):
    """--serve with T = 2 of N = 4 under mpirun: four requests at once (batched, a step and a
    prompt chunk sent as two frames where the pipeline mixes them), twice (prefix-cache hits)."""
    import os
    import re
    import subprocess
    import sys
    import time

    import grpc

    from conftest import ROOT, kill_group
    from distributed.serving.proto import generation_pb2_grpc as pb_grpc
    from grpc_server import generate

    log = tmp_path / "serve.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with open(log, "w") as out:
        proc = subprocess.Popen([system_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "4", sys.executable,
                                 RUN, "--model", str(hf_checkpoint), "--tensor-parallel-size", "2", "--serve",
                                 "127.0.0.1:0", "--max-context", "2048"], stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (m := re.search(r"serving \S+ on (\S+) \(gRPC\)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(m.group(1)))
        prompts = [PROMPT, PROMPT[5:], PROMPT[:20], PROMPT * 2]
        refs = [mlx_lm_greedy(hf_checkpoint, p, MAX_TOKENS, 512) for p in prompts]
        for _ in range(2):
            with ThreadPoolExecutor(len(prompts)) as pool:
                outs = list(pool.map(lambda p: generate(stub, token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0,
                                                        timeout=90), prompts))
            for out, (tokens, logprobs) in zip(outs, refs):
                assert out["token_ids"] == tokens
                assert max(abs(a - b) for a, b in zip(out["logprobs"], logprobs)) < 1e-5
    finally:
        kill_group(proc)


def test_memory_limit_refuses_a_frame_and_the_group_serves_on(hf_checkpoint):
    """--memory-limit under T = 2: both ranks plan with the limit; a prompt whose frames outgrow it
    is refused by rank 0 before a frame the followers would run (RESOURCE_EXHAUSTED), the group
    stays in step, and the next request is served exactly."""
    import grpc

    from distributed.serving.proto import generation_pb2 as pb
    from grpc_server import Server, generate

    limit = 3_500_000  # a rank's weights (~2.0 MB) and about a thousand tokens of caches and frames
    server = Server(hf_checkpoint, ranks=2, extra=["--tensor-parallel-size", "2", "--memory-limit", str(limit),
                                                   "--max-context", "2048", "--max-batch", "1",
                                                   "--prefix-cache-bytes", "0"])
    try:
        server.wait_serving()
        info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert [(r.memory_bytes, r.memory_limited) for r in info.ranks] == [(limit, True)] * 2
        with pytest.raises(grpc.RpcError) as e:
            generate(server.stub, token_ids=[5 + i % 50 for i in range(1800)], max_tokens=4, temperature=0.0)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "out of memory on rank 0" in e.value.details()
        tokens, logprobs = mlx_lm_greedy(hf_checkpoint, PROMPT, MAX_TOKENS, 512)
        out = generate(server.stub, token_ids=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
        assert out["token_ids"] == tokens
        assert max(abs(a - b) for a, b in zip(out["logprobs"], logprobs)) < 1e-5
        server.alive()
    finally:
        server.stop()


def test_speculation_equals_mlx_lm(hf_checkpoint):
    """Prompt lookup at T = 2, far past the window: drafts verified by the group, the rejected ones
    trimmed on both ranks (a broadcast TRIM), the greedy output and logprobs as without."""
    tokens, logprobs = mlx_lm_greedy(hf_checkpoint, PROMPT, 100, 8)
    out = run_json(["--model", str(hf_checkpoint), "--prompt-ids", IDS, "--max-tokens", "100", "--prompt-lookup",
                    "--speculate", "always", "--num-draft-tokens", "3", "--tensor-parallel-size", "2"], ranks=2)
    assert out["token_ids"] == tokens
    assert max(abs(a - b) for a, b in zip(out["logprobs"], logprobs)) < 1e-4
    spec = out["speculative"]
    assert spec["passes"] > 0 and 0 < spec["accepted"] < spec["drafted"], spec  # some drafts taken, some trimmed
