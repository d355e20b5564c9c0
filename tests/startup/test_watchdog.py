"""The watchdog's side channel on its own: where rank 0 listens, and real
processes (the watchdog alone, no MLX, so they start in a blink) that die,
freeze, leave with an error or exit cleanly."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port_range
from distributed.startup.watchdog import EXIT_PEER_FAILED, Control, control_from_env

# rank size port mode: "stay" (until killed), "close" (a clean exit, staggered), "leave" (rank 1 fails
# itself), "stop" (rank 2 asks for a stop, then dies), "park" (rank 1 parks until rank 0 wakes it)
RANK = """
import sys, time
from distributed.startup.watchdog import Watchdog
rank, size, port, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
connect_timeout = float(sys.argv[5]) if len(sys.argv) > 5 else 5.0
def heard(reason):  # what lifecycle.request_stop(reason, from_peer=True) gets
    print("stop:", reason, flush=True)
    watchdog.announce_stop(reason)  # as RankStop does: rank 0 relays it, others say nothing more


watchdog = Watchdog(rank, size, ("127.0.0.1", port), peer_timeout=1.0, connect_timeout=connect_timeout,
                    on_stop=heard).start()
watchdog.wait_ready()
print("ready", flush=True)
if mode == "stop":  # rank 2 is asked to stop (SIGTERM), then dies before the ring's STOP comes
    if rank == 2:
        time.sleep(0.3)
        watchdog.announce_stop("stopped by SIGTERM")
        time.sleep(0.5)
        import os
        os._exit(4)  # no bye: its deadline, say
    time.sleep(60)
if mode == "park":  # rank 1 parks at PARK frame 1; rank 0 wakes it when told on stdin
    if rank == 1:
        watchdog.wait_wake(1)
        print("woken", flush=True)
        watchdog.close()
        sys.exit(0)
    sys.stdin.readline()
    watchdog.wake(1)
    time.sleep(0.5)
    watchdog.close()
    sys.exit(0)
if mode == "close":
    time.sleep(0.3 * (size - rank))  # rank 0 last, as after the ring's STOP
    watchdog.close()
    sys.exit(0)
if mode == "leave" and rank == 1:
    time.sleep(0.3)
    watchdog.leave("FileNotFoundError: shard.safetensors")
    sys.exit(2)
time.sleep(60)
"""


def start(size: int, mode: str, ranks=None, connect_timeout=5.0):
    port = free_port_range(1)
    procs = {}
    for r in ranks if ranks is not None else range(size):
        procs[r] = subprocess.Popen([sys.executable, "-c", RANK, str(r), str(size), str(port), mode,
                                     str(connect_timeout)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                    env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return procs


def ready(procs):
    for r, p in procs.items():
        assert p.stdout.readline() == "ready\n", (r, p.stderr.read() if p.poll() is not None else "")


def finish(procs, timeout=15.0):
    """Each rank's (exit code, stderr)."""
    out = {}
    try:
        for r, p in procs.items():
            p.wait(timeout=timeout)
            out[r] = (p.returncode, p.stderr.read())
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
    return out


# ---------------------------------------------------------------- where rank 0 listens


