"""What every benchmark shares: the checkpoints, prompts and environment, ranks started without a
launcher's relay loop, a server (run_trinity.py --serve on a ring) and its gRPC client, one set of
flag names, and one results format (JSON headed by the machine, the commit and the date).

Nothing here imports mlx or grpc at module level, so `python -m bench --help` stays light.
"""

import logging
import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable, List, Optional, Tuple

log = logging.getLogger("bench")

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
RUN = str(ROOT / "run_trinity.py")
RESULTS = ROOT / "bench" / "results"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
# mlx.launch without relying on its console script (missing in some installs, e.g. a --target one).
MLX_LAUNCH = [PY, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; main()"]

FULL = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=16,
            num_experts=32, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=64, sliding_window=512, max_position_embeddings=8192, layers_per_file=4)
SMALL = dict(FULL, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=6,
             num_experts=8, num_experts_per_tok=2, head_dim=32, sliding_window=64, layers_per_file=2)
MINI = dict(
    model_type="afmoe", vocab_size=200192, hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=1024, num_hidden_layers=32, num_dense_layers=2, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
    num_shared_experts=1, route_norm=True, route_scale=2.826, score_func="sigmoid", n_group=1,
    topk_group=1, sliding_window=2048, mup_enabled=True,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(32)],
    eos_token_id=[258], torch_dtype="bfloat16")
# Trinity-Mini's code path at a size a CPU makes in seconds (--smoke).
MINI_SMOKE = dict(MINI, vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                  num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, sliding_window=256,
                  layer_types=["sliding_attention"] * 3 + ["full_attention"])

def int_list(text: str) -> list:
    """"1,2,8" -> [1, 2, 8]; "1-4" -> [1, 2, 3, 4]; "none" -> []."""
    if text.strip() == "none":
        return []
    out = []
    for part in filter(None, text.replace(" ", "").split(",")):
        low, dash, high = part.partition("-")
        out += list(range(int(low), int(high) + 1)) if dash else [int(part)]
    return out


# One name, one meaning, for every subcommand: (argparse keywords, help).
FLAGS = {
    "out": (dict(metavar="PATH"), "the results' JSON file (default bench/results/<subcommand>.json)"),
    "smoke": (dict(action="store_true"), "the smallest configuration (the small checkpoint, short runs): checks "
              "the subcommand end to end in a minute or two"),
    "model": (dict(metavar="PATH"), "a checkpoint folder instead of the default one"),
    "ranks": (dict(type=int_list, metavar="P,..."), "rank counts to run (a list: 1,2,4, or a range: 1-4)"),
    "streams": (dict(type=int_list, metavar="N,..."), "concurrent stream counts"),
    "reps": (dict(type=int, metavar="N"), "interleaved rounds; medians are reported"),
    "max_tokens": (dict(type=int, metavar="N"), "greedy tokens per request"),
    "blas": (dict(choices=["reference", "openblas"]), "openblas preloads the system OpenBLAS into every rank "
             "(the MLX CPU wheel links a slow reference BLAS)"),
    "timeout": (dict(type=float, metavar="S"), "seconds a process or request may take"),
}


def flags(parser: argparse.ArgumentParser, **defaults) -> None:
    """Add the shared flags named in `defaults` (keyword: the flag's default)."""
    for name, default in defaults.items():
        kwargs, text = FLAGS[name]
        parser.add_argument("--" + name.replace("_", "-"), default=default, help=text, **kwargs)


def shrink(args, **small) -> None:
    """--smoke: each of these flags left at its default takes its smallest value (a flag given still holds)."""
    if args.smoke:
        for name, value in small.items():
            if getattr(args, name) == args.parser.get_default(name):
                setattr(args, name, value)


