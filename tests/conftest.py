"""Shared fixtures: tiny checkpoints made at test time, and real rank launches."""

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from distributed.tiny_checkpoint import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
RUN = str(ROOT / "run_trinity.py")


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory) -> Path:
    """HF layout, float32, per-expert keys, 8 layers (S S S F S S S F), window 16."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_hf"), layout="hf", seed=0)


@pytest.fixture(scope="session")
def mlx_checkpoint(tmp_path_factory) -> Path:
    """mlx-community layout: stacked experts, 4-bit, router 8-bit override."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_mlx"), layout="mlx", seed=0)


def mlx_launch() -> str:
    exe = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    return exe


def free_port_range(n: int) -> int:
    """A base port with n free ports after it: the ring backend listens on base + rank.
    mlx.launch's fixed default would collide with any other ring on this machine."""
    for _ in range(100):
        base = random.randrange(20000, 32000 - n)  # below Linux's ephemeral range (32768+)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


def system_mpirun() -> str:
    """Debian's Open MPI (4.1) where installed; started directly, as a user would."""
    return "/usr/bin/mpirun" if Path("/usr/bin/mpirun").exists() else "mpirun"


def run_cli(args, ranks: int = 1, backend: str = "ring", timeout: int = 180) -> subprocess.CompletedProcess:
    """Run run_trinity.py as `ranks` real processes: `mlx.launch` with the ring
    backend ("ring") or the MPI one ("mlx-mpi", Open MPI 5 from PyPI), or the
    system's `mpirun` directly ("mpirun")."""
    if ranks == 1:
        cmd = [sys.executable, RUN, *args]
    elif backend == "mpirun":
        cmd = [system_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), sys.executable, RUN, *args]
    elif backend == "mlx-mpi":
        cmd = [mlx_launch(), "--backend", "mpi", "--mpi-arg=--oversubscribe", "-n", str(ranks), sys.executable, RUN, *args]
    else:
        cmd = [mlx_launch(), "-n", str(ranks), "--starting-port", str(free_port_range(ranks)),
               sys.executable, RUN, *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # The environment's own bin first, so mlx.launch finds the mpirun that pip installed.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def run_json(args, ranks: int = 1, backend: str = "ring") -> dict:
    proc = run_cli([*args, "--json"], ranks, backend)
    assert proc.returncode == 0, proc.stderr[-3000:]
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"stdout is not one JSON object:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-3000:]}")
