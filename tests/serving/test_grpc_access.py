"""Who may call the gRPC service, and when: the auth token (reflection included), TLS,
the queue's bound (--max-batch 1, --max-queue 1), and health over a server's life.
Real `run_trinity.py --serve` processes on free ports; greedy output must equal the
one-shot command line's (`run_json`, 1 rank). The service's requests and outputs in
every configuration: test_grpc_service.py."""

import os
import signal
import threading
import time

import grpc
import pytest

from conftest import run_json
from grpc_server import (IDS, LONG, MAX_TOKENS, NOT_SERVING, SERVER_ARGS, SERVING, TOKEN, Server, assert_matches,
                         client, generate, openssl_cert, reflection_generate, rpc_error)
from distributed.serving.proto import generation_pb2 as pb
from reference import PROMPT


@pytest.fixture(scope="module")
def reference(hf_checkpoint):
    return run_json(["--model", str(hf_checkpoint), "--prompt-ids", IDS, "--max-tokens", str(MAX_TOKENS)])


@pytest.fixture(scope="module")
def secure_server(hf_checkpoint, reference, tmp_path_factory):
    """1 rank with --auth-token, --max-batch 1, --max-queue 1 and (where openssl exists) TLS."""
    tls = openssl_cert(tmp_path_factory.mktemp("tls"))
    extra = ["--auth-token", TOKEN, "--max-batch", "1", "--max-queue", "1"]
    credentials = None
    if tls:
        extra += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
        credentials = grpc.ssl_channel_credentials(tls[0].read_bytes())
    s = Server(hf_checkpoint, 1, extra, credentials=credentials)
    s.cert = tls[0] if tls else None
    try:
        s.wait_serving()
        yield s
    finally:
        s.stop()


# ---------------------------------------------------------------- auth, TLS, queue


def test_auth_token_required_except_for_health(secure_server, reference):
    s = secure_server
    wrong, right = [("authorization", "Bearer nope")], [("authorization", f"Bearer {TOKEN}")]
    for metadata in (None, wrong, [("authorization", TOKEN)]):
        error = rpc_error(generate, s.stub, token_ids=PROMPT, max_tokens=4, metadata=metadata)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
        error = rpc_error(s.stub.GetModelInfo, pb.GetModelInfoRequest(), timeout=30, metadata=metadata)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
    assert_matches(generate(s.stub, token_ids=PROMPT, max_tokens=4, metadata=right), reference, 4)
    assert s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, metadata=right).vocab_size == 259
    assert s.health_status() == SERVING and s.health_status("") == SERVING  # open: probes need no secret
    # Reflection is protected too; over TLS the standard access-token credentials carry the token.
    error = rpc_error(reflection_generate, s.channel, {"token_ids": PROMPT, "max_tokens": 2})
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    if s.cert:
        channel = grpc.secure_channel(s.address, grpc.composite_channel_credentials(
            s.credentials, grpc.access_token_call_credentials(TOKEN)))
        with channel:
            _, responses = reflection_generate(channel, {"token_ids": PROMPT, "max_tokens": 2})
        assert [t for r in responses for t in r.token_ids] == reference["token_ids"][:2]


def test_client_command_line_with_token_and_tls(secure_server, reference):
    s = secure_server
    target = ["--target", s.address, *(["--tls-ca", str(s.cert)] if s.cert else [])]
    request = ["--token-ids", IDS, "--max-tokens", str(MAX_TOKENS)]
    streamed = client(*target, *request, "--auth-token", TOKEN)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == reference["text"] + "\n"
    assert f"[length: 40 prompt + {MAX_TOKENS} completion tokens" in streamed.stderr
    denied = client(*target, *request, "--json")
    assert denied.returncode == 1 and "error: UNAUTHENTICATED:" in denied.stderr
    bad = client(*target, "--prompt", "hi", "--top-p", "2", env_token=TOKEN)  # the token from the environment
    assert bad.returncode == 1 and "error: INVALID_ARGUMENT: top_p:" in bad.stderr
    info = client(*target, "--info", env_token=TOKEN)
    assert info.returncode == 0 and "rank 0 (" in info.stdout and "layers [0, 8) + embedding and head" in info.stdout


