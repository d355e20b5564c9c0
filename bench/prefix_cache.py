"""The prefix cache and its disk tier against a real server (run_trinity.py --serve --http, greedy,
random byte-token prompts): what a long prompt costs cold, and what it costs again.

For each --prompt-lens length L, on one server whose ranks keep their disk tier in fresh temporary
folders (rank r: --prefix-cache-dir TMP/rank<r>, so each rank's bytes are its own):

  (a) cold     the L-token prompt, max_tokens 1: the prefill (TTFT at the client)
  (b) ram      the same prompt again, same server: restored from RAM
  (c) block    a prompt sharing its first L - 64 tokens, then 64 others: a shared prefix reused
  (d) disk     after the server is stopped and started again on the same folders: the (a) prompt,
               restored from every rank's disk (the entry files dropped from the page cache first,
               posix_fadvise DONTNEED, unless --keep-page-cache)

Each row: TTFT, cached tokens (gRPC usage) and, from rank 0's access log, cached_ram / cached_disk;
restore / prefill (TTFT over (a)'s); whether the greedy token equals (a)'s. Per rank, after (a)'s
entry is written: RAM bytes of the stored entries (/v1/status ranks[].prefix_cache_bytes, (a)'s
increase) and disk bytes per token ((a)'s files in that rank's folder / L). Each server first takes a
distinct --warmup-len prompt (kernels, first-request costs), which shares no block with the others.

--itl: decode inter-token latency of --itl-streams streams (short prompts, decoding until stopped)
while --itl-prompts distinct --itl-len-token prompts arrive one after another (max_tokens 1) and, with
the disk tier on, their entries are written to disk; the streams stop --itl-tail s after the last
prompt's token. Once with the disk tier (fresh folders), once with --prefix-cache-dir none, in
--itl-reps interleaved rounds; ITL p50/p99/max over all gaps and over the gaps that overlap no long
prompt's prefill ("quiet": where the disk writer, not the prefill, is what decode shares the CPU with)
and over the quiet gaps within --itl-window s after a long prompt's first token ("after": when its
entry is written); the ratio on / off. The all-gaps p99 mixes in the prefill's stalls of decode
(about one 2,048-token chunk each) and swings with how many of them make 1% of the gaps.

Ranks: --ranks P (default 1; P > 1: a ring started here, harness.start_ranks). The embedded model by
default (--model: another checkpoint; --make-mini PATH: Trinity-Mini's shape, random 4-bit weights,
built there). OpenBLAS is preloaded (--blas) with OPENBLAS_NUM_THREADS=1, as tests/serving/test_agents.py
does. Every process started here is gone when it returns, and the temporary folders with it.
--smoke: prompts of 512 and 1024 tokens, a 2-prompt --itl of 512 tokens.
"""

import logging
import random
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench.harness import (PY, Server, bench_env, flags, free_ports, int_list, make_mini, out_path, percentile, save,
                           shrink, start_ranks)

log = logging.getLogger("bench")

DIVERGE = 64  # (c): the last tokens that differ
ITL_PROMPT = 64  # the decoding streams' prompt length (under a block: never written to disk)
# Measured prompts use ids 10..249; the warm-up and the streams' prompts start with 3, so they share
# no block (and no first token) with them.
LOW, HIGH = 10, 250


