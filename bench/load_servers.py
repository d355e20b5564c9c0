"""bench_load.py's runner side: run_trinity.py --serve at P ranks, started one of three ways, and
the gRPC client that load_measure.py drives.

    ring             P processes started here with MLX_HOSTFILE / MLX_RANK (common.start_ranks):
                     the point-to-point transport; with gpu_per_rank, rank r gets
                     CUDA_VISIBLE_DEVICES=r
    nccl             mlx.launch --backend nccl -n P (it sets CUDA_VISIBLE_DEVICES per rank): the
                     collective transport
    mlx-launch-ring  mlx.launch --backend ring -n P: checks the mlx.launch path on a CPU

P = 1 is always one plain process. Ports are free ones chosen now. Every process group started is
ended when the `with` block exits, however it exits (SIGTERM, then SIGKILL); a server that dies
names the process, its exit code and its log tail.
"""

import os
import shutil
import subprocess
import tempfile
import time

from common import (MLX_LAUNCH, PY, ROOT, RUN, concurrent_streams, free_ports, grpc_generate, kill_groups,
                    log_tails, start_ranks, wait_serving)

BACKENDS = ("ring", "nccl", "mlx-launch-ring")


class RunnerServer:
    def __init__(self, ranks: int, backend: str, args: list, env: dict, gpu_per_rank: bool, timeout: float,
                 run: str = RUN, name: str = "runner"):
        self.ranks, self.backend, self.args, self.env = ranks, backend, args, env
        self.gpu_per_rank, self.timeout = gpu_per_rank, timeout
        self.run = run  # run_trinity.py: this checkout's, or another's (bench_load.py --baseline)
        self.label = f"{name} P={ranks}" + (f" ({backend})" if ranks > 1 else "")
        self.procs, self.names, self.hostfile, self.channel, self.files, self.logs = [], [], None, None, [], []
        self.logdir = tempfile.mkdtemp(prefix="bench-load-")

    def __enter__(self):
        try:
            self._start()
            self.channel, self.startup_s = wait_serving(self.target, self.procs, timeout=self.timeout)
        except BaseException as e:
            message = self.why(str(e)) if isinstance(e, RuntimeError) else None  # before the logs go
            self.__exit__(None, None, None)
            if message:
                raise RuntimeError(message) from None
            raise
        return self

    def _start(self):
        self.target = f"127.0.0.1:{free_ports(1)[0]}"
        cmd = [PY, self.run, "--serve", self.target, *self.args]
        if self.ranks == 1 or self.backend == "ring":
            self.logs = [os.path.join(self.logdir, f"rank{r}.log") for r in range(self.ranks)]
            self.files = [open(path, "w") for path in self.logs]
            stdio = [dict(stdout=f, stderr=subprocess.STDOUT) for f in self.files]
            gpu = (lambda r: {"CUDA_VISIBLE_DEVICES": str(r)}) if self.gpu_per_rank else None
            self.names = [f"rank {r}" for r in range(self.ranks)]
            self.procs, self.hostfile = start_ranks(cmd, self.ranks, self.env, rank0=stdio[0], others=stdio[1:],
                                                    rank_env=gpu)
            return
        # mlx.launch: its ranks live in its process group. Rank 0's control port is by default one
        # above the ring's ports (ring) or NCCL_PORT + 1 (nccl): take P + 1 or 2 consecutive ones.
        from launch.processes import free_ports as consecutive_ports

        if self.backend == "nccl":
            where = ["--backend", "nccl", "--nccl-port", str(consecutive_ports(2)[0])]
        else:
            where = ["--backend", "ring", "--starting-port", str(consecutive_ports(self.ranks + 1)[0])]
        self.logs = [os.path.join(self.logdir, "mlx.launch.log")]
        self.files = [open(self.logs[0], "w")]
        self.names = ["mlx.launch (all ranks)"]
        launch = [*MLX_LAUNCH, *where, "-n", str(self.ranks), "--", *cmd]  # "--": runner flags stay the runner's
        self.procs = [subprocess.Popen(launch, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=self.files[0],
                                       stderr=subprocess.STDOUT, start_new_session=True)]

    def why(self, what: str) -> str:
        """`what` went wrong: name any process that exited (with its code) and add the log tails."""
        time.sleep(0.5)  # a dying rank's last lines
        dead = [f"{name} (pid {p.pid}) exited with code {p.returncode}"
                for name, p in zip(self.names, self.procs) if p.poll() is not None]
        for f in self.files:
            f.flush()
        return f"{self.label}: {what}" + (f"; {', '.join(dead)}" if dead else "") + \
            f"\nlog tail:\n{log_tails(self.logs, 1500)}"

    def __exit__(self, *exc):
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        kill_groups(self.procs)
        from launch.processes import group_alive

        left = [p.pid for p in self.procs if group_alive(p.pid)]
        if left:
            print(f"WARNING: {self.label}: process group(s) {left} still alive after SIGKILL", flush=True)
        if self.hostfile:
            os.unlink(self.hostfile)
            self.hostfile = None
        for f in self.files:
            f.close()
        shutil.rmtree(self.logdir, ignore_errors=True)
        return False

    def dead(self) -> bool:
        return any(p.poll() is not None for p in self.procs)

    def model_info(self) -> dict:
        from distributed.serving.proto import generation_pb2 as pb
        from distributed.serving.proto import generation_pb2_grpc as pb_grpc

        info = pb_grpc.GenerationStub(self.channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
        return {"ranks": [{"rank": r.rank, "host": r.host, "layers": [r.layer_start, r.layer_end],
                           "peak_memory_bytes": r.peak_memory_bytes} for r in info.ranks]}


class GrpcClient:
    """load_measure's client over one channel to a RunnerServer; a failure names the server."""

    def __init__(self, server: RunnerServer, timeout: float):
        from distributed.serving.proto import generation_pb2_grpc as pb_grpc

        self.server, self.timeout = server, timeout
        self.stub = pb_grpc.GenerationStub(server.channel)

    def _call(self, fn, *args):
        try:
            out = fn(*args)
        except Exception as e:
            raise RuntimeError(self.server.why(f"{type(e).__name__}: {e.details() if hasattr(e, 'details') else e}"))
        if isinstance(out, dict) and "error" in out:
            raise RuntimeError(self.server.why(out["error"]))
        if self.server.dead():
            raise RuntimeError(self.server.why("a server process exited"))
        return out

    def batch(self, prompts: list, max_tokens: int, gap: float = 0.0) -> dict:
        return self._call(concurrent_streams, self.stub, prompts, max_tokens, self.timeout, gap)

    def alone(self, prompt: list, max_tokens: int) -> list:
        return self._call(grpc_generate, self.stub, prompt, max_tokens, self.timeout)["token_ids"]

    def first_token(self, prompt: list) -> float:
        r = self._call(grpc_generate, self.stub, prompt, 1, self.timeout)
        if r["first"] is None:
            raise RuntimeError(self.server.why(f"no token for a {len(prompt)}-token prompt ({r['finish_reason']})"))
        return r["first"] - r["sent"]