def test_queue_overflow_is_resource_exhausted(secure_server, reference):
    """--max-batch 1, --max-queue 1: one request running, one waiting, the next refused.
    The running request holds the only batch slot until the test cancels it (greedy,
    it would run ~400 tokens to EOS), so neither other request can leave the queue:
    whichever arrives second is refused, whatever the timing."""
    meta = [("authorization", f"Bearer {TOKEN}")]
    assert secure_server.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=meta, timeout=30).max_batch == 1
    running = secure_server.stub.Generate(pb.GenerateRequest(token_ids=PROMPT, max_tokens=LONG), metadata=meta, timeout=120)
    next(running)  # it has left the queue and is generating
    results = [None, None]

    def waiting(i):
        try:
            results[i] = generate(secure_server.stub, token_ids=PROMPT, max_tokens=8, metadata=meta)
        except grpc.RpcError as e:
            results[i] = e

    threads = [threading.Thread(target=waiting, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    while not any(isinstance(r, grpc.RpcError) for r in results) and any(t.is_alive() for t in threads):
        time.sleep(0.01)
    still_running = not running.done()
    running.cancel()
    for t in threads:
        t.join(timeout=120)
    errors = [r for r in results if isinstance(r, grpc.RpcError)]
    assert still_running, f"the running request ended before the test cancelled it: {results}"
    assert len(errors) == 1 and errors[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED, results
    assert "retry" in errors[0].details()
    served = [r for r in results if isinstance(r, dict)]
    assert len(served) == 1
    assert_matches(served[0], reference, 8)


def test_a_full_batch_streams_at_once_beyond_32_threads(hf_checkpoint):
    """--max-batch 40 with --max-queue 1: all 40 streams run together. (The server's thread
    pool once held --max-queue + 32 calls: the 34th stream waited, unseen, in gRPC's own
    queue until another ended.)"""
    s = Server(hf_checkpoint, 1, SERVER_ARGS + ["--max-batch", "40", "--max-queue", "1"])
    try:
        s.wait_serving()
        firsts, ends, errors = [], [], []

        def stream():
            try:
                call = s.stub.Generate(pb.GenerateRequest(token_ids=PROMPT, max_tokens=LONG), timeout=300)
                next(call)
                firsts.append(time.monotonic())
                for _ in call:
                    pass
                ends.append(time.monotonic())
            except grpc.RpcError as e:
                errors.append(e)

        threads = [threading.Thread(target=stream) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors and len(firsts) == len(ends) == 40, errors
        assert max(firsts) < min(ends), "a stream had to wait for another to end before it started"
    finally:
        s.stop()


# ---------------------------------------------------------------- health over the lifetime


def test_health_before_load_after_load_and_after_a_rank_dies(hf_checkpoint, reference):
    """NOT_SERVING while loading, SERVING, NOT_SERVING once a rank dies. The two
    ranks are started by hand, with the environment mlx.launch gives them:
    mlx.launch itself SIGTERMs every rank within ~1 s of one dying, which races
    with what rank 0 reports (see the next test)."""
    s = Server(hf_checkpoint, 2, SERVER_ARGS + ["--peer-timeout", "30"], manual=True)
    try:
        # Rank 0 listens before it joins rank 1 and loads; it cannot finish (startup check,
        # rank map) while rank 1 is stopped, so "loading" lasts as long as the test needs.
        # Rank 1 stops at once: stopped only once rank 0's port was open, it had sometimes
        # joined already, and rank 0 sat in the ring's init, which holds the GIL (health
        # checks timed out).
        os.kill(s.procs[1].pid, signal.SIGSTOP)
        try:
            s.wait_port()
            assert s.health_status() == NOT_SERVING and s.health_status("") == NOT_SERVING
            for call in (lambda: generate(s.stub, token_ids=PROMPT, max_tokens=4),
                         lambda: s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)):
                error = rpc_error(call)
                assert error.code() == grpc.StatusCode.UNAVAILABLE and error.details() == "model is loading"
        finally:
            os.kill(s.procs[1].pid, signal.SIGCONT)
        assert s.wait_serving()[-1] == SERVING and s.health_status("") == SERVING
        assert_matches(generate(s.stub, token_ids=PROMPT, max_tokens=4), reference, 4)

        # Killed mid-stream: the watchdog names the rank, health turns
        # NOT_SERVING, and rank 0 exits non-zero.
        call = s.stub.Generate(pb.GenerateRequest(token_ids=PROMPT, max_tokens=LONG), timeout=120)
        assert next(call).token_ids[0] == reference["token_ids"][0]
        os.kill(s.procs[1].pid, signal.SIGKILL)
        error = rpc_error(list, call)
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "rank 1 (host " in error.details(), error
        assert s.health_status() in (NOT_SERVING, grpc.StatusCode.UNAVAILABLE)
        assert s.procs[0].wait(timeout=15) != 0
    finally:
        s.stop()

