"""The router (launch/router/) and re-planning (launch/replan.py) together, with real
processes in network namespaces: a stream runs through the launcher's router while a
host's link is cut for good. After the restarts on the same hosts fail, the ring is
re-planned over the rest and the stream is replayed there: the client sees a pause,
never an error, and exactly the tokens of an undisturbed run. When the model does not
fit without the lost host, the stream ends UNAVAILABLE naming it.

The hosts are test_replan_netns.py's (namespaces A, B, C on a bridge, reached through
an `--ssh` stand-in); the launcher, and so the router, runs here in the root namespace
and serves on this machine's loopback; rank 0 (in A) serves the router on A's bridge IP
(launch/router/command.py), the real path to a remote rank 0.
"""

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import free_port_range
from distributed.serving.proto import generation_pb2_grpc as pb_grpc
from grpc_stream import Stream
from reference import PROMPT, mlx_lm_greedy
from netns_hosts import RANK_ARGS, Launcher, assert_nothing_left, namespace_hosts, tight_memory_gb

pytestmark = pytest.mark.slow  # hosts cut off in network namespaces, rings replanned

LONG = 160  # tokens of the stream the cut interrupts
CUT_AFTER = 12  # tokens the stream has passed on before the cut
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def three_hosts(tmp_path):
    with namespace_hosts(tmp_path) as hosts:
        yield hosts


class RouterClient:
    """The test's gRPC client of the launcher's router."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def status(self):
        try:
            return self.health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError as e:
            return e.code()

    def wait_serving(self, launcher: Launcher, timeout: float = 240) -> None:
        end = time.monotonic() + timeout
        while self.status() != SERVING:
            assert launcher.proc.poll() is None, f"the launcher exited:\n{launcher.output()[-4000:]}"
            assert time.monotonic() < end, f"not SERVING within {timeout:.0f} s:\n{launcher.output()[-4000:]}"
            time.sleep(0.2)


def cut_mid_stream(hosts, name: str, client: RouterClient, stream: Stream, until, timeout: float = 240):
    """Cut `name`'s link once the stream has passed on CUT_AFTER tokens; record the router's
    health states until until(health) or the stream's end. Returns the tokens before the
    cut, the health states and the cut's time."""
    stream.wait_tokens(CUT_AFTER)
    health = [client.status()]  # before the cut: the router may notice it before our first poll
    before = len(stream.tokens)  # after the health call, which the stream outruns on a busy machine
    hosts.cut(name)
    cut_at = time.monotonic()
    while time.monotonic() < cut_at + timeout and not until(health) and stream.is_alive():
        status = client.status()
        if not health or health[-1] != status:
            health.append(status)
        time.sleep(0.02)
    return before, health, cut_at


def pause_after(stream: Stream, cut_at: float) -> float:
    """The longest wait for a response after the cut (tokens already on their way when the
    link went down still arrive at once)."""
    times = [cut_at] + [t for t in stream.arrivals if t > cut_at]
    return max(b - a for a, b in zip(times, times[1:]))