def add_arguments(p) -> None:
    flags(p, smoke=False, out=None, model=None, ranks=[1], blas="openblas", timeout=900.0)
    p.add_argument("--make-mini", metavar="PATH", help="Trinity-Mini's shape, random 4-bit weights, made at PATH")
    p.add_argument("--prompt-lens", type=int_list, default=[4096, 16384], help="prompt lengths (default 4096,16384)")
    p.add_argument("--steps", default="cold,ram,block,disk", help="which of (a)-(d) to run, comma-separated "
                   "(cold always; default all)")
    p.add_argument("--keep-page-cache", action="store_true", help="(d) without first dropping the entry files "
                   "from the page cache (a restart of a server whose files are still in memory)")
    p.add_argument("--warmup-len", type=int, default=1024, help="each server's first prompt (default 1024)")
    p.add_argument("--itl", action="store_true", help="also decode ITL while long prompts are written to disk, "
                   "against --prefix-cache-dir none")
    p.add_argument("--no-restore", action="store_true", help="skip (a)-(d): only --itl")
    p.add_argument("--itl-streams", type=int, default=4, help="decoding streams (default 4)")
    p.add_argument("--itl-prompts", type=int, default=3, help="long prompts arriving (default 3)")
    p.add_argument("--itl-len", type=int, default=4096, help="their length (default 4096)")
    p.add_argument("--itl-tail", type=float, default=3.0, metavar="S", help="decoding after the last (default 3 s)")
    p.add_argument("--itl-window", type=float, default=2.0, metavar="S", help="'after' gaps: those starting "
                   "within S s after a long prompt's first token, when its entry is written (default 2)")
    p.add_argument("--itl-reps", type=int, default=1, help="interleaved on/off rounds (default 1)")
    p.add_argument("--runner-arg", action="append", default=[], metavar="ARG",
                   help="more run_trinity.py arguments (repeatable), e.g. --runner-arg=--prefill-step-size=1024")


# --- the server --------------------------------------------------------------------------------------

class CacheServer(Server):
    """harness.Server (HTTP on too) whose rank r gets --prefix-cache-dir folders[r] ("none": off), through
    a shell that execs the runner (so the process killed is the runner itself)."""

    def __init__(self, ranks: int, args: list, env: dict, folders: list, timeout: float):
        super().__init__(ranks, args, env, timeout=timeout, http=True, name="runner")
        self.folders = folders

    def _start(self):
        ports = free_ports(2)
        self.target, self.http = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
        cmd = ["sh", "-c", 'exec "$@" --prefix-cache-dir "$BENCH_PREFIX_CACHE_DIR"', "sh",
               PY, self.run, "--serve", self.target, "--http", self.http, *self.args]
        self.logs = [str(Path(self.logdir) / f"rank{r}.log") for r in range(self.ranks)]
        self.files = [open(path, "w") for path in self.logs]
        stdio = [dict(stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL) for f in self.files]
        self.names = [f"rank {r}" for r in range(self.ranks)]
        self.procs, self.hostfile = start_ranks(cmd, self.ranks, self.env, rank0=stdio[0], others=stdio[1:],
                                                rank_env=lambda r: {"BENCH_PREFIX_CACHE_DIR": str(self.folders[r])})

    def access_lines(self) -> list:
        return [line for line in self.log().splitlines() if "request front_end=" in line]


def fields_of(line: str) -> dict:
    return dict(re.findall(r"(\w+)=(\S+)", line.split("request ", 1)[-1]))


def generate(server: CacheServer, prompt: list, max_tokens: int, timeout: float) -> dict:
    """One greedy Generate: TTFT at the client, the token, the usage's cached_tokens and the access
    log's line of it (cached_ram, cached_disk, ttft_s)."""
    from distributed.serving.proto import generation_pb2 as pb

    before = len(server.access_lines())
    request = pb.GenerateRequest(token_ids=prompt, max_tokens=max_tokens, temperature=0.0)
    out = {"tokens": [], "cached_tokens": None}
    sent = time.perf_counter()
    try:
        for response in server.stub().Generate(request, timeout=timeout):
            if response.token_ids:
                out.setdefault("ttft_s", time.perf_counter() - sent)
                out["tokens"] += list(response.token_ids)
            if response.finish_reason:
                out["cached_tokens"] = response.usage.cached_tokens
    except Exception as e:
        raise RuntimeError(server.why(f"a {len(prompt)}-token prompt: {type(e).__name__}: "
                                      f"{e.details() if hasattr(e, 'details') else e}"))
    out["wall_s"] = time.perf_counter() - sent
    deadline = time.monotonic() + 5
    while len(lines := server.access_lines()) <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    if len(lines) > before:
        f = fields_of(lines[-1])
        out["log"] = {k: f[k] for k in ("prompt_tokens", "cached_tokens", "cached_ram", "cached_disk", "ttft_s")
                      if k in f}
    return out


