"""Helpers the bench/ scripts share: the benchmark checkpoints, prompt ids, the environment
(BLAS choice), mlx-lm loading, ranks started without mlx.launch (or through it), ending their
process groups, a measuring child process, and gRPC serving (one stream, or many at once).

Nothing here imports mlx or grpc at module level, so a script that only starts processes
stays light; the functions that need them import them.
"""

import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the distributed and launch packages
    sys.path.insert(0, str(ROOT))
PY = sys.executable
RUN = str(ROOT / "run_trinity.py")
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
# mlx.launch without relying on its console script (missing in some installs, e.g. a --target one).
MLX_LAUNCH = [PY, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; main()"]

FULL = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=16,
            num_experts=32, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=64, sliding_window=512, max_position_embeddings=8192, layers_per_file=4)
QUICK = dict(FULL, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=6,
             num_experts=8, num_experts_per_tok=2, head_dim=32, sliding_window=64, layers_per_file=2)


def checkpoint(sizes: dict) -> Path:
    """Make the checkpoint once per machine; a rename makes it appear atomically."""
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


def stream_prompts(count: int, length: int, tag: Optional[str] = None) -> List[List[int]]:
    """`count` distinct deterministic prompts of byte tokens (no special tokens), equal length
    (so that batch_generate pads none of them), seeded by `tag` and index: prompts of different
    tags differ from the first token on (nothing for a prefix cache to share). tag None:
    bench_throughput's prompts, token k repeated (kept so that its results stay comparable)."""
    if tag is None:
        return [[random.Random(1000 + k).randrange(251)] * length for k in range(count)]
    return [[rng.randrange(251) for _ in range(length)] for rng in (random.Random(f"{tag}:{k}") for k in range(count))]


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
    """n consecutive free ports, as the launcher picks them (launch.processes.free_ports: below
    the ephemeral range, never one handed out before in this process)."""
    from launch.processes import free_ports as consecutive

    return consecutive(n)


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
                others=None, rank_env: Optional[Callable[[int], dict]] = None
                ) -> Tuple[List[subprocess.Popen], Optional[str]]:
    """Start `cmd` as `ranks` processes of the ring backend, as mlx.launch would (MLX_HOSTFILE
    with free 127.0.0.1 ports, MLX_RANK) but without its output-relaying loop, which keeps a
    core busy. Each process gets a session (process group) of its own. `rank0` / `others`:
    extra Popen arguments (stdout, stderr, ...); `others` is one dict for every other rank or
    a list of ranks - 1 dicts (rank 1, 2, ...). `rank_env(rank)`: extra environment of that
    rank (e.g. CUDA_VISIBLE_DEVICES). Returns ([rank 0, rank 1, ...], hostfile or None); the
    caller removes the hostfile (os.unlink) and ends the processes (kill_groups)."""
    start = dict(cwd=ROOT, start_new_session=True)
    procs, hostfile = [], None

    def env_of(rank: int) -> dict:
        ring = {"MLX_HOSTFILE": hostfile, "MLX_RANK": str(rank)} if ranks > 1 else {}
        return {**env, **(rank_env(rank) if rank_env else {}), **ring}

    try:
        if ranks > 1:
            fd, hostfile = tempfile.mkstemp(suffix=".json")
            os.write(fd, json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(ranks + 1)[:ranks]]).encode())  # rank 0's control link: the one above
            os.close(fd)
            extra = others if isinstance(others, list) else [others or {}] * (ranks - 1)
            for r in range(1, ranks):
                procs.append(subprocess.Popen(cmd, env=env_of(r), **start, **extra[r - 1]))
        procs.insert(0, subprocess.Popen(cmd, env=env_of(0), **start, **(rank0 or {})))
    except BaseException:
        kill_groups(procs, grace=0)
        if hostfile:
            os.unlink(hostfile)
        raise
    return procs, hostfile


