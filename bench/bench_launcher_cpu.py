"""CPU the launcher and each rank use while a 2-rank ring sits idle serving: mlx.launch vs `python -m launch run`.

    python bench/bench_launcher_cpu.py [--seconds 10] [--only NAME ...] [--json-out PATH]

Four ways to start `run_trinity.py --serve 127.0.0.1:PORT` (the embedded tiny model) as 2 ranks:
  mlx.launch --hostfile      two "remote" hosts over ssh (mlx.launch runs `ssh -tt` itself)
  launch run --hostfile      the same hostfile; launch/ssh_ring.py starts the ranks over ssh
  mlx.launch -n 2            two local ranks
  launch run --single-host 2 two local ranks, started directly
The remote hosts are this machine through an sshd started here on a free port (as root,
generated keys; needs openssh-server and openssh-client), reached as node-a and node-b through
an ssh config: `--ssh "ssh -F CONFIG"` for launch run, an `ssh` wrapper first on PATH for
mlx.launch (it runs plain `ssh`).

Once health says SERVING, one short generation has run (so the ring has served and gone
idle again), and a settling pause has passed, CPU seconds (utime + stime from
/proc/PID/stat, all threads) are read twice, --seconds apart, for
  launcher  the launcher process and every descendant of it that is not a rank (ssh clients,
            shells): what the launching machine pays for starting the ring
  ranks     the rank processes (MLX_RANK in their environment), also each on its own (rank N)
  remote    sshd's per-session processes and the shells under them, not the ranks: what each
            remote host pays on top of its rank (ssh rings only)
and reported per 10 s of wall time. Linux only (/proc).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from common import PY, RUN, bench_env, grpc_generate, prompt_ids, wait_serving  # noqa: E402
from launch.processes import free_ports  # noqa: E402  (consecutive ones: ring ports, then rank 0's control)

TICK = os.sysconf("SC_CLK_TCK")
MARK = "TRINITY_BENCH_MARK"  # in every process of a run, so that nothing of it outlives it
MLX_LAUNCH = str(Path(PY).parent / "mlx.launch")
MODES = ["mlx.launch --hostfile", "launch run --hostfile", "mlx.launch -n 2", "launch run --single-host 2"]


def proc_table():
    """pid -> (ppid, cpu seconds, environ bytes) for every live process."""
    table = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if fields[0] != "Z":
            table[int(pid)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, env)
    return table


def descendants(table, root: int):
    out, todo = [], [root]
    while todo:
        parent = todo.pop()
        kids = [pid for pid, row in table.items() if row[0] == parent]
        out += kids
        todo += kids
    return out


def rank_of(row):
    """The MLX_RANK in a process's environment, or None."""
    for var in row[2].split(b"\0"):
        if var.startswith(b"MLX_RANK="):
            return int(var[9:])
    return None


def cpu_split(launcher: int, sshd: int):
    """CPU seconds so far: {launcher, ranks, remote} -> {pid: seconds}."""
    table = proc_table()
    groups = {"launcher": {}, "ranks": {}, "remote": {}, "rank 0": {}, "rank 1": {}}
    for pid in [launcher] + descendants(table, launcher):
        rank = rank_of(table[pid])
        groups["launcher" if rank is None else "ranks"][pid] = table[pid][1]
        if rank is not None:
            groups[f"rank {rank}"][pid] = table[pid][1]
    for pid in descendants(table, sshd) if sshd else []:
        rank = rank_of(table[pid])
        groups["remote" if rank is None else "ranks"][pid] = table[pid][1]
        if rank is not None:
            groups[f"rank {rank}"][pid] = table[pid][1]
    return groups


def used(before, after, seconds: float):
    """Per group: CPU seconds per 10 s of wall time between two cpu_split() samples."""
    return {g: sum(t - before[g].get(pid, 0.0) for pid, t in after[g].items()) * 10 / seconds for g in after}