def folder_files(folder: Path) -> dict:
    """name -> bytes of the entry files under a rank's folder (temporary files too, named so)."""
    out = {}
    for path in Path(folder).rglob("*"):
        try:
            if path.is_file():
                out[str(path.relative_to(folder))] = path.stat().st_size
        except OSError:
            pass
    return out


def wait_written(folders: list, before: list, timeout: float) -> tuple:
    """Wait until every rank's folder has a new entry file, no temporary file, and has stayed so for a
    second. Returns (the new files of each rank: name -> bytes, seconds waited)."""
    tic, last, since = time.monotonic(), None, time.monotonic()
    while True:
        now = [folder_files(f) for f in folders]
        new = [{k: v for k, v in n.items() if k not in b} for n, b in zip(now, before)]
        done = all(any(not k.rsplit("/", 1)[-1].startswith(".") for k in n) for n in new) and \
            not any(k.rsplit("/", 1)[-1].startswith(".") for n in now for k in n)
        if now != last:
            last, since = now, time.monotonic()
        if done and time.monotonic() - since >= 1.0:
            return new, time.monotonic() - tic
        if time.monotonic() - tic > timeout:
            log.warning(f"the disk tier's files did not settle in {timeout:.0f} s")
            return new, None
        time.sleep(0.2)


def drop_page_cache(folders: list) -> bool:
    """Ask the kernel to drop the entry files' pages from its page cache (posix_fadvise DONTNEED; the
    files were fsynced, so their pages are clean), so that (d) reads the disk, not memory. False where
    a file could not be advised (the kernel may still ignore the advice: gVisor, some filesystems)."""
    import os

    ok = True
    for folder in folders:
        for path in Path(folder).rglob("*.safetensors"):
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            except OSError:
                ok = False
    return ok


def rank_bytes(server: CacheServer) -> list:
    return [r.get("prefix_cache_bytes") for r in server.status()["ranks"]]


def settled_rank_bytes(server: CacheServer, timeout: float = 10.0) -> list:
    """Each rank's prefix_cache_bytes once two reads a second apart agree (the others' come with their stats)."""
    last, deadline = None, time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = rank_bytes(server)
        if now == last:
            return now
        last = now
        time.sleep(1.0)
    return last


def prompt_of(length: int, tag: str) -> list:
    rng = random.Random(f"{tag}:{length}")
    return [rng.randrange(LOW, HIGH) for _ in range(length)]


def warm_prompt(length: int, tag: str) -> list:
    return [3] + prompt_of(length - 1, f"warm-{tag}")


# --- (a)-(d) ---------------------------------------------------------------------------------------

