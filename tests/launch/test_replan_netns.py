"""A host that stays gone: `launch run` plans it out and the ring goes on with the rest
(launch/replan.py), with real processes in network namespaces.

Three "hosts" A, B, C are network namespaces on one bridge (10.79.X.1-3; this
machine is 10.79.X.254 on the bridge, so the launcher's probe goes over the same
links as the ring). The launcher runs here and reaches the hosts through an `--ssh`
stand-in that runs the remote command inside the host's namespace (`ip netns exec`),
so SshRing, its wrapper script and its signals over stdin are the real ones; only
ssh's transport is replaced. Cutting a host's link (its veth down) makes it silent
for the ranks and for the probe alike.

Names (trp…) and the subnet (10.79.X.0/24, X random) are apart from
tests/startup/test_netns.py's (trin…, 10.77.0.0/24). Needs root and iproute2
(skipped, saying why, where namespaces cannot be made).
"""

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, free_port_range
from distributed.shard import checkpoint
from launch.replan import make_plan
from launch import hostfile
from reference import PROMPT, mlx_lm_greedy

MAX_TOKENS = 8
CONTEXT = 2048
RANK_ARGS = ["--max-context", str(CONTEXT), "--peer-timeout", "2", "--connect-timeout", "6"]
LAUNCH_ARGS = ["--grace", "4", "--restart-delay", "0.2"]
# ssh's stand-in: skips ssh's options (SshRing passes -T -o …), then runs the command in
# the namespace named like the host, as ssh would run it in the remote user's shell.
FAKE_SSH = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -o) shift 2;; -*) shift;; *) break;; esac; done
host=$1; shift
exec ip netns exec "$host" sh -c "$*"
"""
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


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_pids(ns):
    return [int(p) for p in ip("netns", "pids", ns, check=False).stdout.split()]


def processes_naming(text: str):
    """Live processes whose command line contains `text` (the ssh stand-ins of this test)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
        except OSError:
            pass
    return out


class Hosts:
    def __init__(self, tag: str, subnet: str, names, tmp_path: Path):
        self.tag, self.subnet, self.names = tag, subnet, names
        self.ips = {n: f"{subnet}.{i + 1}" for i, n in enumerate(names)}
        self.ssh = tmp_path / f"trp-ssh-{tag}"
        self.ssh.write_text(FAKE_SSH)
        self.ssh.chmod(0o755)

    def cut(self, name: str) -> None:
        ip("-n", name, "link", "set", f"trpp{self.tag}{name[-1]}", "down")

    def hostfile(self, path: Path, memory_gb=None) -> Path:
        hosts = []
        for n in self.names:
            host = {"ssh": n, "ips": [self.ips[n]]}
            if memory_gb and memory_gb.get(n) is not None:
                host["memory_gb"] = memory_gb[n]
            hosts.append(host)
        path.write_text(json.dumps(hosts))
        return path


@pytest.fixture
def three_hosts(tmp_path):
    with namespace_hosts(tmp_path) as hosts:
        yield hosts


