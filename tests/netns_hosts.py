"""Hosts as network namespaces for the launcher's tests (tests/launch/test_replan_netns.py,
test_router_replan.py): three "hosts" A, B, C on one bridge (10.79.X.1-3; this machine
is 10.79.X.254 on the bridge, so the launcher's probe goes over the same links as the
ring). The launcher runs here and reaches the hosts through an `--ssh` stand-in that
runs the remote command inside the host's namespace (`ip netns exec`), so SshRing, its
wrapper script and its signals over stdin are the real ones; only ssh's transport is
replaced. Cutting a host's link (its veth down) makes it silent for the ranks and for
the probe alike.

Names (trp…) and the subnet (10.79.X.0/24, X random) are apart from
tests/startup/test_netns.py's (trin…, 10.77.0.0/24). Needs root and iproute2
(namespace_hosts skips the test, saying why, where namespaces cannot be made).
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

from conftest import ROOT, needs
from distributed.shard import checkpoint
from launch import hostfile
from launch.replan import make_plan

CONTEXT = 2048
RANK_ARGS = ["--max-context", str(CONTEXT), "--peer-timeout", "2", "--connect-timeout", "6"]
LAUNCH_ARGS = ["--grace", "4", "--restart-delay", "0.2"]
# ssh's stand-in: skips ssh's options (SshRing passes -T -o …), then runs the command in
# the namespace named like the host, as ssh would run it in the remote user's shell.
SSH_HOST = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -o) shift 2;; -*) shift;; *) break;; esac; done
host=$1; shift
"""  # a stand-in's start: ssh's options skipped, $host the host, "$*" the remote command
FAKE_SSH = SSH_HOST + 'exec ip netns exec "$host" sh -c "$*"\n'


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


@contextlib.contextmanager
def namespace_hosts(tmp_path, letters: str = "abc"):
    """Namespaces A, B, C (one per letter) on a bridge of this machine; everything removed afterwards, and
    whatever still runs in them killed first, even when the test failed (skips the test
    where namespaces cannot be made)."""
    if os.geteuid() != 0:
        needs("root, for network namespaces")
    if shutil.which("ip") is None:
        needs("`ip` (iproute2)")
    tag = uuid.uuid4().hex[:6]
    subnet = next(s for s in (f"10.79.{random.randrange(256)}" for _ in range(50))
                  if not ip("route", "show", f"{s}.0/24", check=False).stdout.strip())
    names = [f"trp{tag}{x}" for x in letters]
    bridge = f"trpbr{tag}"
    made = ip("netns", "add", names[0], check=False)
    if made.returncode != 0:
        needs(f"network namespaces (ip netns add: {made.stderr.strip()})")
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


def assert_nothing_left(hosts: Hosts) -> None:
    for name in hosts.names:
        assert netns_pids(name) == [], f"processes left in {name}"
    assert processes_naming(str(hosts.ssh)) == [], "ssh stand-ins left"


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