def restore(args, runner_args: list, env: dict, keep=lambda out: None) -> dict:
    """(a)-(d); keep(out) after each step (a run stopped at a time limit keeps what it measured)."""
    steps = set(args.steps.split(","))
    root = Path(tempfile.mkdtemp(prefix="trinity-bench-prefix-"))
    folders = [root / f"rank{r}" for r in range(args.ranks[0])]
    out = {"lengths": {}, "servers": []}
    prompts = {n: prompt_of(n, "prompt") for n in args.prompt_lens}
    try:
        with CacheServer(args.ranks[0], runner_args, env, folders, args.timeout) as server:
            out["servers"].append({"startup_s": server.startup_s, "loadavg": _load()})
            out["model_info"] = server.model_info()
            generate(server, warm_prompt(args.warmup_len, "1"), 1, args.timeout)
            if args.warmup_len >= 256:  # its entry is written: let it land first
                wait_written(folders, [{}] * len(folders), 60)
            for n, prompt in prompts.items():
                row = out["lengths"][str(n)] = {"prompt_tokens": n}
                ram0 = settled_rank_bytes(server)
                disk0 = [folder_files(f) for f in folders]
                row["cold"] = dict(generate(server, prompt, 1, args.timeout), loadavg=_load())
                _say(n, "cold", row["cold"])
                keep(out)
                new, waited = wait_written(folders, disk0, max(120.0, n / 100))
                ram1 = settled_rank_bytes(server)
                row["write_wait_s"] = waited
                row["per_rank"] = [{
                    "rank": r, "ram_entry_bytes": (ram1[r] - ram0[r]) if None not in (ram0[r], ram1[r]) else None,
                    "ram_bytes_now": ram1[r], "disk_files": new[r], "disk_entry_bytes": sum(new[r].values()),
                    "disk_bytes_per_token": sum(new[r].values()) / n} for r in range(len(folders))]
                keep(out)
                if "ram" in steps:
                    row["ram"] = dict(generate(server, prompt, 1, args.timeout), loadavg=_load())
                    _say(n, "ram", row["ram"])
                if "block" in steps:
                    other = prompt[:-DIVERGE] + prompt_of(DIVERGE, f"tail-{n}")
                    row["block"] = dict(generate(server, other, 1, args.timeout), loadavg=_load(),
                                        shared_tokens=n - DIVERGE)
                    _say(n, "block", row["block"])
                keep(out)
            if "block" in steps:  # (c)'s entries are written too: let them land before the stop
                wait_written(folders, [folder_files(f) for f in folders], max(60.0, max(prompts) / 200))
            out["status_before_restart"] = server.status().get("prefix_cache")
            keep(out)
        if "disk" not in steps:
            return finish(out)
        out["disk_files_at_restart"] = [sum(folder_files(f).values()) for f in folders]
        if not args.keep_page_cache:
            out["page_cache_dropped"] = drop_page_cache(folders)
        with CacheServer(args.ranks[0], runner_args, env, folders, args.timeout) as server:
            out["servers"].append({"startup_s": server.startup_s, "loadavg": _load()})
            generate(server, warm_prompt(args.warmup_len, "2"), 1, args.timeout)
            for n, prompt in prompts.items():
                row = out["lengths"][str(n)]
                row["disk"] = dict(generate(server, prompt, 1, args.timeout), loadavg=_load())
                _say(n, "disk", row["disk"])
                keep(finish(out))
            out["status_after_restart"] = server.status().get("prefix_cache")
    except RuntimeError as e:
        out["error"] = str(e)
        log.error(f"prefix-cache: {e}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return finish(out)


def finish(out: dict) -> dict:
    """Each restore's TTFT over its prompt's cold one, and whether its token is the cold one's."""
    for row in out["lengths"].values():
        cold = row.get("cold", {}).get("ttft_s")
        for step in ("ram", "block", "disk"):
            if step in row and cold and "ttft_s" in row[step]:
                row[step]["vs_prefill"] = row[step]["ttft_s"] / cold
                row[step]["same_token"] = row[step]["tokens"][:1] == row["cold"]["tokens"][:1] if step != "block" \
                    else None
    return out


def _load() -> float:
    import os

    return round(os.getloadavg()[0], 2)


def _say(n: int, step: str, r: dict) -> None:
    logline = r.get("log", {})
    log.info(f"  {n} tokens, {step}: TTFT {r.get('ttft_s', float('nan')):.3f} s, cached {r.get('cached_tokens')} "
             f"(ram {logline.get('cached_ram')}, disk {logline.get('cached_disk')}), load {r['loadavg']}")


# --- (e) decode ITL while entries are written --------------------------------------------------------

def decode_stream(server: CacheServer, prompt: list, stop: threading.Event, out: dict) -> None:
    """One stream decoding until `stop` (then cancelled): the times of its token responses."""
    import grpc

    from distributed.serving.proto import generation_pb2 as pb

    call = server.stub().Generate(pb.GenerateRequest(token_ids=prompt, max_tokens=4096, temperature=0.0),
                                  timeout=3600)
    out["times"], out["finished_early"] = [], False
    try:
        for response in call:
            if response.token_ids:
                out["times"].append(time.perf_counter())
            if response.finish_reason:
                out["finished_early"] = True
            if stop.is_set():
                call.cancel()
                break
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            out["error"] = f"{e.code().name}: {e.details()}"


def start_streams(server: CacheServer, prompts: list, tokens: int) -> tuple:
    """A decode_stream thread per prompt, returned once each has `tokens` tokens (120 s at most)
    and half a second more: (stop event, each stream's out, the threads)."""
    stop, streams = threading.Event(), [{} for _ in prompts]
    threads = [threading.Thread(target=decode_stream, daemon=True, args=(server, prompt, stop, out))
               for prompt, out in zip(prompts, streams)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(len(s.get("times", [])) >= tokens for s in streams) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    return stop, streams, threads


def itl_run(args, runner_args: list, env: dict, disk: bool, rep: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="trinity-bench-itl-"))
    folders = [root / f"rank{r}" for r in range(args.ranks[0])] if disk else ["none"] * args.ranks[0]
    out = {"disk": disk}
    try:
        with CacheServer(args.ranks[0], runner_args, env, folders, args.timeout) as server:
            generate(server, warm_prompt(args.warmup_len, f"itl-{rep}-{disk}"), 1, args.timeout)
            before = [folder_files(f) for f in folders] if disk else None
            stop, streams, threads = start_streams(server, [[3] + prompt_of(ITL_PROMPT - 1, f"stream-{k}")
                                                            for k in range(args.itl_streams)], tokens=2)
            out["loadavg_start"] = _load()
            prefills = []
            try:
                for k in range(args.itl_prompts):
                    sent = time.perf_counter()
                    r = generate(server, prompt_of(args.itl_len, f"itl-{rep}-{k}"), 1, args.timeout)
                    prefills.append((sent, sent + r["ttft_s"]))
                time.sleep(args.itl_tail)
            finally:
                stop.set()
                for t in threads:
                    t.join(timeout=60)
            out["loadavg_end"] = _load()
            if disk:
                new, waited = wait_written(folders, before, 30)
                out["entries_written"] = [len([k for k in n if not k.rsplit("/", 1)[-1].startswith(".")])
                                          for n in new]
                out["disk_status"] = (server.status().get("prefix_cache") or {}).get("disk")
    except RuntimeError as e:
        out["error"] = str(e)
        log.error(f"prefix-cache --itl: {e}")
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)
    errors = [s["error"] for s in streams if "error" in s]
    if errors:
        out["error"] = errors[0]
    gaps = [(a, b) for s in streams for a, b in zip(s["times"], s["times"][1:])]
    quiet = [b - a for a, b in gaps if not any(a < end and b > start for start, end in prefills)]
    # After each long prompt's first token its entry is stored, and (disk on) queued for the writer.
    after = [b - a for a, b in gaps if not any(a < end and b > start for start, end in prefills)
             and any(end <= a < end + args.itl_window for _, end in prefills)]
    every = [b - a for a, b in gaps]
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    out.update(gaps=len(every), quiet_gaps=len(quiet), after_gaps=len(after),
               after_itl_ms={q: ms(percentile(after, v)) for q, v in (("p50", 50), ("p99", 99), ("max", 100))}, finished_early=sum(s["finished_early"] for s in streams),
               prefill_s=[e - s for s, e in prefills],
               itl_ms={q: ms(percentile(every, v)) for q, v in (("p50", 50), ("p99", 99), ("max", 100))},
               quiet_itl_ms={q: ms(percentile(quiet, v)) for q, v in (("p50", 50), ("p99", 99), ("max", 100))})
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    log.info(f"  ITL disk {'on' if disk else 'off'} (round {rep + 1}): all gaps p50 {f(out['itl_ms']['p50'])} ms, "
             f"p99 {f(out['itl_ms']['p99'])} ms; outside prefills p50 {f(out['quiet_itl_ms']['p50'])} ms, "
             f"p99 {f(out['quiet_itl_ms']['p99'])} ms ({len(quiet)} gaps); in the {args.itl_window:g} s after "
             f"each: p50 {f(out['after_itl_ms']['p50'])} ms, p99 {f(out['after_itl_ms']['p99'])} ms ({len(after)} gaps); "
             f"load {out['loadavg_end']}")
    return out


