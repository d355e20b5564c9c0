"""The prefix cache's disk tier on real servers (startup/disk_tier.py opens it from the command
line): a prompt served, the ring stopped and started again, and the same prompt and one sharing
its prefix restore most of it from every rank's disk, with mlx-lm's greedy tokens and logprobs:
--stages 2, a ring of two under our launcher, --tensor-parallel-size 2, and through the launcher's
router."""

import pytest

from grpc_server import SERVER_ARGS, Server, generate
from reference import mlx_lm_greedy

pytestmark = pytest.mark.slow

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(330)]  # past disk_cache's smallest entry, windows wrapped
SHARED = PROMPT[:300] + [(11 * i + 5) % 250 + 1 for i in range(12)]
MAX_TOKENS = 8


def served(model, ranks, extra, folder, prompts):
    """Each prompt's greedy output (token ids, logprobs, cached tokens) from a new server."""
    server = Server(model, ranks, [*SERVER_ARGS, "--prefix-cache-dir", str(folder), *extra])
    try:
        server.wait_serving()
        outs = []
        for prompt in prompts:
            out = generate(server.stub, token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
            outs.append((out["token_ids"], out["logprobs"], out["usage"].cached_tokens))
    finally:
        server.stop()
    return outs, server.output(100000)


@pytest.fixture(scope="module")
def references(hf_checkpoint):
    return {tuple(p): mlx_lm_greedy(hf_checkpoint, p, MAX_TOKENS, 512) for p in (PROMPT, SHARED)}


# One process with one stage takes the same start-up branch as --stages 2 (and the same runtime as the
# in-process tests of tests/runtime/test_prefix_cache.py, which also cover another split finding nothing).
@pytest.mark.parametrize("ranks, extra", [(1, ["--stages", "2"]), (2, []), (2, ["--tensor-parallel-size", "2"])],
                         ids=["stages2", "ranks2", "tensor2"])
def test_a_restarted_server_restores_from_disk(hf_checkpoint, references, tmp_path, ranks, extra):
    (first,), log = served(hf_checkpoint, ranks, extra, tmp_path, [PROMPT])
    assert first[2] == 0
    outs, log = served(hf_checkpoint, ranks, extra, tmp_path, [PROMPT, SHARED])
    for (tokens, logprobs, cached), prompt in zip(outs, (PROMPT, SHARED)):
        ref_tokens, ref_logprobs = references[tuple(prompt)]
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4
    assert outs[0][2] == len(PROMPT) - 1, log  # all but the last token, read from disk
    # The shared part, from disk again: the first read only the windows at its own cut
    # (caches.Stored.from_file), so its RAM entry is cut there or later only.
    assert outs[1][2] == 300
    assert "disk tier: 2 loads" in log


def test_through_the_launchers_router_after_a_full_restart(hf_checkpoint, references, tmp_path):
    """`trinity-launch run` (its router in front, the default path) stopped and started again:
    the router's HTTP port gives the same prompt back from every rank's disk, exactly."""
    import openai

    from router_launcher import Launcher, serving

    outs = []
    for attempt in range(2):
        la = Launcher(hf_checkpoint, tmp_path / f"launch{attempt}.log", 2,
                      serve_args=["--prefix-cache-dir", str(tmp_path / "cache")])
        with serving(la):
            client = openai.OpenAI(base_url=f"http://{la.http}/v1", api_key="none", max_retries=0, timeout=120)
            r = client.completions.create(model=str(hf_checkpoint), prompt=PROMPT, max_tokens=MAX_TOKENS,
                                          temperature=0, logprobs=1)
            outs.append((r.choices[0].logprobs.token_logprobs, r.usage.prompt_tokens_details.cached_tokens))
    ref_logprobs = references[tuple(PROMPT)][1]
    for logprobs, _ in outs:
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4
    assert [cached for _, cached in outs] == [0, len(PROMPT) - 1]