def start_sshd(d: Path):
    """sshd -D on a free port with fresh keys; returns (process, ssh config path)."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(sshd).exists() or not shutil.which("ssh"):
        sys.exit("needs OpenSSH: apt-get install openssh-server openssh-client")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    port = free_ports(1)[0]
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        "PidFile none\nUsePAM no\nStrictModes no\nPasswordAuthentication no\nUseDNS no\nLogLevel ERROR\n")
    (d / "ssh_config").write_text(
        f"Host *\n  HostName 127.0.0.1\n  Port {port}\n  IdentityFile {d / 'client_key'}\n  IdentitiesOnly yes\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(d / "sshd_config")], start_new_session=True)
    for _ in range(100):
        if subprocess.run(["ssh", "-F", str(d / "ssh_config"), "node-a", "true"], capture_output=True).returncode == 0:
            return proc, d / "ssh_config"
        time.sleep(0.1)
    proc.kill()
    sys.exit("sshd did not let us in")


def command(mode: str, d: Path, serve: str, env: dict):
    """The launcher's command line and environment for one mode."""
    rank = [RUN, "--serve", serve]
    hosts = d / "hosts.json"
    hosts.write_text(json.dumps({"hosts": [{"ssh": "node-a", "ips": ["127.0.0.1"]},
                                           {"ssh": "node-b", "ips": ["127.0.0.2"]}],
                                 "envs": [f"{MARK}={env[MARK]}"]}))
    port = str(free_ports(3)[0])
    if mode == "mlx.launch --hostfile":
        wrapper = d / "bin" / "ssh"  # mlx.launch runs plain `ssh`: point it at our sshd
        wrapper.parent.mkdir(exist_ok=True)
        wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -F {d / 'ssh_config'} \"$@\"\n")
        wrapper.chmod(0o755)
        env = dict(env, PATH=f"{wrapper.parent}{os.pathsep}{env['PATH']}")
        return [MLX_LAUNCH, "--hostfile", str(hosts), "--starting-port", port, PY, *rank], env
    if mode == "launch run --hostfile":
        return [PY, "-m", "launch", "run", "--hostfile", str(hosts), "--ssh", f"ssh -F {d / 'ssh_config'}",
                "--starting-port", port, "--", *rank], env
    if mode == "mlx.launch -n 2":
        return [MLX_LAUNCH, "-n", "2", "--starting-port", port, PY, *rank], env
    return [PY, "-m", "launch", "run", "--single-host", "2", "--starting-port", port, "--", *rank], env


def marked(mark: str):
    needle = f"{MARK}={mark}".encode()
    return [pid for pid, row in proc_table().items() if needle in row[2].split(b"\0") and pid != os.getpid()]


def stop(proc: subprocess.Popen, mark: str) -> None:
    """SIGTERM the launcher's group, then SIGKILL whatever of the run is left."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        for pid in marked(mark) if sig == signal.SIGKILL else []:
            os.kill(pid, sig)
        end = time.monotonic() + wait
        while (proc.poll() is None or marked(mark)) and time.monotonic() < end:
            time.sleep(0.1)


def measure(mode: str, d: Path, sshd: int, seconds: float, settle: float) -> dict:
    serve = f"127.0.0.1:{free_ports(1)[0]}"
    env = dict(bench_env(), **{MARK: uuid.uuid4().hex})
    cmd, env = command(mode, d, serve, env)
    log = open(d / f"{mode.replace(' ', '_')}.log", "w")
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        channel, waited = wait_serving(serve, [proc], timeout=300)
        from distributed.serving.proto import generation_pb2_grpc as pb_grpc

        grpc_generate(pb_grpc.GenerationStub(channel), [int(t) for t in prompt_ids(8).split(",")], 8)
        channel.close()
        time.sleep(settle)
        before, tic = cpu_split(proc.pid, sshd), time.monotonic()
        time.sleep(seconds)
        after, wall = cpu_split(proc.pid, sshd), time.monotonic() - tic
        result = {"mode": mode, "startup_s": round(waited, 1), "wall_s": round(wall, 2),
                  "processes": {g: len(after[g]) for g in after}}
        result.update({f"{g}_cpu_s_per_10s": round(v, 3) for g, v in used(before, after, wall).items()})
        return result
    finally:
        stop(proc, env[MARK])
        log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=10.0, help="measuring window (default 10)")
    p.add_argument("--settle", type=float, default=3.0, help="pause after SERVING before measuring")
    p.add_argument("--only", nargs="+", choices=MODES, help="some of the modes")
    p.add_argument("--json-out", help="also write the JSON here")
    args = p.parse_args()
    d = Path(tempfile.mkdtemp(prefix="bench-launcher-"))
    sshd, _ = start_sshd(d)
    results = []
    try:
        for mode in args.only or MODES:
            print(f"{mode}: starting ...", file=sys.stderr, flush=True)
            results.append(measure(mode, d, sshd.pid if "hostfile" in mode else 0, args.seconds, args.settle))
    finally:
        sshd.terminate()
        sshd.wait()
        shutil.rmtree(d, ignore_errors=True)
    print(f"CPU seconds per 10 s of an idle 2-rank serving ring ({args.seconds:g} s window, {os.cpu_count()} cores; "
          f"/proc counts in steps of {1 / TICK:g} s)")
    print(f"{'mode':28}{'launcher':>10}{'rank 0':>10}{'rank 1':>10}{'remote':>10}   launcher processes")
    for r in results:
        print(f"{r['mode']:28}{r['launcher_cpu_s_per_10s']:10.3f}{r['rank 0_cpu_s_per_10s']:10.3f}"
              f"{r['rank 1_cpu_s_per_10s']:10.3f}{r['remote_cpu_s_per_10s']:10.3f}   {r['processes']['launcher']}")
    print(json.dumps(results))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
