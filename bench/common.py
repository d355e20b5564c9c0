"""Helpers the bench/ scripts share: the benchmark checkpoints, prompt ids, the environment
(BLAS choice), mlx-lm loading, ranks started without mlx.launch, and gRPC serving.

Nothing here imports mlx or grpc at module level, so a script that only starts processes
stays light; the functions that need them import them.
"""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
RUN = str(ROOT / "run_trinity.py")
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"

FULL = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=16,
            num_experts=32, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=64, sliding_window=512, max_position_embeddings=8192, layers_per_file=4)
QUICK = dict(FULL, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=6,
             num_experts=8, num_experts_per_tok=2, head_dim=32, sliding_window=64, layers_per_file=2)


def checkpoint(sizes: dict) -> Path:
    """Make the checkpoint once per machine; a rename makes it appear atomically."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from distributed.shard.tiny_checkpoint import make_checkpoint, tiny_config

    # Keyed by everything the maker writes, so a changed maker never reuses a stale one.
    config = tiny_config(**{k: v for k, v in sizes.items() if k != "layers_per_file"})
    digest = hashlib.sha1(json.dumps([config, sizes], sort_keys=True).encode()).hexdigest()[:10]
    cache = Path(tempfile.gettempdir()) / "trinity-bench"
    path = cache / f"afmoe-{sizes['hidden_size']}-{sizes['num_hidden_layers']}-{digest}"
    if not (path / "config.json").exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".tmp-"))
        print(f"making checkpoint {path} ...", file=sys.stderr, flush=True)
        make_checkpoint(tmp, layout="hf", seed=0, **sizes)
        try:
            tmp.rename(path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def prompt_ids(n: int) -> str:
    """Deterministic byte-token ids (0..255: no special tokens)."""
    return ",".join(str((i * 37 + 11) % 251) for i in range(n))


def bench_env(blas: str = "reference") -> dict:
    """The environment every benchmarked process gets: the repo importable and, with
    blas="openblas", the system OpenBLAS preloaded (the MLX CPU wheel links a reference BLAS)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if blas == "openblas":
        if not Path(OPENBLAS).exists():
            sys.exit(f"--blas openblas: {OPENBLAS} not found (apt-get install -y libopenblas0)")
        env["LD_PRELOAD"] = " ".join(filter(None, [OPENBLAS, env.get("LD_PRELOAD")]))
    return env


def free_ports(n: int) -> list:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def load_mlx_lm(model: str):
    """mlx_lm.utils.load of a benchmark checkpoint; returns (model, tokenizer)."""
    from mlx_lm.utils import load

    # HF transformers >= 5 writes `rope_parameters`; mlx-lm reads only `rope_theta`
    # (and would silently use its default), so pass it on as the runner does.
    config = json.loads((Path(model) / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    assert rope.get("rope_type", "default") == "default", "only default RoPE is handled here"
    extra = {"rope_theta": rope["rope_theta"]} if "rope_theta" in rope and "rope_theta" not in config else None
    return load(model, model_config=extra)


def start_ranks(cmd: list, ranks: int, env: dict, rank0: Optional[dict] = None,
                others=None) -> Tuple[List[subprocess.Popen], Optional[str]]:
    """Start `cmd` as `ranks` processes of the ring backend, as mlx.launch would (MLX_HOSTFILE
    with free 127.0.0.1 ports, MLX_RANK) but without its output-relaying loop, which keeps a
    core busy. Each process gets a session (process group) of its own. `rank0` / `others`:
    extra Popen arguments (stdout, stderr, ...); `others` is one dict for every other rank or
    a list of ranks - 1 dicts (rank 1, 2, ...). Returns ([rank 0, rank 1, ...], hostfile or
    None); the caller removes the hostfile (os.unlink) and ends the processes (kill_groups)."""
    start = dict(cwd=ROOT, start_new_session=True)
    procs, hostfile = [], None
    try:
        if ranks > 1:
            fd, hostfile = tempfile.mkstemp(suffix=".json")
            os.write(fd, json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(ranks)]).encode())
            os.close(fd)
            env = dict(env, MLX_HOSTFILE=hostfile)
            extra = others if isinstance(others, list) else [others or {}] * (ranks - 1)
            for r in range(1, ranks):
                procs.append(subprocess.Popen(cmd, env=dict(env, MLX_RANK=str(r)), **start, **extra[r - 1]))
            env = dict(env, MLX_RANK="0")
        procs.insert(0, subprocess.Popen(cmd, env=env, **start, **(rank0 or {})))
    except BaseException:
        kill_groups(procs, grace=0)
        if hostfile:
            os.unlink(hostfile)
        raise
    return procs, hostfile


def kill_groups(procs: List[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM each process's group, then SIGKILL what is left after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10)
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in procs):
            return


def wait_serving(target: str, procs: List[subprocess.Popen], timeout: float = 600.0):
    """Poll grpc.health.v1 at `target` until SERVING. Returns (channel, seconds waited);
    raises RuntimeError if one of `procs` exits first or `timeout` passes."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(target)
    health = health_pb2_grpc.HealthStub(channel)
    tic = time.perf_counter()
    try:
        while True:
            dead = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"the server exited before serving (rank, exit code): {dead}")
            if time.perf_counter() - tic > timeout:
                raise RuntimeError(f"the server was not SERVING after {timeout:.0f} s")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return channel, time.perf_counter() - tic
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    except BaseException:
        channel.close()
        raise


def grpc_generate(stub, token_ids: List[int], max_tokens: int, timeout: Optional[float] = 600) -> dict:
    """One greedy Generate of raw token ids, timed at the client (time.perf_counter):
    `sent` (the call), `first` / `last` (the first / last response carrying tokens, None if
    none), `done` (the stream ended); `token_ids`, `finish_reason`, and the server's `usage`."""
    from distributed.serving.proto import generation_pb2 as pb

    request = pb.GenerateRequest(token_ids=token_ids, max_tokens=max_tokens, temperature=0.0)
    out = {"token_ids": [], "first": None, "last": None, "finish_reason": None, "usage": None}
    out["sent"] = time.perf_counter()
    for response in stub.Generate(request, timeout=timeout):
        if response.token_ids:
            out["last"] = time.perf_counter()
            out["first"] = out["first"] or out["last"]
            out["token_ids"] += list(response.token_ids)
        if response.finish_reason:
            u = response.usage
            out["finish_reason"] = response.finish_reason
            out["usage"] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                            "prefill_tokens_per_sec": u.prefill_tokens_per_sec,
                            "generation_tokens_per_sec": u.generation_tokens_per_sec}
    out["done"] = time.perf_counter()
    return out