def checkpoint(sizes: dict) -> Path:
    """The float32 benchmark checkpoint of `sizes`, made once per machine (a rename makes it appear whole)."""
    from distributed.shard.tiny_checkpoint import make_checkpoint, tiny_config

    config = tiny_config(**{k: v for k, v in sizes.items() if k != "layers_per_file"})
    digest = hashlib.sha1(json.dumps([config, sizes], sort_keys=True).encode()).hexdigest()[:10]
    cache = Path(tempfile.gettempdir()) / "trinity-bench"
    path = cache / f"afmoe-{sizes['hidden_size']}-{sizes['num_hidden_layers']}-{digest}"
    if not (path / "config.json").exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".tmp-"))
        log.info(f"making checkpoint {path} ...")
        make_checkpoint(tmp, layout="hf", seed=0, **sizes)
        try:
            tmp.rename(path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def random_model(shape: dict = MINI, dtype="bfloat16", bits: int = 4):
    """(model, config): mlx-lm's AFMoE in `shape`, random weights in `dtype` quantized as
    mlx-community does (`bits`, group 64, router 8-bit), evaluated."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.models import afmoe
    from mlx_lm.utils import quantize_model

    model = afmoe.Model(afmoe.ModelArgs.from_dict(shape))
    keep_fp32 = model.cast_predicate  # expert_bias stays float32, as in mlx-lm's converter
    cast = getattr(mx, dtype)
    model.update(tree_map_with_path(lambda k, x: x.astype(cast) if keep_fp32(k) else x, model.parameters()))
    model, config = quantize_model(model, dict(shape), group_size=64, bits=bits, quant_predicate=model.quant_predicate)
    for layer in [model.model.embed_tokens, model.model.norm, model.lm_head, *model.layers]:
        mx.eval(layer.parameters())  # layer by layer: never all the bf16 weights at once
    return model, config


def make_mini(path: Path, shape: dict = MINI) -> Path:
    """Trinity-Mini's shape, random weights in bf16 quantized as mlx-community does (4-bit, group 64,
    router 8-bit), with a padded tiny tokenizer; made at `path` unless already there."""
    from mlx_lm.utils import save_config, save_model

    from distributed.shard.tiny_checkpoint import write_tokenizer

    if (path / "config.json").exists():
        return path
    model, config = random_model(shape)
    save_model(path, model)
    save_config(config, path / "config.json")
    write_tokenizer(path, shape["vocab_size"])
    return path


def prompt_ids(n: int) -> list:
    """Deterministic byte-token ids (0..255: no special tokens)."""
    return [(i * 37 + 11) % 251 for i in range(n)]


def stream_prompts(count: int, length: int, tag: str) -> List[List[int]]:
    """`count` distinct deterministic byte-token prompts of one length, seeded by `tag` and index:
    prompts of different tags differ from the first token on (nothing for a prefix cache to share)."""
    import random

    return [[rng.randrange(251) for _ in range(length)] for rng in (random.Random(f"{tag}:{k}") for k in range(count))]


def bench_env(blas: str = "reference") -> dict:
    """Every benchmarked process's environment: the checkout importable, its Python's bin first on PATH
    and, with blas="openblas", the system OpenBLAS preloaded."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env["PATH"] = f"{Path(PY).parent}{os.pathsep}{env.get('PATH', '')}"
    if blas == "openblas":
        if not Path(OPENBLAS).exists():
            sys.exit(f"--blas openblas: {OPENBLAS} not found (apt-get install -y libopenblas0)")
        env["LD_PRELOAD"] = " ".join(filter(None, [OPENBLAS, env.get("LD_PRELOAD")]))
    return env


def free_ports(n: int) -> list:
    """n consecutive free ports, as the launcher picks them (below the ephemeral range, never one
    handed out before in this process)."""
    from launch.processes import free_ports as consecutive

    return consecutive(n)


def mpirun():
    """Debian's Open MPI where installed (started directly, as a user would), else the first on PATH."""
    return "/usr/bin/mpirun" if Path("/usr/bin/mpirun").exists() else shutil.which("mpirun")