@pytest.mark.parametrize("lost", [1, 0])
def test_a_stream_survives_a_host_planned_out(three_hosts, hf_checkpoint, tmp_path, lost):
    """lost: the cut host's rank; rank 0's host lost moves rank 0 to the next host."""
    hosts = three_hosts
    name = hosts.names[lost]
    a, b, c = hosts.names
    rest = [n for n in hosts.names if n != name]
    reference = mlx_lm_greedy(hf_checkpoint, PROMPT, LONG, 2048)[0]
    hf = hosts.hostfile(tmp_path / "hosts.json", {n: 4 for n in hosts.names})
    address = f"127.0.0.1:{free_port_range(1)}"  # the router's, here
    launcher = Launcher(hosts, hf, tmp_path, "--restart", "1", "--", "run-trinity", "--model", str(hf_checkpoint),
                        "--serve", address, "--max-tokens-cap", "1024", *RANK_ARGS)
    client = RouterClient(address)
    try:
        client.wait_serving(launcher)
        assert f"rank 0 at {hosts.ips[a]}:" in launcher.output(), launcher.output()[-3000:]
        undisturbed = Stream(client.stub, token_ids=PROMPT, max_tokens=LONG, temperature=0.0)
        assert undisturbed.result()[0] == reference[:LONG]  # 3 hosts
        stream = Stream(client.stub, token_ids=PROMPT, max_tokens=LONG, temperature=0.0)
        before, health, cut_at = cut_mid_stream(hosts, name, client, stream,
                                                lambda h: NOT_SERVING in h and h[-1] == SERVING)
        assert before < LONG, "the stream ended before the cut"
        assert stream.result() == undisturbed.result()
        assert health[:1] == [SERVING] and NOT_SERVING in health and health[-1] == SERVING, health
        out = launcher.output()
        assert f"re-planned over 2 hosts: {rest[0]} layers 0-" in out and f", {rest[1]} layers " in out, out[-4000:]
        assert "launch: router: replayed a request after" in out, out[-4000:]
        if lost == 0:
            assert f"launch: router: rank 0 on {b} is called at {hosts.ips[b]}:" in out, out[-4000:]
        print(f"pause from the cut of {name}'s link (rank {lost}) to the next token: {pause_after(stream, cut_at):.1f} s")
        assert Stream(client.stub, token_ids=PROMPT, max_tokens=LONG, temperature=0.0).result() == \
            undisturbed.result()  # the next request, on the other two
        launcher.proc.send_signal(signal.SIGTERM)
        assert launcher.proc.wait(timeout=60) == 0, launcher.output()[-3000:]
    finally:
        client.channel.close()
        launcher.close()
    assert_nothing_left(hosts)


def test_a_stream_fails_naming_the_host_when_the_rest_cannot_hold_the_model(three_hosts, hf_checkpoint, tmp_path):
    hosts = three_hosts
    a, b, c = hosts.names
    gb = tight_memory_gb(hf_checkpoint)
    hf = hosts.hostfile(tmp_path / "hosts.json", {n: gb for n in hosts.names})
    address = f"127.0.0.1:{free_port_range(1)}"
    launcher = Launcher(hosts, hf, tmp_path, "--restart", "0", "--replan", "--", "run-trinity", "--model",
                        str(hf_checkpoint), "--serve", address, "--max-tokens-cap", "1024", *RANK_ARGS)
    client = RouterClient(address)
    try:
        client.wait_serving(launcher)
        stream = Stream(client.stub, token_ids=PROMPT, max_tokens=LONG, temperature=0.0)
        before, health, _ = cut_mid_stream(hosts, b, client, stream, lambda h: launcher.proc.poll() is not None)
        assert before < LONG, "the stream ended before the cut"
        stream.join(120)
        assert not stream.is_alive()
        assert stream.error is not None and stream.error.startswith("UNAVAILABLE: "), stream.error
        assert f"host {b} (rank 1) is gone" in stream.error and "does not fit" in stream.error, stream.error
        # What came before the failure is the greedy stream's start, and it stopped short: how many
        # tokens were still on their way when the link went down depends on the machine's load.
        assert stream.tokens == mlx_lm_greedy(hf_checkpoint, PROMPT, LONG, 2048)[0][:len(stream.tokens)]
        assert before <= len(stream.tokens) < LONG
        assert SERVING not in health[1:] and NOT_SERVING in health, health  # never serving again
        status = launcher.proc.wait(timeout=120)
        out = launcher.output()
        assert status != 0, out[-3000:]
        assert f"launch: error: host {b} (rank 1, {hosts.ips[b]}) is gone" in out, out[-3000:]
        assert "re-planned" not in out
    finally:
        client.channel.close()
        launcher.close()
    assert_nothing_left(hosts)
