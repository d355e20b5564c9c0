"""Soak: local ranks serving gRPC under random load for a while; memory, errors, wrong outputs.

    python bench/soak.py [--minutes 30] [--ranks 4] [--clients 4] [--model PATH] [--out soak.json]

Starts `python -m launch run --single-host RANKS -- run_trinity.py --serve 127.0.0.1:PORT`
(the embedded tiny model unless --model), waits for SERVING, then for --minutes
several client threads send random requests:
  - random prompts: token ids (lengths 1..--max-prompt, a pool of prompts reused
    so references are shared, plus fresh ones) and some text prompts;
    random max_tokens 1..--max-new;
  - 10% cancelled mid-stream (after a random number of tokens);
  - 5% invalid (temperature < 0, top_p 0 or > 1, min_p > 1, top_k < 0, a token id
    outside the vocabulary, a prompt longer than the context, max_tokens above
    the server's cap): each must get INVALID_ARGUMENT, and the server keeps serving;
  - of the rest, 70% greedy, 30% sampled (temperature, top_p, top_k, min_p, seed).
Greedy streams (and the tokens a cancelled greedy stream got) are compared with
one-device mlx-lm on the same checkpoint (as tests/reference.py does; computed
once per prompt in this process, memoized): a different token is a wrong output,
unless the reference's top two log-probabilities at that step are within
--tie-tolerance (a near tie, where float rounding may pick either: counted apart).
Sampled streams are checked for shape (lengths, finish reason, ids in the vocabulary).

Every --sample-every seconds each rank's resident memory (VmRSS from
/proc/PID/status) is recorded, and the launcher's CPU time. GetModelInfo's
per-rank peak_memory_bytes is recorded at the start and the end. At the end the
launcher gets SIGTERM (a clean stop) and must leave no rank behind.

Prints a table (time, RSS per rank) and a summary; writes JSON to --out. Exits 1
if there was any unexpected error, wrong output, a rank or launcher that died, or
a process left behind.
"""

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from distributed.proto import generation_pb2 as pb  # noqa: E402
from distributed.proto import generation_pb2_grpc as pb_grpc  # noqa: E402

STARTED = re.compile(r"launch: started rank (\d+) \(pid (\d+)\)")
SERVING = health_pb2.HealthCheckResponse.SERVING
WORDS = ("the quick brown fox jumps over a lazy dog while seven tired engineers watch memory "
         "graphs climb and fall across four small ranks").split()


def free_port() -> int:
    import socket

    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