def load_mlx_lm(model: str):
    """mlx_lm.utils.load of a benchmark checkpoint; returns (model, tokenizer)."""
    from mlx_lm.utils import load

    # HF transformers >= 5 writes `rope_parameters`; mlx-lm reads only `rope_theta`
    # (and would silently use its default), so pass it on as the runner does.
    config = json.loads((Path(model) / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    extra = {"rope_theta": rope["rope_theta"]} if "rope_theta" in rope and "rope_theta" not in config else None
    return load(model, model_config=extra)


def start_ranks(cmd: list, ranks: int, env: dict, rank0: Optional[dict] = None, others=None,
                rank_env: Optional[Callable[[int], dict]] = None) -> Tuple[List[subprocess.Popen], Optional[str]]:
    """Start `cmd` as `ranks` processes of the ring backend, as mlx.launch would (MLX_HOSTFILE with free
    127.0.0.1 ports, MLX_RANK) but without its output-relaying loop, which keeps a core busy. Each gets a
    session of its own. `rank0` / `others`: extra Popen arguments (`others`: one dict for every other
    rank, or a list of ranks - 1); `rank_env(rank)`: that rank's extra environment. Returns ([rank 0,
    rank 1, ...], hostfile or None); the caller removes the hostfile and ends the processes (kill_groups)."""
    start = dict(cwd=ROOT, start_new_session=True)
    procs, hostfile = [], None

    def env_of(rank: int) -> dict:
        ring = {"MLX_HOSTFILE": hostfile, "MLX_RANK": str(rank)} if ranks > 1 else {}
        return {**env, **(rank_env(rank) if rank_env else {}), **ring}

    try:
        if ranks > 1:
            fd, hostfile = tempfile.mkstemp(suffix=".json")
            # ranks + 1 ports: rank 0's control link takes the one above the ring's.
            os.write(fd, json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(ranks + 1)[:ranks]]).encode())
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
    """SIGTERM each process's group, then SIGKILL what is left after `grace` seconds; returns once every
    group is empty, not only its leader (mlx.launch's ranks live in its group and may outlive it)."""
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


def run_ranks(cmd: list, ranks: int, env: dict, timeout: float, relay: bool = False) -> dict:
    """Run `cmd` as `ranks` ring processes (start_ranks) until rank 0 exits; its last stdout line starting
    with "{" is the result, {"error": ...} if there is none. relay: rank 0's stderr goes to ours as it
    comes (progress). Every process is gone when this returns."""
    procs, hostfile = start_ranks(cmd, ranks, env, rank0=dict(
        stdout=subprocess.PIPE, stderr=None if relay else subprocess.PIPE, stdin=subprocess.DEVNULL, text=True),
        others=dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    load = os.getloadavg()[0]
    try:
        out, err = procs[0].communicate(timeout=timeout)
        for p in procs[1:]:
            p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "loadavg": load}
    finally:
        kill_groups(procs, grace=0)
        if hostfile:
            os.unlink(hostfile)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": f"exit {procs[0].returncode}: {(err or out or '(its stderr above)').strip()[-1500:]}",
                "loadavg": load}
    # Kept, but recorded: under mpirun a rank sometimes aborts at exit after printing its result.
    return dict(json.loads(lines[-1]), loadavg=load, exit_code=max((p.returncode for p in procs), key=abs))