def test_control_address_from_a_ring_hostfile(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.0.0.1:5000", "10.0.0.1:5001"], ["10.0.0.2:5002", "10.0.0.2:5003"]]))
    env = {"MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)}
    # One above the highest ring port, on rank 0's IP: known to every rank before init.
    assert control_from_env(env) == Control(1, 2, ("10.0.0.1", 5004), ["10.0.0.1", "10.0.0.2"])
    assert control_from_env({**env, "TRINITY_CONTROL_ADDR": "10.0.0.9:7000"}).address == ("10.0.0.9", 7000)


def test_control_address_elsewhere(tmp_path):
    nccl = {"MLX_RANK": "0", "NCCL_HOST_IP": "10.0.0.1", "NCCL_PORT": "12345", "MLX_WORLD_SIZE": "4"}
    assert control_from_env(nccl) == Control(0, 4, ("10.0.0.1", 12346), ["10.0.0.1"])
    (tmp_path / "one.json").write_text("")  # mlx.launch's hostfile for a single host
    assert control_from_env({"MLX_RANK": "0", "MLX_HOSTFILE": str(tmp_path / "one.json")}) is None
    assert control_from_env({}) is None  # one process, or MPI: agreed after init


# ---------------------------------------------------------------- real processes


def test_a_frozen_rank_is_named_by_every_survivor():
    procs = start(3, "stay")
    ready(procs)
    frozen_at = time.monotonic()
    os.kill(procs[2].pid, signal.SIGSTOP)
    out = finish({r: procs[r] for r in (0, 1)})
    took = time.monotonic() - frozen_at
    procs[2].kill()  # SIGKILL works on a stopped process
    procs[2].wait()
    for r in (0, 1):  # rank 0 saw the silence; rank 1 heard it from rank 0
        code, err = out[r]
        assert code == EXIT_PEER_FAILED and "trinity: rank 2 (host" in err and "no heartbeat for 1." in err, out
    assert took < 3.0, took


def test_a_killed_rank_0_is_named_by_every_other_rank():
    procs = start(3, "stay")
    ready(procs)
    procs[0].kill()
    out = finish({r: procs[r] for r in (1, 2)}, timeout=3.0)
    finish({0: procs[0]})
    for r in (1, 2):
        assert out[r][0] == EXIT_PEER_FAILED and "trinity: rank 0 (host" in out[r][1], out
        assert "connection closed" in out[r][1]


def test_a_rank_leaving_with_its_error_takes_every_rank_down_with_that_error():
    out = finish(start(3, "leave"))
    assert out[1][0] == 2 and "trinity:" not in out[1][1], out  # it says why itself (cli: "error: ...")
    for r in (0, 2):
        assert out[r][0] == EXIT_PEER_FAILED, out
        assert "failed: FileNotFoundError: shard.safetensors; exiting" in out[r][1] and "rank 1 (host" in out[r][1]


def test_a_clean_exit_is_no_failure():
    out = finish(start(3, "close"))
    assert all(code == 0 and err == "" for code, err in out.values()), out


def test_nobody_waits_for_ever_at_start_up():
    # Rank 2 of 3 never starts: rank 0 names it; rank 1 hears it from rank 0.
    out = finish(start(3, "stay", ranks=[0, 1], connect_timeout=2.0), timeout=15.0)
    assert all(code == EXIT_PEER_FAILED for code, _ in out.values()), out
    assert "rank 2 (host ?) did not connect to rank 0 (127.0.0.1:" in out[0][1] and "within 2 s" in out[0][1], out
    assert "rank 2 (host ?) did not connect" in out[1][1], out


@pytest.mark.parametrize("garbage", [b"", b"GET / HTTP/1.0\r\n\r\n", b'{"hello": 7}\n'])
def test_strangers_on_the_control_port_are_ignored(garbage):
    import socket

    port = free_port_range(1)
    procs = {r: subprocess.Popen([sys.executable, "-c", RANK, str(r), "2", str(port), "close"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                 env=dict(os.environ, PYTHONPATH=str(ROOT))) for r in (0,)}
    for _ in range(100):  # rank 0 listening
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(garbage)
            break
        except OSError:
            time.sleep(0.05)
    procs[1] = subprocess.Popen([sys.executable, "-c", RANK, "1", "2", str(port), "close"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
    out = finish(procs)
    assert all(code == 0 and err == "" for code, err in out.values()), out


# ---------------------------------------------------------------- stopping and parking


def test_a_stop_asked_of_any_rank_reaches_every_rank_and_losing_a_peer_then_is_no_failure():
    procs = start(3, "stop")
    ready(procs)
    heard = {r: procs[r].stdout.readline() for r in (0, 1)}
    for r in (0, 1):
        assert heard[r].startswith("stop: rank 2 (host ") and heard[r].rstrip().endswith("stopped by SIGTERM"), heard
    out = finish(procs)
    assert out[2][0] == 4, out
    for r in (0, 1):  # rank 2 vanished while the ring was stopping: the end, not a failure
        assert out[r][0] == 0, out
        assert "exited while the ring was stopping" in out[r][1] and "stopped responding" not in out[r][1], out


def test_a_parked_rank_sleeps_until_rank_0_wakes_it():
    procs = start(2, "park")
    ready(procs)
    with pytest.raises(subprocess.TimeoutExpired):
        procs[1].wait(timeout=1.0)  # parked: nothing comes until rank 0 wakes the ring
    procs[0].stdin.write("wake\n")
    procs[0].stdin.flush()
    assert procs[1].stdout.readline() == "woken\n"
    out = finish(procs)
    assert all(code == 0 and err == "" for code, err in out.values()), out