def rss_bytes(pid: int) -> Optional[int]:
    """Resident memory of a process (VmRSS), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # no /proc (macOS)
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
        return int(out.stdout.strip()) * 1024 if out.stdout.strip() else None
    except (OSError, ValueError):
        return None


def cpu_seconds(pid: int) -> Optional[float]:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        return state != "Z"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class Reference:
    """Greedy tokens from one-device mlx-lm, memoized per prompt (tests/reference.py's approach)."""

    def __init__(self, model_path: Path, max_new: int):
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.utils import load_model, load_tokenizer

        from distributed.shard.config import model_args, read_config

        self.mx, self.generate_step = mx, generate_step
        config = read_config(model_path)
        # HF-layout configs carry rope_parameters, which mlx-lm's ModelArgs ignores.
        self.model, _ = load_model(Path(model_path), model_config={"rope_theta": model_args(config).rope_theta})
        self.tokenizer = load_tokenizer(Path(model_path), eos_token_ids=config.get("eos_token_id"))
        self.eos = set(self.tokenizer.eos_token_ids)
        self.max_new = max_new
        self.lock = threading.Lock()
        self.memo: Dict[Tuple[int, ...], Tuple[List[int], List[float], List[float], bool]] = {}
        self.computed = 0

    def encode(self, text: str) -> List[int]:
        with self.lock:
            return list(self.tokenizer.encode(text))

    def greedy(self, ids: List[int], n: int):
        """(tokens, logprobs, top-2 margins, hit EOS) for up to n tokens."""
        key = tuple(ids)
        with self.lock:
            if key not in self.memo or (len(self.memo[key][0]) < n and not self.memo[key][3]):
                tokens, logprobs, margins, eos = [], [], [], False
                mx = self.mx
                for token, lp in self.generate_step(mx.array(ids), self.model, max_tokens=max(n, self.max_new)):
                    top2 = mx.topk(lp, 2).tolist()
                    margins.append(abs(top2[1] - top2[0]))
                    if token in self.eos:
                        eos = True
                        break
                    tokens.append(int(token))
                    logprobs.append(lp[token].item())
                self.memo[key] = (tokens, logprobs, margins, eos)
                self.computed += 1
            tokens, logprobs, margins, eos = self.memo[key]
        return tokens[:n], logprobs[:n], margins, eos and len(tokens) < n


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.errors: List[str] = []
        self.wrong: List[dict] = []
        self.near_ties: List[dict] = []
        self.tokens = 0
        self.max_logprob_diff = 0.0

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def error(self, message: str) -> None:
        with self.lock:
            self.counts["errors"] += 1
            if len(self.errors) < 50:
                self.errors.append(message)
        print(f"soak: ERROR {message}", file=sys.stderr, flush=True)


class Soak:
    def __init__(self, args, stub, info, reference: Reference, stats: Stats, end: float):
        self.args, self.stub, self.info, self.ref, self.stats, self.end = args, stub, info, reference, stats, end
        rng = random.Random(args.seed)
        self.pool = [self.random_ids(rng) for _ in range(args.pool)]
        self.broken = threading.Event()  # the ring is down: nothing more to learn
        self.time_up = threading.Event()
        self.lock = threading.Lock()
        self.active: set = set()  # calls in flight

    def cut_in_flight(self) -> None:
        """Time is up: cancel what is still streaming or queued (counted apart, not as requests)."""
        self.time_up.set()
        with self.lock:
            calls = list(self.active)
        for call in calls:
            call.cancel()

    def random_ids(self, rng: random.Random) -> List[int]:
        # Mostly short prompts, some long ones (past the sliding window).
        n = rng.randint(1, 24) if rng.random() < 0.6 else rng.randint(1, self.args.max_prompt)
        return [rng.randrange(0, 256) for _ in range(n)]

    def prompt(self, rng: random.Random) -> Tuple[dict, List[int]]:
        """Request fields for a prompt, and its token ids."""
        if rng.random() < 0.2:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
            return {"prompt": text}, self.ref.encode(text)
        ids = rng.choice(self.pool) if rng.random() < 0.7 else self.random_ids(rng)
        return {"token_ids": ids}, ids

    def invalid(self, rng: random.Random) -> Tuple[str, dict]:
        info = self.info
        ids = [rng.randrange(0, 256) for _ in range(rng.randint(1, 8))]
        cases = [
            ("temperature<0", dict(token_ids=ids, temperature=-rng.uniform(0.01, 5))),
            ("top_p=0", dict(token_ids=ids, top_p=0.0)),
            ("top_p>1", dict(token_ids=ids, top_p=rng.uniform(1.01, 3))),
            ("min_p>1", dict(token_ids=ids, min_p=rng.uniform(1.01, 3))),
            ("top_k<0", dict(token_ids=ids, top_k=-rng.randint(1, 50))),
            ("token out of vocab", dict(token_ids=ids + [info.vocab_size + rng.randint(0, 10**6)])),
            ("prompt too long", dict(token_ids=[rng.randrange(0, 256) for _ in range(info.max_context + 1)],
                                     max_tokens=1)),
            ("max_tokens above cap", dict(token_ids=ids, max_tokens=info.max_tokens_cap + 1)),
            ("max_tokens=0", dict(token_ids=ids, max_tokens=0)),
        ]
        return rng.choice(cases)

    def client(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index + 1)
        first = True
        while time.monotonic() < self.end and not self.broken.is_set():
            roll = rng.random()
            if first:  # so that even a short soak has each kind: client 0 starts invalid, client 1 cancelled
                roll = {0: 0.0, 1: 0.1}.get(index, roll)
                first = False
            errors = self.stats.counts["errors"]
            try:
                if roll < 0.05:
                    self.run_invalid(rng)
                elif roll < 0.15:
                    self.run_valid(rng, cancel=True)
                else:
                    self.run_valid(rng, cancel=False)
            except Exception as e:  # a bug of this script must not pass for a clean soak
                self.stats.error(f"client {index}: {type(e).__name__}: {e}")
            if self.stats.counts["errors"] > errors:
                time.sleep(0.2)  # do not hammer a server in trouble

    def run_invalid(self, rng: random.Random) -> None:
        name, fields = self.invalid(rng)
        try:
            for _ in self.stub.Generate(pb.GenerateRequest(**fields), timeout=self.args.request_timeout):
                pass
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                self.stats.add("invalid_rejected")
                return
            self.stats.error(f"invalid request ({name}) got {e.code().name}: {e.details()}")
            return
        self.stats.error(f"invalid request ({name}) was accepted")

    def run_valid(self, rng: random.Random, cancel: bool) -> None:
        fields, ids = self.prompt(rng)
        n = rng.randint(1, self.args.max_new)
        greedy = rng.random() < 0.7
        if cancel:
            n = max(n, 4)
        fields["max_tokens"] = n
        if greedy:
            fields["temperature"] = 0.0
        else:
            fields.update(temperature=rng.uniform(0.3, 1.5), top_p=rng.uniform(0.5, 1.0), top_k=rng.randint(0, 40),
                          min_p=rng.uniform(0.0, 0.1), seed=rng.randrange(2**32))
        cancel_after = rng.randint(1, n - 1) if cancel else None
        tokens, logprobs, finish, usage = [], [], None, None
        call = self.stub.Generate(pb.GenerateRequest(**fields), timeout=self.args.request_timeout)
        with self.lock:
            self.active.add(call)
        cancelled = cut = False
        try:
            for r in call:
                tokens += list(r.token_ids)
                logprobs += list(r.logprobs)
                if r.finish_reason:
                    finish, usage = r.finish_reason, r.usage
                if cancel_after is not None and len(tokens) >= cancel_after and not finish:
                    call.cancel()
                    cancelled = True
                    break
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and self.time_up.is_set() and not cancelled:
                cancelled = cut = True  # the soak's time was up: cut short, not counted
            elif not (cancelled and e.code() == grpc.StatusCode.CANCELLED):
                what = "greedy" if greedy else "sampled"
                self.stats.error(f"{what} request ({len(ids)} prompt tokens, max_tokens {n}) got "
                                 f"{e.code().name}: {e.details()}")
                return
        finally:
            with self.lock:
                self.active.discard(call)
        self.stats.add("tokens", len(tokens))
        if not cancelled and not self.check_shape(ids, n, tokens, logprobs, finish, usage):
            return
        if greedy:
            verdict = self.check_greedy(ids, n, tokens, logprobs, finish, partial=cancelled)
            if verdict != "ok":
                return  # counted as a wrong output or a near tie
        # Exactly one outcome per request: ok_greedy, ok_sampled or cancelled (the rest above).
        if cut:
            self.stats.add("cut_at_end")  # not counted as a request
        elif cancelled:
            self.stats.add("cancelled")
            if greedy:
                self.stats.add("cancelled_prefix_checked")
        else:
            self.stats.add("ok_greedy" if greedy else "ok_sampled")
            if cancel:
                self.stats.add("cancel_too_late")  # it finished before the chosen token

    def check_shape(self, ids, n, tokens, logprobs, finish, usage) -> bool:
        problems = []
        if finish not in ("stop", "length"):
            problems.append(f"finish_reason {finish!r}")
        if len(tokens) > n or (finish == "length" and len(tokens) != n):
            problems.append(f"{len(tokens)} tokens for max_tokens {n} ({finish})")
        if len(logprobs) != len(tokens):
            problems.append(f"{len(logprobs)} logprobs for {len(tokens)} tokens")
        if any(not 0 <= t < self.info.vocab_size for t in tokens):
            problems.append("a token id outside the vocabulary")
        if any(not lp <= 1e-4 for lp in logprobs):
            problems.append("a logprob above 0")
        if usage is not None and (usage.completion_tokens != len(tokens) or usage.prompt_tokens != len(ids)):
            problems.append(f"usage {usage.prompt_tokens}+{usage.completion_tokens} for {len(ids)}+{len(tokens)}")
        if problems:
            self.stats.error(f"malformed stream ({len(ids)} prompt tokens): " + "; ".join(problems))
        return not problems

    def check_greedy(self, ids, n, tokens, logprobs, finish, partial: bool) -> str:
        """"ok", "wrong" or "near tie" (the last two counted here)."""
        ref_tokens, ref_logprobs, margins, ref_eos = self.ref.greedy(ids, n)
        expected = ref_tokens[: len(tokens)] if partial else ref_tokens
        record = {"prompt_len": len(ids), "prompt_head": ids[:16], "max_tokens": n, "got": tokens,
                  "expected": expected, "finish": finish, "partial": partial}
        if tokens != expected or (not partial and finish != ("stop" if ref_eos else "length")):
            at = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), min(len(tokens), len(expected)))
            margin = margins[at] if at < len(margins) else None
            record.update(diverges_at=at, reference_top2_margin=margin)
            with self.stats.lock:
                if margin is not None and margin < self.args.tie_tolerance:
                    self.stats.near_ties.append(record)
                    self.stats.counts["near_tie_divergences"] += 1
                    return "near tie"
                self.stats.counts["wrong_outputs"] += 1
                if len(self.stats.wrong) < 20:
                    self.stats.wrong.append(record)
            print(f"soak: WRONG OUTPUT {json.dumps(record)}", file=sys.stderr, flush=True)
            return "wrong"
        diff = max((abs(a - b) for a, b in zip(logprobs, ref_logprobs)), default=0.0)
        with self.stats.lock:
            self.stats.max_logprob_diff = max(self.stats.max_logprob_diff, diff)
            if diff <= self.args.logprob_tolerance:
                return "ok"
            self.stats.counts["wrong_outputs"] += 1
            record["logprob_diff"] = diff
            if len(self.stats.wrong) < 20:
                self.stats.wrong.append(record)
        print(f"soak: WRONG LOGPROBS {json.dumps(record)}", file=sys.stderr, flush=True)
        return "wrong"


