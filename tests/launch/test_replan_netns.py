"""A host that stays gone: `launch run` plans it out and the ring goes on with the rest
(launch/replan.py), with real processes in network namespaces (tests/netns_hosts.py:
hosts A, B, C on a bridge, reached through an `--ssh` stand-in; cutting a host's link
makes it silent for the ranks and for the launcher's probe alike).
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, free_port_range
from launch.replan import make_plan
from launch import hostfile
from netns_hosts import CONTEXT, RANK_ARGS, Hosts, Launcher, assert_nothing_left, model_sizes, namespace_hosts, \
    tight_memory_gb
from reference import PROMPT, mlx_lm_greedy

pytestmark = pytest.mark.slow  # hosts cut off in network namespaces, rings replanned

MAX_TOKENS = 8

CLIENT = """
import json, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from distributed.serving.proto import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
address, prompt, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
channel = grpc.insecure_channel(address)
health, stub = health_pb2_grpc.HealthStub(channel), pb_grpc.GenerationStub(channel)
while True:  # the test's timeout ends us
    try:
        if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
            tokens = [t for r in stub.Generate(pb.GenerateRequest(token_ids=prompt, max_tokens=max_tokens,
                                                                  temperature=0.0), timeout=60) for t in r.token_ids]
            print(json.dumps(tokens), flush=True)
            break
    except grpc.RpcError:
        pass
    time.sleep(0.3)
"""


@pytest.fixture
def three_hosts(tmp_path):
    with namespace_hosts(tmp_path) as hosts:
        yield hosts


def generate(hosts: Hosts, ns: str, address: str, timeout: float = 180):
    """A greedy request from inside namespace `ns` (rank 0 serves on its loopback),
    retried until the ring serves; its tokens."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, address, json.dumps(PROMPT),
                           str(MAX_TOKENS)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_a_host_whose_link_stays_cut_is_planned_out(three_hosts, hf_checkpoint, tmp_path):
    hosts = three_hosts
    a, b, c = hosts.names
    reference = mlx_lm_greedy(hf_checkpoint, PROMPT, MAX_TOKENS, 2048)[0]
    # B's memory unknown: the first ring plans at start-up (--split auto); without B the
    # launcher knows every host's memory and plans the split itself.
    hf = hosts.hostfile(tmp_path / "hosts.json", {a: 4, c: 4})
    address = f"127.0.0.1:{free_port_range(1)}"  # on rank 0's (A's) loopback
    # --no-router: rank 0's own front end, in A (test_router_replan.py has the router's case).
    launcher = Launcher(hosts, hf, tmp_path, "--restart", "1", "--no-router", "--", "run-trinity", "--model", str(hf_checkpoint),
                        "--serve", address, *RANK_ARGS)
    try:
        assert generate(hosts, a, address) == reference  # 3 hosts
        out = launcher.output()
        assert "--split auto" in out and "started rank 2 on " + c in out, out[-3000:]
        hosts.cut(b)
        launcher.wait_for("re-planned over 2 hosts", timeout=120)
        assert generate(hosts, a, address) == reference  # 2 hosts, the next request
        out = launcher.output()
        line = next(x for x in out.splitlines() if "re-planned over" in x)
        assert line.startswith(f"launch: host {b} (rank 1, {hosts.ips[b]}) is gone after 1 restart ("), line
        planned = make_plan(*model_sizes(hf_checkpoint), hostfile.parse([
            {"ssh": n, "ips": [hosts.ips[n]], "memory_gb": 4} for n in (a, c)]), CONTEXT, 0.1)
        assert planned.fits and line.endswith(f"re-planned over 2 hosts: {a} layers 0-{planned.split[0] - 1}, "
                                              f"{c} layers {planned.split[0]}-7"), line
        after = out.split(line)[1]
        assert f"started rank 1 on {c} over ssh" in after and "started rank 2" not in after, after
        assert "attempt 1/2: starting the ring" in out.split(line)[1], "no fresh budget after re-planning"
        launcher.proc.send_signal(signal.SIGTERM)
        assert launcher.proc.wait(timeout=60) == 0, launcher.output()[-3000:]
        assert_nothing_left(hosts)
        print(out)
    finally:
        launcher.close()


def test_the_model_does_not_fit_without_the_lost_host(three_hosts, hf_checkpoint, tmp_path):
    hosts = three_hosts
    a, b, c = hosts.names
    gb = tight_memory_gb(hf_checkpoint)
    hf = hosts.hostfile(tmp_path / "hosts.json", {n: gb for n in hosts.names})
    hosts.cut(b)  # gone before the start, for good
    launcher = Launcher(hosts, hf, tmp_path, "--restart", "0", "--replan", "--", "run-trinity", "--model",
                        str(hf_checkpoint), "--prompt-ids", "1,2,3", "--max-tokens", "2", *RANK_ARGS)
    try:
        status = launcher.proc.wait(timeout=120)
        out = launcher.output()
        assert status != 0, out[-3000:]
        errors = [x for x in out.splitlines() if x.startswith("launch: error: ")]
        assert len(errors) == 1, out[-3000:]
        assert errors[0].startswith(f"launch: error: host {b} (rank 1, {hosts.ips[b]}) is gone at the first failure (no answer at "), \
            errors[0]
        assert "): the model does not fit on the other 2 hosts: " in errors[0] and "missing" in errors[0], errors[0]
        assert "re-planned" not in out
        assert_nothing_left(hosts)
    finally:
        launcher.close()