def kill_groups(procs: List[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM each process's group, then SIGKILL what is left after `grace` seconds. Returns
    once every group is empty, not only its leader: mlx.launch's ranks live in its group and
    may outlive it."""
    from launch.processes import group_alive, signal_group

    def alive(p) -> bool:
        return p.poll() is None or group_alive(p.pid)

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if alive(p):
                signal_group(p.pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10)
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while any(alive(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not any(alive(p) for p in procs):
            return


def run_json_child(cmd: list, env: dict, timeout: float, relay_stderr: bool = False) -> dict:
    """Run a measuring child process (a session of its own, ended on any exit) whose last
    stdout line starting with "{" is its JSON result; {"error": ...} if it fails.
    relay_stderr: its stderr (progress) also goes to ours as it comes."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    out, err = [], []

    def drain(stream, keep, echo):
        for line in stream:
            keep.append(line)
            if echo:
                sys.stderr.write(line)
                sys.stderr.flush()

    readers = [threading.Thread(target=drain, args=(proc.stdout, out, False), daemon=True),
               threading.Thread(target=drain, args=(proc.stderr, err, relay_stderr), daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        kill_groups([proc], grace=0)
        for t in readers:
            t.join(timeout=10)
    lines = [line for line in out if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {(''.join(err) or ''.join(out)).strip()[-1500:]}"}
    return json.loads(lines[-1])


def log_tails(logs: list, chars: int = 800) -> str:
    """The last `chars` characters of each non-empty log file, headed by its rank."""
    out = []
    for r, path in enumerate(logs):
        text = Path(path).read_text(errors="replace").strip() if Path(path).exists() else ""
        if text:
            out.append(f"[rank {r}] " + text[-chars:])
    return "\n".join(out)


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
    none), `times` (each response carrying tokens), `done` (the stream ended); `token_ids`,
    `finish_reason`, and the server's `usage`."""
    from distributed.serving.proto import generation_pb2 as pb

    request = pb.GenerateRequest(token_ids=token_ids, max_tokens=max_tokens, temperature=0.0)
    out = {"token_ids": [], "first": None, "last": None, "times": [], "finish_reason": None, "usage": None}
    out["sent"] = time.perf_counter()
    for response in stub.Generate(request, timeout=timeout):
        if response.token_ids:
            out["last"] = time.perf_counter()
            out["first"] = out["first"] or out["last"]
            out["times"].append(out["last"])
            out["token_ids"] += list(response.token_ids)
        if response.finish_reason:
            u = response.usage
            out["finish_reason"] = response.finish_reason
            out["usage"] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                            "prefill_tokens_per_sec": u.prefill_tokens_per_sec,
                            "generation_tokens_per_sec": u.generation_tokens_per_sec}
    out["done"] = time.perf_counter()
    return out


def percentile(values: list, q: float):
    """Nearest-rank percentile (q in 0..100): an observed value; p99 of fewer than 100 is the max."""
    values = sorted(v for v in values if v is not None)
    return values[max(0, math.ceil(q / 100 * len(values)) - 1)] if values else None


def concurrent_streams(stub, prompts: list, max_tokens, timeout: float, gap: float = 0.0) -> dict:
    """len(prompts) threads, one greedy Generate stream each (max_tokens: one for all, or a
    list with one per prompt), released together, or (gap) stream i `gap` * i seconds after
    the first. Aggregate = generated tokens / (last stream's end - first request sent);
    `ttfts_s`: each stream's request sent -> first token (None if it got none); `itl_s`: the
    inter-token latency (gaps between a stream's token responses, all streams) at p50, p99, max."""
    n = len(prompts)
    barrier = threading.Barrier(n)
    runs = [None] * n

    def one(i):
        try:
            barrier.wait()
            time.sleep(gap * i)
            limit = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
            runs[i] = grpc_generate(stub, prompts[i], limit, timeout)
        except Exception as e:  # reported with the result
            runs[i] = {"error": f"{type(e).__name__}: {e.details() if hasattr(e, 'details') else e}"}

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"streams": n, "error": f"{len(errors)} of {n} streams failed: {errors[0]}"}
    tokens = sum(len(r["token_ids"]) for r in runs)
    wall = max(r["done"] for r in runs) - min(r["sent"] for r in runs)
    ttfts = [r["first"] - r["sent"] if r["first"] is not None else None for r in runs]
    got = [t for t in ttfts if t is not None]
    itls = [b - a for r in runs for a, b in zip(r["times"], r["times"][1:])]
    itl = {q: percentile(itls, q) for q in (50, 99, 100)}
    return {"streams": n, "wall_s": wall, "tokens": tokens, "aggregate_tps": tokens / wall, "arrival_gap_s": gap,
            "itl_s": {"p50": itl.get(50), "p99": itl.get(99), "max": itl.get(100)},
            "mean_ttft_s": sum(got) / len(got) if got else None, "max_ttft_s": max(got) if got else None,
            "ttfts_s": ttfts, "token_ids": [r["token_ids"] for r in runs],
            "finish_reasons": [r["finish_reason"] for r in runs]}