def wait_serving(target: str, procs: List[subprocess.Popen], timeout: float = 600.0):
    """Poll grpc.health.v1 at `target` until SERVING. Returns (channel, seconds waited); raises
    RuntimeError if one of `procs` exits first or `timeout` passes."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(target)
    health = health_pb2_grpc.HealthStub(channel)
    tic = time.perf_counter()
    try:
        while True:
            dead = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
            if dead:
                raise RuntimeError(f"the server exited before serving (process, exit code): {dead}")
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


class Server:
    """run_trinity.py --serve (this checkout's, or `run`) on `ranks` ranks of this machine, as a `with`
    block: started, SERVING, then every process group ended however the block exits. How P > 1 ranks
    start (`backend`): "ring", processes started here (start_ranks; gpu_per_rank: rank r gets
    CUDA_VISIBLE_DEVICES=r); "launch", `python -m launch run --single-host P --no-router`; "nccl" or
    "mlx-launch-ring", mlx.launch with that backend. `http`: also serve HTTP (`self.http`, host:port).
    A server that dies is named with its exit code and log tail (why)."""

    BACKENDS = ("ring", "launch", "nccl", "mlx-launch-ring")

    def __init__(self, ranks: int, args: list, env: dict, backend: str = "ring", timeout: float = 600,
                 gpu_per_rank: bool = False, run: str = RUN, name: str = "runner", http: bool = False):
        self.ranks, self.args, self.env, self.backend, self.timeout = ranks, args, env, backend, timeout
        self.gpu_per_rank, self.run, self.want_http = gpu_per_rank, run, http
        self.label = f"{name} P={ranks}" + (f" ({backend})" if ranks > 1 else "")
        self.procs, self.names, self.hostfile, self.channel, self.files, self.logs = [], [], None, None, [], []
        self.logdir = tempfile.mkdtemp(prefix="trinity-bench-")

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
        ports = free_ports(2)
        self.target, self.http = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
        cmd = [PY, self.run, "--serve", self.target, *(["--http", self.http] if self.want_http else []), *self.args]
        if self.ranks == 1 or self.backend == "ring":
            self.logs = [os.path.join(self.logdir, f"rank{r}.log") for r in range(self.ranks)]
            self.files = [open(path, "w") for path in self.logs]
            stdio = [dict(stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL) for f in self.files]
            gpu = (lambda r: {"CUDA_VISIBLE_DEVICES": str(r)}) if self.gpu_per_rank else None
            self.names = [f"rank {r}" for r in range(self.ranks)]
            self.procs, self.hostfile = start_ranks(cmd, self.ranks, self.env, rank0=stdio[0], others=stdio[1:],
                                                    rank_env=gpu)
            return
        if self.backend == "launch":
            launcher = [PY, "-m", "launch", "run", "--single-host", str(self.ranks), "--no-plan", "--no-router", "--"]
        else:  # mlx.launch: rank 0's control port is one above the ring's ports, or NCCL_PORT + 1
            where = (["--backend", "nccl", "--nccl-port", str(free_ports(2)[0])] if self.backend == "nccl" else
                     ["--backend", "ring", "--starting-port", str(free_ports(self.ranks + 1)[0])])
            launcher = [*MLX_LAUNCH, *where, "-n", str(self.ranks), "--"]
        self.logs = [os.path.join(self.logdir, "launcher.log")]
        self.files = [open(self.logs[0], "w")]
        self.names = [f"{self.backend} (all ranks)"]
        self.procs = [subprocess.Popen([*launcher, *cmd], cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL,
                                       stdout=self.files[0], stderr=subprocess.STDOUT, start_new_session=True)]

    def log(self) -> str:
        """Rank 0's log (or the launcher's) so far."""
        self.files[0].flush()
        return Path(self.logs[0]).read_text(errors="replace")

    def why(self, what: str) -> str:
        """`what` went wrong: name any process that exited (with its code) and add the log tails."""
        time.sleep(0.5)  # a dying rank's last lines
        dead = [f"{name} (pid {p.pid}) exited with code {p.returncode}"
                for name, p in zip(self.names, self.procs) if p.poll() is not None]
        for f in self.files:
            f.flush()
        tails = [f"[{name}] " + Path(path).read_text(errors="replace").strip()[-1500:]
                 for name, path in zip(self.names, self.logs) if Path(path).exists()]
        return f"{self.label}: {what}" + (f"; {', '.join(dead)}" if dead else "") + "\nlog tail:\n" + "\n".join(tails)

    def __exit__(self, *exc):
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        kill_groups(self.procs)
        if self.hostfile:
            os.unlink(self.hostfile)
            self.hostfile = None
        for f in self.files:
            f.close()
        shutil.rmtree(self.logdir, ignore_errors=True)
        return False

    def dead(self) -> bool:
        return any(p.poll() is not None for p in self.procs)

    def status(self) -> dict:
        """GET /v1/status (a server started with `http`)."""
        with urllib.request.urlopen(f"http://{self.http}/v1/status", timeout=30) as r:
            return json.loads(r.read())

    def stub(self):
        from distributed.serving.proto import generation_pb2_grpc as pb_grpc

        return pb_grpc.GenerationStub(self.channel)

    def model_info(self) -> dict:
        from distributed.serving.proto import generation_pb2 as pb

        info = self.stub().GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
        return {"ranks": [{"rank": r.rank, "host": r.host, "layers": [r.layer_start, r.layer_end],
                           "peak_memory_bytes": r.peak_memory_bytes} for r in info.ranks]}


def grpc_generate(stub, token_ids: List[int], max_tokens: int, timeout: Optional[float] = 600, **fields) -> dict:
    """One Generate of raw token ids (greedy unless `fields` say otherwise), timed at the client:
    `sent`, `first` / `last` (responses carrying tokens; None if none), `times` (each such response),
    `done`; `token_ids`, `finish_reason` and the server's `usage`."""
    from distributed.serving.proto import generation_pb2 as pb

    request = pb.GenerateRequest(token_ids=token_ids, max_tokens=max_tokens, **{"temperature": 0.0, **fields})
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


