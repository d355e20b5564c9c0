"""Two hosts as network namespaces joined by a veth pair: cut the link
mid-generation and the failure is as clean as a killed rank's.

Rank 0 runs in namespace A (10.77.0.1), rank 1 in B (10.77.0.2), ring backend,
started directly with MLX_RANK / MLX_HOSTFILE as mlx.launch would. Nothing is
killed: the link goes down, so no connection closes; only silence tells.
The gRPC client runs inside A (the server listens on A's loopback).
Needs root and `ip netns` (iproute2); skipped, saying why, where namespaces
cannot be made (e.g. an unprivileged container).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
from grpc_server import SERVER_ARGS, env

from conftest import ROOT, RUN, needs
from distributed.startup.watchdog import EXIT_PEER_FAILED
from reference import PROMPT

PEER_TIMEOUT = 2
EXIT_WITHIN_S = 15.0

CLIENT = """
import json, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from distributed.serving.proto import generation_pb2 as pb, generation_pb2_grpc as pb_grpc

channel = grpc.insecure_channel(sys.argv[1])
health = health_pb2_grpc.HealthStub(channel)
end = time.monotonic() + 180
while time.monotonic() < end:
    try:
        if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
            break
    except grpc.RpcError:
        pass
    time.sleep(0.1)
call = pb_grpc.GenerationStub(channel).Generate(
    pb.GenerateRequest(token_ids=json.loads(sys.argv[2]), max_tokens=1000), timeout=120)
out = {}
try:
    for i, _ in enumerate(call):
        if i == 0:
            print("first token", flush=True)
    out["finished"] = True
except grpc.RpcError as e:
    out.update(code=e.code().name, details=e.details())
    try:
        out["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(
            health.Check(health_pb2.HealthCheckRequest(), timeout=2).status)
    except grpc.RpcError as h:
        out["health"] = h.code().name
print(json.dumps(out), flush=True)
"""


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def two_hosts():
    """Namespaces A and B joined by veth (A: 10.77.0.1, B: 10.77.0.2); removed afterwards."""
    if os.geteuid() != 0:
        needs("root, for network namespaces")
    if shutil.which("ip") is None:
        needs("`ip` (iproute2)")
    tag = uuid.uuid4().hex[:6]  # other test runs on this machine make their own
    a, b, va, vb = f"trinA{tag}", f"trinB{tag}", f"tva{tag}", f"tvb{tag}"
    made = ip("netns", "add", a, check=False)
    if made.returncode != 0:
        needs(f"network namespaces (ip netns add: {made.stderr.strip()})")
    try:
        ip("netns", "add", b)
        probe = ip("netns", "exec", a, "true", check=False)
        if probe.returncode != 0:
            needs(f"network namespaces (ip netns exec: {probe.stderr.strip()})")
        ip("link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, dev, addr in ((a, va, "10.77.0.1/24"), (b, vb, "10.77.0.2/24")):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", addr, "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield a, b, va
    finally:
        ip("netns", "del", a, check=False)  # takes its end of the veth pair, and so the pair, with it
        ip("netns", "del", b, check=False)


def test_cut_link_mid_generation(two_hosts, hf_checkpoint, tmp_path):
    a, b, va = two_hosts
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.77.0.1:5000"], ["10.77.0.2:5000"]]))
    args = [sys.executable, RUN, "--model", str(hf_checkpoint), "--serve", "127.0.0.1:50051",
            *SERVER_ARGS, "--peer-timeout", str(PEER_TIMEOUT)]
    logs = [open(tmp_path / f"rank{r}.log", "w+") for r in range(2)]
    procs = [subprocess.Popen(["ip", "netns", "exec", ns, *args],
                              env=dict(env(), MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile)),
                              stdout=logs[r], stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
             for r, ns in enumerate((a, b))]
    client = subprocess.Popen(["ip", "netns", "exec", a, sys.executable, "-c", CLIENT, "127.0.0.1:50051",
                               json.dumps(PROMPT)], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, start_new_session=True)
    try:
        first = client.stdout.readline()
        output = lambda r: (tmp_path / f"rank{r}.log").read_text()  # noqa: E731
        assert first == "first token\n", (first, client.stderr.read() if client.poll() is not None else "",
                                          output(0), output(1))
        ip("-n", a, "link", "set", va, "down")
        cut_at = time.monotonic()
        reply = json.loads(client.stdout.readline())
        failed_after = time.monotonic() - cut_at
        codes = [p.wait(timeout=EXIT_WITHIN_S) for p in procs]
        exited_after = time.monotonic() - cut_at
        assert codes == [EXIT_PEER_FAILED, EXIT_PEER_FAILED], (codes, output(0), output(1))
        assert exited_after < EXIT_WITHIN_S
        assert reply["code"] == "UNAVAILABLE", reply
        assert "rank 1 (host " in reply["details"] and "stopped responding (no heartbeat" in reply["details"], reply
        assert reply["health"] in ("NOT_SERVING", "UNAVAILABLE"), reply  # UNAVAILABLE: rank 0 already gone
        assert "trinity: rank 1 (host" in output(0) and "trinity: rank 0 (host" in output(1)
        print(f"link cut: stream failed after {failed_after:.2f} s ({reply['details']}; health {reply['health']}), "
              f"both ranks exited {EXIT_PEER_FAILED} within {exited_after:.2f} s")
    finally:
        for p in (*procs, client):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
