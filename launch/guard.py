"""Runs one rank's command and, when it fails, says so on stderr.

`mlx.launch --backend mpi` ignores mpirun's exit status and its failure report
does not come through, so `launch run` wraps each MPI rank in this:
`python -m launch.guard -- python run_trinity.py …`. Its line reaches mlx.launch's
stderr like any rank output, and launch.mlx_launch_ring reads it.
"""

import os
import signal
import subprocess
import sys


def rank() -> str:
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ:
            return os.environ[name]
    return "?"


def main(argv) -> int:
    cmd = argv[1:] if argv[:1] == ["--"] else argv
    if not cmd:
        print("usage: python -m launch.guard -- COMMAND …", file=sys.stderr)
        return 2
    proc = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _: proc.send_signal(s))  # mpirun stops us: stop the rank too
    code = proc.wait()
    if code != 0:
        print(f"launch: rank {rank()} exited with code {code}", file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