@contextlib.contextmanager
def namespace_hosts(tmp_path):
    """Namespaces A, B, C on a bridge of this machine; everything removed afterwards, and
    whatever still runs in them killed first, even when the test failed (skips the test
    where namespaces cannot be made)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed")
    tag = uuid.uuid4().hex[:6]
    subnet = next(s for s in (f"10.79.{random.randrange(256)}" for _ in range(50))
                  if not ip("route", "show", f"{s}.0/24", check=False).stdout.strip())
    names = [f"trp{tag}{x}" for x in "abc"]
    bridge = f"trpbr{tag}"
    made = ip("netns", "add", names[0], check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
    hosts = Hosts(tag, subnet, names, tmp_path)
    try:
        ip("link", "add", bridge, "type", "bridge")
        ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for name in names:
            if name != names[0]:
                ip("netns", "add", name)
            ours, theirs = f"trpv{tag}{name[-1]}", f"trpp{tag}{name[-1]}"
            ip("link", "add", ours, "type", "veth", "peer", "name", theirs)
            ip("link", "set", theirs, "netns", name)
            ip("-n", name, "addr", "add", f"{hosts.ips[name]}/24", "dev", theirs)
            ip("-n", name, "link", "set", theirs, "up")
            ip("-n", name, "link", "set", "lo", "up")
            ip("link", "set", ours, "master", bridge)
            ip("link", "set", ours, "up")
        yield hosts
    finally:
        for name in names:
            for pid in netns_pids(name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid in processes_naming(str(hosts.ssh)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for name in names:
            # Our end of each pair now (a deleted namespace is freed later, by the kernel).
            ip("link", "del", f"trpv{tag}{name[-1]}", check=False)
            ip("netns", "del", name, check=False)
        ip("link", "del", bridge, check=False)
        left = set(ip("netns", "list").stdout.split()) & set(names)
        assert not left, f"namespaces left behind: {left}"
        links = [x for x in ip("-o", "link").stdout.splitlines() if tag in x]
        assert not links, f"links left behind: {links}"


class Launcher:
    def __init__(self, hosts: Hosts, hostfile: Path, tmp_path: Path, *args):
        self.log_path = tmp_path / "launch.log"
        self.log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch", "run", "--hostfile", str(hostfile), "--ssh", str(hosts.ssh),
             *LAUNCH_ARGS, *args], stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True)

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, text: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while text not in self.output():
            assert self.proc.poll() is None or text in self.output(), \
                f"the launcher exited before {text!r}:\n{self.output()[-5000:]}"
            assert time.monotonic() < end, f"no {text!r} within {timeout:.0f} s:\n{self.output()[-5000:]}"
            time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


def generate(hosts: Hosts, ns: str, address: str, timeout: float = 180):
    """A greedy request from inside namespace `ns` (rank 0 serves on its loopback),
    retried until the ring serves; its tokens."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, address, json.dumps(PROMPT),
                           str(MAX_TOKENS)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def assert_nothing_left(hosts: Hosts) -> None:
    for name in hosts.names:
        assert netns_pids(name) == [], f"processes left in {name}"
    assert processes_naming(str(hosts.ssh)) == [], "ssh stand-ins left"


def test_a_host_whose_link_stays_cut_is_planned_out(three_hosts, hf_checkpoint, tmp_path):
    hosts = three_hosts
    a, b, c = hosts.names
    reference = mlx_lm_greedy(hf_checkpoint, PROMPT, MAX_TOKENS, 2048)[0]
    # B's memory unknown: the first ring plans at start-up (--split auto); without B the
    # launcher knows every host's memory and plans the split itself.
    hf = hosts.hostfile(tmp_path / "hosts.json", {a: 4, c: 4})
    address = f"127.0.0.1:{free_port_range(1)}"  # on rank 0's (A's) loopback
    launcher = Launcher(hosts, hf, tmp_path, "--restart", "1", "--", "run-trinity", "--model", str(hf_checkpoint),
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


def model_sizes(model_path: Path):
    """(config, tensor sizes), as the launcher plans with them."""
    model, path, config = checkpoint.load_config(str(model_path))
    return config, checkpoint.tensor_sizes(model, path)


def tight_memory_gb(model_path: Path) -> float:
    """GiB per host with which 3 hosts hold the model and 2 do not."""
    config, sizes = model_sizes(model_path)

    def fits(n: int, gb: float) -> bool:
        hf = hostfile.parse([{"ssh": f"h{i}", "ips": [f"10.0.0.{i + 1}"], "memory_gb": gb} for i in range(n)])
        return make_plan(config, sizes, hf, CONTEXT, 0.1).fits

    low, high = 1e-6, 64.0
    for _ in range(60):  # the least memory with which 3 hosts fit
        mid = (low + high) / 2
        low, high = (low, mid) if fits(3, mid) else (mid, high)
    assert not fits(2, high), "the tiny model fits on 2 hosts whenever it fits on 3"
    return high


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