def itl(args, runner_args: list, env: dict) -> dict:
    runs = {"on": [], "off": []}
    for rep in range(args.itl_reps):
        for disk in ([False, True] if rep % 2 == 0 else [True, False]):
            runs["on" if disk else "off"].append(itl_run(args, runner_args, env, disk, rep))
    summary = {}
    for which in ("itl_ms", "quiet_itl_ms", "after_itl_ms"):
        for q in ("p50", "p99"):
            on = [r[which][q] for r in runs["on"] if which in r and r[which][q]]
            off = [r[which][q] for r in runs["off"] if which in r and r[which][q]]
            if on and off:
                summary[f"{which}_{q}"] = {"on": statistics.median(on), "off": statistics.median(off),
                                           "on_over_off": statistics.median(on) / statistics.median(off)}
    return {"runs": runs, "summary": summary}


# --- report --------------------------------------------------------------------------------------

def print_report(results: dict, args) -> None:
    rs = results.get("restore")
    if rs:
        print(f"\n{'prompt':>7} {'step':<6} {'TTFT s':>9} {'x prefill':>10} {'cached':>7} {'ram':>7} {'disk':>7} "
              f"{'token=':>7} {'load':>5}")
        for n, row in rs["lengths"].items():
            for step in ("cold", "ram", "block", "disk"):
                r = row.get(step)
                if not r:
                    continue
                lg = r.get("log", {})
                same = r.get("same_token")
                print(f"{n:>7} {step:<6} {r.get('ttft_s', float('nan')):>9.3f} "
                      f"{(format(r['vs_prefill'], '.4f') if 'vs_prefill' in r else '-'):>10} "
                      f"{str(r.get('cached_tokens')):>7} {lg.get('cached_ram', '-'):>7} {lg.get('cached_disk', '-'):>7} "
                      f"{('-' if same is None else 'yes' if same else 'NO'):>7} {r['loadavg']:>5}")
        print(f"\n{'prompt':>7} {'rank':>4} {'RAM entry MiB':>14} {'RAM B/token':>12} {'disk entry MiB':>15} "
              f"{'disk B/token':>13} {'files':>6}")
        for n, row in rs["lengths"].items():
            for pr in row.get("per_rank", []):
                ram = pr["ram_entry_bytes"]
                print(f"{n:>7} {pr['rank']:>4} {('-' if ram is None else format(ram / 2**20, '.2f')):>14} "
                      f"{('-' if ram is None else format(ram / int(n), '.0f')):>12} "
                      f"{pr['disk_entry_bytes'] / 2**20:>15.2f} {pr['disk_bytes_per_token']:>13.0f} "
                      f"{len(pr['disk_files']):>6}")
        if "error" in rs:
            print(f"FAILED: {rs['error'][:2000]}")
    it = results.get("itl")
    if it:
        print(f"\nITL of {args.itl_streams} decoding streams while {args.itl_prompts} prompts of {args.itl_len} "
              f"tokens arrive (median of {args.itl_reps} rounds):")
        for key, v in it["summary"].items():
            print(f"  {key:<18} disk on {v['on']:8.1f} ms   off {v['off']:8.1f} ms   on/off {v['on_over_off']:.3f}")
        for which, rows in it["runs"].items():
            for r in rows:
                if "error" in r:
                    print(f"  disk {which}: FAILED: {r['error'][:2000]}")


def main(args) -> None:
    shrink(args, prompt_lens=[512, 1024], warmup_len=300, itl_prompts=2, itl_len=512, itl_tail=1.0)
    if len(args.ranks) != 1:
        raise SystemExit("--ranks: one rank count")
    model = make_mini(Path(args.make_mini)) if args.make_mini else Path(args.model) if args.model else None
    env = bench_env(args.blas)
    if args.blas == "openblas":
        env["OPENBLAS_NUM_THREADS"] = "1"
    runner_args = [*(["--model", str(model)] if model else []), *args.runner_arg]
    out = out_path(args, "prefix_cache")
    results, settings = {}, dict(vars(args), model=str(model) if model else "embedded")
    if not args.no_restore:
        results["restore"] = restore(args, runner_args, env, lambda part: save(out, {"restore": part}, settings))
        save(out, results, settings)
    if args.itl:
        results["itl"] = itl(args, runner_args, env)
        save(out, results, settings)
    print(f"\n{model or 'the embedded model'}: P={args.ranks[0]}, BLAS {args.blas}")
    print_report(results, args)
    print(f"wrote {save(out, results, settings)}")