def wait_serving(health, launcher: subprocess.Popen, log_path: Path, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if launcher.poll() is not None:
            sys.exit(f"soak: the launcher exited ({launcher.returncode}) before serving:\n"
                     + log_path.read_text()[-4000:])
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    sys.exit(f"soak: not SERVING after {timeout:.0f} s:\n" + log_path.read_text()[-4000:])


def rank_pids(log_path: Path, ranks: int) -> Dict[int, int]:
    pids = {int(r): int(p) for r, p in STARTED.findall(log_path.read_text())}
    if sorted(pids) != list(range(ranks)):
        sys.exit(f"soak: expected {ranks} 'launch: started rank' lines in the launcher log, got {pids}")
    return pids


def model_info_memory(stub) -> Optional[List[int]]:
    try:
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
        return [r.peak_memory_bytes for r in sorted(info.ranks, key=lambda r: r.rank)]
    except grpc.RpcError:
        return None


def mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    p.add_argument("--model", help="checkpoint folder (default: the embedded tiny model)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--log", help="launcher and rank output (default: a temporary file, kept)")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between memory samples")
    p.add_argument("--max-prompt", type=int, default=300, help="longest random prompt (tokens)")
    p.add_argument("--max-new", type=int, default=48, help="largest random max_tokens")
    p.add_argument("--pool", type=int, default=24, help="prompts reused across requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0, help="deadline of each request (s)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--tie-tolerance", type=float, default=1e-4,
                   help="a greedy divergence where mlx-lm's top two logprobs are closer than this is a near tie")
    p.add_argument("--logprob-tolerance", type=float, default=1e-3)
    p.add_argument("--restart", type=int, default=0, help="launch run --restart N (a restart is still an error here)")
    p.add_argument("--launch-arg", action="append", default=[], help="extra `launch run` flag (repeatable)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra run_trinity.py flag (repeatable)")
    args = p.parse_args()
    if args.max_new < 4:
        p.error("--max-new must be at least 4")

    from distributed.tiny_checkpoint import default_checkpoint

    model = Path(args.model) if args.model else default_checkpoint()
    address = f"127.0.0.1:{free_port()}"
    log_path = Path(args.log) if args.log else Path(tempfile.mkstemp(prefix="trinity-soak-", suffix=".log")[1])
    log = open(log_path, "w")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, "-m", "launch", "run", "--single-host", str(args.ranks), "--restart", str(args.restart),
           *args.launch_arg, "--",
           "run_trinity.py", "--model", str(model), "--serve", address, *args.serve_arg]
    print(f"soak: {' '.join(cmd)}\nsoak: log {log_path}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.GenerationStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    results: dict = {}
    try:
        wait_serving(health, launcher, log_path, args.startup_timeout)
        startup_s = time.monotonic() - t0
        pids = rank_pids(log_path, args.ranks)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
        peak_start = [r.peak_memory_bytes for r in sorted(info.ranks, key=lambda r: r.rank)]
        print(f"soak: serving on {address} after {startup_s:.1f} s; rank pids {pids}; "
              f"{args.clients} clients for {args.minutes:g} min", file=sys.stderr, flush=True)
        reference = Reference(model, args.max_new)
        stats = Stats()
        start = time.monotonic()
        end = start + args.minutes * 60
        soak = Soak(args, stub, info, reference, stats, end)

        samples = []
        stop_sampling = threading.Event()

        def sample():
            samples.append({"t": round(time.monotonic() - start, 1),
                            "rss": [rss_bytes(pids[r]) for r in range(args.ranks)],
                            "launcher_cpu_s": cpu_seconds(launcher.pid),
                            "rank_cpu_s": [cpu_seconds(pids[r]) for r in range(args.ranks)],
                            "requests": sum(stats.counts[k] for k in ("ok_greedy", "ok_sampled", "cancelled",
                                                                       "invalid_rejected", "errors", "wrong_outputs",
                                                                       "near_tie_divergences"))})

        def sampler():
            while not stop_sampling.wait(args.sample_every):
                sample()

        sample()
        threads = [threading.Thread(target=soak.client, args=(i,), name=f"client-{i}") for i in range(args.clients)]
        sampling = threading.Thread(target=sampler, name="sampler", daemon=True)
        sampling.start()
        for t in threads:
            t.start()
        last_report = time.monotonic()
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=1)
            if time.monotonic() > end and not soak.time_up.is_set():
                soak.cut_in_flight()
            if time.monotonic() - last_report > 60:
                last_report = time.monotonic()
                c = stats.counts
                print(f"soak: {last_report - start:.0f} s: {dict(c)}", file=sys.stderr, flush=True)
            if launcher.poll() is not None:
                stats.error(f"the launcher exited ({launcher.returncode}) during the soak")
                soak.broken.set()
            elif stats.counts["errors"] and not soak.broken.is_set():
                try:
                    serving = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
                except grpc.RpcError:
                    serving = False
                if not serving:
                    stats.error("health turned NOT_SERVING during the soak: stopping early")
                    soak.broken.set()
        stop_sampling.set()
        sample()
        soak_s = time.monotonic() - start
        try:
            still_serving = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
        except grpc.RpcError:
            still_serving = False
        if not still_serving:
            stats.error("health is not SERVING at the end")
        peak_end = model_info_memory(stub)
        dead = [r for r, pid in pids.items() if not alive(pid)]
        if dead:
            stats.error(f"rank(s) {dead} died during the soak")
    finally:
        channel.close()
        # A clean stop: SIGTERM to the launcher, which stops the ring and must leave nothing behind.
        stop_tic = time.monotonic()
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
        try:
            launcher_status = launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher_status = "did not exit within 60 s of SIGTERM (killed)"
        stop_s = time.monotonic() - stop_tic
        log.close()
    time.sleep(0.5)
    orphans = [pid for pid in pids.values() if alive(pid)]
    if orphans:
        stats.error(f"rank process(es) {orphans} still running after the launcher exited")
        for pid in orphans:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
    if launcher_status != 0:
        stats.error(f"the launcher's exit status after SIGTERM was {launcher_status}")
    restarts = log_path.read_text().count("restarting the whole ring")
    if restarts:
        stats.error(f"the launcher restarted the ring {restarts} time(s)")

    c = stats.counts
    ok = c["ok_greedy"] + c["ok_sampled"]
    total = ok + c["cancelled"] + c["invalid_rejected"] + c["errors"] + c["wrong_outputs"] + c["near_tie_divergences"]
    first, last = samples[0], samples[-1]
    growth = [None if a is None or b is None else b - a for a, b in zip(first["rss"], last["rss"])]
    peak_rss = [max((s["rss"][r] or 0) for s in samples) for r in range(args.ranks)]

    print(f"\nper-rank resident memory (MiB), sampled every {args.sample_every:g} s")
    print(f"{'time s':>8}{'requests':>10}" + "".join(f"{'rank ' + str(r):>11}" for r in range(args.ranks))
          + f"{'launcher cpu s':>16}")
    for s in samples:
        cpu = "-" if s["launcher_cpu_s"] is None else f"{s['launcher_cpu_s']:.1f}"
        print(f"{s['t']:>8.0f}{s['requests']:>10}" + "".join(f"{mib(v):>11}" for v in s["rss"]) + f"{cpu:>16}")
    print(f"\nsoak: {soak_s / 60:.1f} min, {args.ranks} ranks, {args.clients} clients, model {model}")
    print(f"requests {total}: ok {ok} (greedy, checked against mlx-lm {c['ok_greedy']}; sampled {c['ok_sampled']}; "
          f"of these {c['cancel_too_late']} ended before their planned cancel), cancelled {c['cancelled']} "
          f"(greedy prefix checked {c['cancelled_prefix_checked']}), invalid rejected {c['invalid_rejected']}, "
          f"errors {c['errors']}, wrong outputs {c['wrong_outputs']}, near-tie divergences {c['near_tie_divergences']}; "
          f"cut short when time was up {c['cut_at_end']} (prefix checked, not counted)")
    print(f"tokens streamed {c['tokens']} ({c['tokens'] / max(soak_s, 1e-9):.1f}/s); references computed "
          f"{reference.computed}; max |logprob - mlx-lm| {stats.max_logprob_diff:.2e}")
    print("memory growth first->last sample (MiB): "
          + ", ".join(f"rank {r} {mib(first['rss'][r])} -> {mib(last['rss'][r])} ({'-' if g is None else f'{g / 2**20:+.1f}'})"
                      for r, g in enumerate(growth)))
    print(f"peak RSS (MiB): {', '.join(mib(v) for v in peak_rss)}; GetModelInfo peak_memory_bytes at start "
          f"{peak_start}, at end {peak_end}")
    print(f"launcher: CPU {first['launcher_cpu_s']}->{last['launcher_cpu_s']} s over the soak; exit status after "
          f"SIGTERM {launcher_status} in {stop_s:.1f} s; restarts {restarts}; processes left behind {orphans}")
    for e in stats.errors[:10]:
        print(f"  error: {e}")
    for w in stats.wrong[:5]:
        print(f"  wrong: {json.dumps(w)}")

    results = {
        "settings": {k: v for k, v in vars(args).items()},
        "model": str(model),
        "startup_s": startup_s,
        "soak_s": soak_s,
        "counts": dict(c),
        "ok_greedy": c["ok_greedy"],
        "ok_sampled": c["ok_sampled"],
        "cancelled": c["cancelled"],
        "invalid_rejected": c["invalid_rejected"],
        "requests": total,
        "ok": ok,
        "errors": c["errors"],
        "wrong_outputs": c["wrong_outputs"],
        "near_tie_divergences": c["near_tie_divergences"],
        "error_messages": stats.errors,
        "wrong": stats.wrong,
        "near_ties": stats.near_ties[:20],
        "max_logprob_diff": stats.max_logprob_diff,
        "references_computed": reference.computed,
        "rank_pids": pids,
        "samples": samples,
        "rss_first": first["rss"],
        "rss_last": last["rss"],
        "rss_growth": growth,
        "rss_peak": peak_rss,
        "model_info_peak_memory_start": peak_start,
        "model_info_peak_memory_end": peak_end,
        "launcher_status": launcher_status,
        "restarts": restarts,
        "stop_s": stop_s,
        "orphans": orphans,
        "log": str(log_path),
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")
    sys.exit(1 if c["errors"] or c["wrong_outputs"] else 0)


if __name__ == "__main__":
    main()