def concurrent(calls: list) -> list:
    """Run the zero-argument `calls` on threads released together; their results (or {"error": ...})."""
    barrier, out = threading.Barrier(len(calls)), [None] * len(calls)

    def one(i):
        try:
            barrier.wait()
            out[i] = calls[i]()
        except Exception as e:  # reported with the result
            out[i] = {"error": f"{type(e).__name__}: {e.details() if hasattr(e, 'details') else e}"}

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def concurrent_streams(stub, prompts: list, max_tokens, timeout: float, gap: float = 0.0) -> dict:
    """One greedy Generate stream per prompt, released together, or (gap) stream i `gap` * i s after the
    first; max_tokens: one for all, or a list. Aggregate = generated tokens / (last stream's end - first
    request sent); `ttfts_s` per stream (None if it got no token); `itl_s`: gaps between a stream's
    token responses, all streams, at p50, p99 and max."""
    def call(i):
        limit = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
        return lambda: time.sleep(gap * i) or grpc_generate(stub, prompts[i], limit, timeout)

    runs, n = concurrent([call(i) for i in range(len(prompts))]), len(prompts)
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"streams": n, "error": f"{len(errors)} of {n} streams failed: {errors[0]}"}
    tokens = sum(len(r["token_ids"]) for r in runs)
    wall = max(r["done"] for r in runs) - min(r["sent"] for r in runs)
    ttfts = [r["first"] - r["sent"] if r["first"] is not None else None for r in runs]
    got = [t for t in ttfts if t is not None]
    itls = [b - a for r in runs for a, b in zip(r["times"], r["times"][1:])]
    return {"streams": n, "wall_s": wall, "tokens": tokens, "aggregate_tps": tokens / wall, "arrival_gap_s": gap,
            "itl_s": {"p50": percentile(itls, 50), "p99": percentile(itls, 99), "max": percentile(itls, 100)},
            "mean_ttft_s": sum(got) / len(got) if got else None, "max_ttft_s": max(got) if got else None,
            "ttfts_s": ttfts, "token_ids": [r["token_ids"] for r in runs],
            "finish_reasons": [r["finish_reason"] for r in runs]}


def machine() -> dict:
    """What the figures were measured on: this host, MLX's device and any NVIDIA GPUs."""
    out = {"host": platform.node(), "platform": platform.platform(), "processor": platform.processor(),
           "cpus": os.cpu_count(), "loadavg": os.getloadavg()[0]}
    try:
        import mlx.core as mx

        out["mlx"], out["device"] = mx.__version__, str(mx.default_device())
    except ImportError as e:  # measured all the same; say why the device is unknown
        out["device"] = f"unknown ({e})"
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True)
        out["gpus"] = smi.stdout.strip().splitlines()
    return out


def commit() -> str:
    """This checkout's commit, with "+changes" where tracked files differ from it."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def save(path, results: dict, settings: dict = None) -> Path:
    """The one results format: the machine, commit, date and command, the settings, then the results'
    own keys. Written whole each time (a run stopped at a time limit keeps what it saved)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {"machine": machine(), "commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc)
            .isoformat(timespec="seconds"), "command": "python -m bench " + " ".join(sys.argv[1:]),
            "settings": {k: v for k, v in (settings or {}).items() if k not in ("run", "parser")}}
    path.write_text(json.dumps({**head, **results}, indent=1, default=str))
    return path


def out_path(args, name: str) -> Path:
    """--out, or bench/results/<name>.json (<name>_smoke.json for --smoke)."""
    smoke = "_smoke" if getattr(args, "smoke", False) else ""
    return Path(args.out) if args.out else RESULTS / f"{name}{smoke}.json"
