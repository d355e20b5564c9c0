"""`python -m launch run` with remote hosts: ranks started over ssh by the launcher itself
(launch/ssh_ring.py), against a real sshd started here (no mocks).

The sshd listens on a free port of 127.0.0.1 with a generated host key and an
authorized key; the hostfile's ssh names (node-a, node-b) reach it through an ssh
config passed as `--ssh "ssh -F CONFIG"`. Ring addresses 127.0.0.1 and 127.0.0.2
(both loopback on Linux) keep the two hosts apart. Light stand-in ranks test the
environment, failures and stop paths; one test runs the real run_trinity.py.
Every process a test starts (launcher, ssh clients, remote shells, ranks) must be
gone at its end.
"""

import getpass
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import RUN, free_port_range, needs

ROOT = Path(__file__).resolve().parents[2]
MARK = "TRINITY_TEST_MARK"
TWO_REMOTE = [{"ssh": "node-a", "ips": ["127.0.0.1"]}, {"ssh": "node-b", "ips": ["127.0.0.2"]}]

# A light rank: records what it was given, then exits or waits for a signal, as asked.
STAND_IN = r"""
import json, os, signal, sys, time
out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["MLX_RANK"])
info = {"rank": rank, "pid": os.getpid(), "cwd": os.getcwd(),
        "hostfile": open(os.environ["MLX_HOSTFILE"]).read() if os.environ.get("MLX_HOSTFILE") else None,
        "env": {k: os.environ.get(k) for k in ("TRINITY_CONTROL_ADDR", "TRINITY_TEST", "MLX_RANK")}}
print(f"stdout of rank {rank}", flush=True)
print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
if mode == "stubborn" and rank == 1:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it
else:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
with open(os.path.join(out, f"rank{rank}.tmp"), "w") as f:
    json.dump(info, f)
os.rename(os.path.join(out, f"rank{rank}.tmp"), os.path.join(out, f"rank{rank}.json"))
if mode == "fail" and rank == 1:
    sys.exit(7)
if mode in ("wait", "stubborn", "fail"):
    while True:
        time.sleep(3600)
"""


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A real sshd on a free port; yields the --ssh command that reaches it."""
    sshd_bin = shutil.which("sshd") or "/usr/sbin/sshd"
    missing = [p for p in (sshd_bin, shutil.which("ssh"), shutil.which("ssh-keygen")) if not p or not Path(p).exists()]
    if missing:
        needs("OpenSSH's sshd, ssh and ssh-keygen (Debian: apt-get install openssh-server openssh-client)")
    d = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    port = free_port_range(1)
    # The remote account starts clean, like a fresh Mac's: this machine's own ~/.bashrc
    # (read by bash for every ssh command) must not decide the test (a stale pyenv lock made
    # each session wait 60 s).
    (d / "home").mkdir()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        "PidFile none\nUsePAM no\nStrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        f"PermitRootLogin prohibit-password\nUseDNS no\nPrintMotd no\nLogLevel ERROR\nSetEnv HOME={d / 'home'}\n")
    (d / "ssh_config").write_text(
        f"Host *\n  HostName 127.0.0.1\n  Port {port}\n  User {getpass.getuser()}\n  IdentityFile {d / 'client_key'}\n"
        "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    log = open(d / "sshd.log", "w")
    proc = subprocess.Popen([sshd_bin, "-D", "-e", "-f", str(d / "sshd_config")], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    ssh = shlex.join(["ssh", "-F", str(d / "ssh_config")])
    try:
        end = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                pytest.fail(f"sshd exited with {proc.returncode}:\n{(d / 'sshd.log').read_text()}")
            probe = [*shlex.split(ssh), "-o", "BatchMode=yes", "node-a", "true"]
            if subprocess.run(probe, capture_output=True).returncode == 0:
                break
            if time.monotonic() > end:
                pytest.fail(f"sshd on port {port} never let us in:\n{(d / 'sshd.log').read_text()}")
            time.sleep(0.2)
        yield ssh
    finally:
        sessions = descendants(proc.pid)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pid in sessions:  # sessions sshd forked: gone with their ranks already, normally
            kill(pid, signal.SIGKILL)
        log.close()


def descendants(pid: int):
    parents = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(p)] = int(Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            pass
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [c for c, p in parents.items() if p == parent]
        out += kids
        todo += kids
    return out


def kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def ring_processes(mark: str):
    """Live processes of one launch: those with its mark in their environment (the launcher,
    ranks) or command line (remote shells and ssh clients, which export it)."""
    needle = f"{MARK}={mark}".encode()
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if needle in env or needle in cmdline:
            out.append(int(pid))
    return out


def wait_gone(mark: str, timeout: float):
    end = time.monotonic() + timeout
    while ring_processes(mark) and time.monotonic() < end:
        time.sleep(0.1)
    return ring_processes(mark)


class Launcher:
    """`python -m launch run --hostfile … --ssh …` in a session of its own, output in files."""

    def __init__(self, tmp_path, ssh, hosts, *args, envs=(), path=None):
        self.mark = uuid.uuid4().hex  # every process of this launch carries it
        envs = [f"{MARK}={self.mark}", *envs]
        (tmp_path / "hosts.json").write_text(json.dumps({"hosts": hosts, "envs": envs}))
        self.out, self.err = tmp_path / "stdout", tmp_path / "stderr"
        env = dict(os.environ, PYTHONPATH=str(ROOT), **{MARK: self.mark})
        if path:
            env["PATH"] = f"{path}{os.pathsep}{env['PATH']}"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "launch", "run", "--hostfile", str(tmp_path / "hosts.json"), "--ssh", ssh,
                 *args], stdout=out, stderr=err, env=env, cwd=ROOT, start_new_session=True)

    def stderr(self) -> str:
        return self.err.read_text()

    def wait_for(self, paths, timeout=60.0):
        end = time.monotonic() + timeout
        while not all(p.exists() for p in paths):
            assert self.proc.poll() is None, f"the launcher exited {self.proc.returncode}:\n{self.stderr()}"
            assert time.monotonic() < end, f"ranks not up after {timeout:.0f} s:\n{self.stderr()}"
            time.sleep(0.05)

    def wait(self, timeout=60.0) -> int:
        return self.proc.wait(timeout)

    def close(self):
        """Whatever happened, nothing of this launch survives the test."""
        if self.proc.poll() is None:
            kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in wait_gone(self.mark, 10):
            kill(pid, signal.SIGKILL)


@pytest.fixture
def launched(tmp_path, sshd):
    made = []

    def start(hosts, *args, envs=(), path=None):
        made.append(Launcher(tmp_path, sshd, hosts, *args, envs=envs, path=path))
        return made[-1]

    yield start
    for launcher in made:
        launcher.close()


@pytest.fixture
def stand_in(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    (tmp_path / "out").mkdir()
    return str(script), tmp_path / "out"


def ranks_info(out: Path, n: int):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def test_environment_cwd_and_output_of_local_and_remote_ranks(launched, stand_in, tmp_path):
    """Rank 0 local (started directly), rank 1 over ssh: each gets mlx.launch's environment
    (MLX_RANK, MLX_HOSTFILE holding the ring, the hostfile's envs, --cwd) and rank 0's
    control address; a remote rank's stdout and stderr stay apart."""
    script, out = stand_in
    hosts = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": "node-b", "ips": ["127.0.0.2"]}]
    launcher = launched(hosts, "--no-plan", "--cwd", str(tmp_path), "--", script, str(out), "exit",
                        envs=["TRINITY_TEST=it's a \"value\" $HOME"])
    assert launcher.wait() == 0, launcher.stderr()
    info = ranks_info(out, 2)
    ring = json.loads(info[0]["hostfile"])
    assert [node[0].split(":")[0] for node in ring] == ["127.0.0.1", "127.0.0.2"]
    assert info[1]["hostfile"].strip() == info[0]["hostfile"].strip()
    control = info[0]["env"]["TRINITY_CONTROL_ADDR"]
    assert control.startswith("127.0.0.1:") and control not in [n[0] for n in ring]
    for rank, i in enumerate(info):
        assert i["env"] == {"TRINITY_CONTROL_ADDR": control, "TRINITY_TEST": "it's a \"value\" $HOME",
                            "MLX_RANK": str(rank)}
        assert Path(i["cwd"]).resolve() == tmp_path.resolve()
    stdout, stderr = launcher.out.read_text(), launcher.stderr()
    assert "stdout of rank 1" in stdout and "stderr of rank 1" not in stdout and "stderr of rank 1" in stderr
    assert "started rank 1 on node-b over ssh" in stderr and "started rank 0 (pid" in stderr
    assert wait_gone(launcher.mark, 10) == []


def test_a_failing_remote_rank_is_named(launched, stand_in):
    """Rank 1 (remote) exits 7: the launcher says which rank and host, stops rank 0, exits 7."""
    script, out = stand_in
    launcher = launched(TWO_REMOTE, "--no-plan", "--grace", "1", "--", script, str(out), "fail")
    assert launcher.wait() == 7, launcher.stderr()
    err = launcher.stderr()
    assert "rank 1 exited with code 7 (host node-b)" in err and "launch: rank 1 failed with exit status 7" in err
    assert wait_gone(launcher.mark, 10) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_the_launcher_ends_every_remote_rank(launched, stand_in, sig):
    """SIGTERM: a clean stop (exit 0) within seconds. SIGKILL: the ssh clients see their
    stdin close, the remote shells SIGTERM their ranks."""
    script, out = stand_in
    launcher = launched(TWO_REMOTE, "--no-plan", "--grace", "1", "--", script, str(out), "wait")
    launcher.wait_for([out / "rank0.json", out / "rank1.json"])
    pids = [i["pid"] for i in ranks_info(out, 2)]
    assert set(pids) <= set(ring_processes(launcher.mark))
    started = time.monotonic()
    os.kill(launcher.proc.pid, sig)
    code = launcher.wait(30)
    assert wait_gone(launcher.mark, 10) == [], launcher.stderr()
    assert time.monotonic() - started < 10
    if sig == signal.SIGTERM:
        assert code == 0, launcher.stderr()
        assert "stopped by SIGTERM" in launcher.stderr()
    else:
        assert code == -signal.SIGKILL


def test_a_remote_rank_that_ignores_sigterm_is_killed(launched, stand_in):
    """The last resort reaches remote ranks too: KILL through the ssh client's stdin."""
    script, out = stand_in
    launcher = launched(TWO_REMOTE, "--no-plan", "--grace", "0.5", "--", script, str(out), "stubborn")
    launcher.wait_for([out / "rank0.json", out / "rank1.json"])
    os.kill(launcher.proc.pid, signal.SIGTERM)
    assert launcher.wait(30) != 0
    assert "ignored SIGTERM: SIGKILL" in launcher.stderr()
    assert wait_gone(launcher.mark, 10) == []


def test_via_mlx_launch_keeps_the_old_path(launched, stand_in, sshd, tmp_path):
    """--via mlx.launch still hands remote hosts to mlx.launch (which runs plain `ssh`: a
    wrapper first on PATH points it at our sshd); the failing rank is read from its report."""
    script, out = stand_in
    wrapper = tmp_path / "bin" / "ssh"
    wrapper.parent.mkdir()
    real_ssh = [shutil.which("ssh"), *shlex.split(sshd)[1:]]  # not `ssh`: that would be the wrapper itself
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.join(real_ssh)} \"$@\"\n")
    wrapper.chmod(0o755)
    launcher = launched(TWO_REMOTE, "--via", "mlx.launch", "--no-plan", "--grace", "1", "--", script, str(out), "fail",
                        path=wrapper.parent)
    assert launcher.wait() == 7, launcher.stderr()
    err = launcher.stderr()
    assert "started mlx.launch" in err and "over ssh" not in err
    assert "Node with rank 1 exited with code 7" in err and "launch: rank 1 failed with exit status 7" in err
    assert wait_gone(launcher.mark, 10) == []


def test_real_run_trinity_two_ranks_over_ssh(launched, hf_checkpoint, tmp_path):
    """The real run_trinity.py as 2 ranks over ssh: the same greedy tokens and logprobs as one
    process, and stdout is exactly rank 0's JSON."""
    args = ["--model", str(hf_checkpoint), "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"]
    launcher = launched(TWO_REMOTE, "--", "run_trinity.py", *args)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    single = subprocess.run([sys.executable, RUN, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=120)
    assert single.returncode == 0, single.stderr[-3000:]
    assert launcher.wait(120) == 0, launcher.stderr()[-3000:]
    result, expected = json.loads(launcher.out.read_text()), json.loads(single.stdout)
    assert result["token_ids"] == expected["token_ids"]
    assert result["logprobs"] == pytest.approx(expected["logprobs"], abs=1e-5)
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert "started rank 1 on node-b over ssh" in launcher.stderr()
    assert wait_gone(launcher.mark, 10) == []


def test_sshd_is_really_there(sshd):
    """The fixture's sshd answers as an SSH server (not a stand-in)."""
    port = int(re.search(r"Port (\d+)", Path(shlex.split(sshd)[-1]).read_text()).group(1))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        assert s.recv(64).startswith(b"SSH-2.0-OpenSSH")
