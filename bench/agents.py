"""Coding agents' sessions and the prefix cache: the real Claude Code and Codex CLI (.agents/, run as
tests/serving/test_agents.py runs them: offline, their default settings but the endpoint and a key)
against a ring of two serving the embedded model (`python -m launch run --single-host 2 --no-plan
--no-router -- run_trinity.py --serve … --http … --prefix-cache-dir DIR --max-tokens-cap N`).

For each client (--clients), in a working directory and a home of its own, kept for all its sessions:

  1 cold     session 1's first request: `claude -p "say hello"` / `codex exec "say hello"`
  2 turn     its second turn: `claude -p --continue "say more"` / `codex exec resume --last "say more"`
  3 session  a second session's first request, another question, same server (restored from RAM)
  4 disk     after the whole ring is stopped and started again on the same --prefix-cache-dir, a
             third session's first request, a third question (restored from every rank's disk)

Steps 1-3 run for every client on the first ring (Claude Code's, then Codex's); the ring is stopped
once every rank's disk-tier files have settled (no temporary file, nothing changing for 2 s), and a
second ring on the same folder takes every client's step 4.

Each row comes from rank 0's access log: the request of that step is the first of the command's
requests (on the client's route) at least half as long as its longest (Claude Code sends small
title and quota requests too; every request is kept in the results): prompt tokens, cached tokens
(RAM / disk), TTFT (the server's, from the request's arrival to its first token); then the
client's exit status and wall time, and the 1-minute load average as the step ended.

The ranks preload OpenBLAS (--blas) with OPENBLAS_NUM_THREADS=1 and send keep-alives every
--keepalive s (TRINITY_KEEPALIVE_S); the clients sample at temperature 1, and --max-tokens-cap
keeps the tiny model's replies short. Every process started here is gone when it returns (the
launcher is stopped; any rank it left is killed by its group), and the temporary folders with it
(--keep: kept, and named). --smoke: Codex alone, replies capped at 16 tokens.
"""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.harness import PY, ROOT, RUN, bench_env, flags, free_ports, kill_groups, out_path, save, shrink
from bench.prefix_cache import folder_files

log = logging.getLogger("bench")

AGENTS = ROOT / ".agents" / "node_modules"
CODEX = AGENTS / ".bin" / "codex"
CLAUDE_WRAPPER = AGENTS / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"
OFFLINE = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "NO_UPDATE_NOTIFIER": "1"}
ROUTES = {"claude": "/v1/messages", "codex": "/v1/responses"}
NAMES = {"claude": "Claude Code", "codex": "Codex CLI"}
QUESTIONS = {"cold": "say hello", "turn": "say more", "session": "What does this project do? Answer in one line.",
             "disk": "Which file would you read first? Answer in one line."}
STEPS = ("cold", "turn", "session", "disk")



def codex_config(model: str, host: str, port) -> str:
    """Codex CLI's ~/.codex/config.toml for this server (README's), kept off the network."""
    return f'''model = "{model}"
model_provider = "trinity"
check_for_update_on_startup = false

[model_providers.trinity]
name = "trinity"
base_url = "http://{host}:{port}/v1"
env_key = "TRINITY_KEY"
wire_api = "responses"

[analytics]
enabled = false
'''

def add_arguments(p) -> None:
    flags(p, smoke=False, out=None, model=None, blas="openblas", timeout=900.0)
    p.add_argument("--clients", default="claude,codex", help="claude, codex or both (default claude,codex)")
    p.add_argument("--max-tokens-cap", type=int, default=64, help="the ring's --max-tokens-cap (default 64)")
    p.add_argument("--keepalive", type=float, default=0.5, metavar="S", help="TRINITY_KEEPALIVE_S (default 0.5)")
    p.add_argument("--runner-arg", action="append", default=[], metavar="ARG",
                   help="more run_trinity.py arguments (repeatable)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folders (the cache, the clients' "
                   "homes and directories, the ring's logs) and print where")


# --- the ring --------------------------------------------------------------------------------------

def descendants(pid: int) -> list:
    """Every process below `pid` now (from /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Ring:
    """`python -m launch run --single-host 2 --no-plan --no-router -- run_trinity.py --serve --http …`,
    its output (every rank's) in one log file; a `with` block: serving on entry, every process gone on exit."""

    def __init__(self, args, env: dict, folder: Path, logfile: Path):
        self.args, self.env, self.folder, self.logfile = args, env, folder, logfile
        self.proc, self.ranks, self.file = None, [], None

    def __enter__(self):
        grpc_port, http_port = free_ports(2)
        self.http = f"127.0.0.1:{http_port}"
        model = ["--model", str(self.args.model)] if self.args.model else []
        cmd = [PY, "-m", "launch", "run", "--single-host", "2", "--no-plan", "--no-router", "--",
               RUN, "--serve", f"127.0.0.1:{grpc_port}", "--http", self.http, *model,
               "--prefix-cache-dir", str(self.folder), "--max-tokens-cap", str(self.args.max_tokens_cap),
               *self.args.runner_arg]
        self.command = " ".join(cmd)
        self.file = open(self.logfile, "a")
        self.file.write(f"=== {self.command}\n")
        self.file.flush()
        self.start = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=self.file,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.model = self._wait_serving()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.startup_s = time.monotonic() - self.start
        self.ranks = descendants(self.proc.pid)
        return self

    def _wait_serving(self) -> str:
        deadline = time.monotonic() + self.args.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the ring exited ({self.proc.returncode}) before serving:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.http}/v1/models", timeout=5) as r:
                    return json.loads(r.read())["data"][0]["id"]
            except (OSError, ValueError, KeyError, IndexError):
                time.sleep(0.5)
        raise RuntimeError(f"the ring was not serving after {self.args.timeout:.0f} s:\n{self.tail()}")

    def __exit__(self, *exc):
        """SIGTERM to the launcher (a clean stop: it stops the ranks), then whatever is left, group by group."""
        if self.proc is not None:
            left = set(self.ranks) | set(descendants(self.proc.pid))
            kill_groups([self.proc], grace=60)
            for pid in left:
                try:
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                    log.warning(f"the launcher left process {pid}: killed")
                except (ProcessLookupError, PermissionError):
                    pass
            self.proc = None
        if self.file is not None:
            self.file.close()
            self.file = None
        return False

    def log(self) -> str:
        self.file.flush()
        return self.logfile.read_text(errors="replace").split(f"=== {self.command}\n")[-1]

    def tail(self, n: int = 3000) -> str:
        return self.log()[-n:]

    def access(self, route: str) -> list:
        """Rank 0's access-log lines of `route` so far, each as its fields."""
        return [dict(re.findall(r"(\w+)=(\S+)", line.split("request ", 1)[1]))
                for line in self.log().splitlines() if "request front_end=" in line and f" route={route} " in line]

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://{self.http}/v1/status", timeout=30) as r:
            return json.loads(r.read())


def settle(folder: Path, timeout: float = 300.0) -> float:
    """Wait until the disk tier's folder holds no temporary file and has not changed for 2 s; seconds waited."""
    tic, last, since = time.monotonic(), None, time.monotonic()
    while time.monotonic() - tic < timeout:
        now = folder_files(folder)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 2.0 and not any(Path(k).name.startswith(".") for k in now):
            return time.monotonic() - tic
        time.sleep(0.25)
    log.warning(f"the disk tier's files did not settle in {timeout:.0f} s")
    return None


def per_subfolder(folder: Path) -> dict:
    """Each fingerprint's subfolder (one per rank here): entry files and bytes."""
    out = {}
    for name, size in folder_files(folder).items():
        sub = name.split("/", 1)[0]
        row = out.setdefault(sub, {"files": 0, "bytes": 0})
        row["files"] += 1
        row["bytes"] += size
    return out


# --- the clients -----------------------------------------------------------------------------------

def client_setup(client: str, root: Path, ring: Ring) -> tuple:
    """(base command, working directory, environment) of a client pointed at the ring; its home and
    directory are made once under `root` and kept for every session (a later ring only moves the port)."""
    home, work = root / f"{client}-home", root / f"{client}-work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    host, port = ring.http.split(":")
    if client == "codex":
        (home / "config.toml").write_text(codex_config(ring.model, host, port))
        return [str(CODEX), "exec", "--skip-git-repo-check"], work, {"CODEX_HOME": str(home), "TRINITY_KEY": "dummy"}
    env = {"HOME": str(home), "ANTHROPIC_BASE_URL": f"http://{host}:{port}", "ANTHROPIC_API_KEY": "dummy"}
    return [shutil.which("node"), str(CLAUDE_WRAPPER), "-p", "--model", ring.model], work, env


def step_command(client: str, base: list, step: str) -> list:
    if step == "turn":
        return [*base, "--continue", QUESTIONS[step]] if client == "claude" else \
            [*base, "resume", "--last", QUESTIONS[step]]
    return [*base, QUESTIONS[step]]


def run_client(cmd: list, cwd: Path, env: dict, timeout: float) -> dict:
    """The client to its end (its whole process group: killed at `timeout`)."""
    tic = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **OFFLINE, **env}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        kill_groups([proc], grace=2)
        out, err = proc.communicate()
        code = f"timed out after {timeout:.0f} s"
    finally:
        kill_groups([proc], grace=2)  # anything it left in its group
    return {"exit": code, "wall_s": round(time.monotonic() - tic, 2), "stdout_tail": (out or "")[-600:],
            "stderr_tail": (err or "")[-1500:]}


def step(ring: Ring, client: str, base: list, cwd: Path, env: dict, name: str, timeout: float) -> dict:
    route = ROUTES[client]
    before = len(ring.access(route))
    cmd = step_command(client, base, name)
    log.info(f"{NAMES[client]}, {name}: {' '.join(cmd[-3:])} ...")
    row = {"step": name, "args": cmd[2 if client == "claude" else 1:], **run_client(cmd, cwd, env, timeout)}
    # A request's line is written as its answer ends: wait until one is there and nothing new comes for 1.5 s.
    deadline, last, since = time.monotonic() + 30, None, time.monotonic()
    while time.monotonic() < deadline:
        now = len(ring.access(route))
        if now != last:
            last, since = now, time.monotonic()
        elif now > before and time.monotonic() - since >= 1.5:
            break
        time.sleep(0.1)
    made = ring.access(route)[before:]
    row["requests"] = [{k: f.get(k) for k in ("status", "outcome", "prompt_tokens", "cached_tokens", "cached_ram",
                                               "cached_disk", "completion_tokens", "ttft_s", "duration_s", "ignored",
                                               "clamped")} for f in made]
    row["loadavg"] = round(os.getloadavg()[0], 2)
    long = [f for f in made if f.get("status") == "200" and f.get("prompt_tokens", "").isdigit()]
    if long:
        top = max(int(f["prompt_tokens"]) for f in long)
        f = next(f for f in long if int(f["prompt_tokens"]) >= top / 2)
        num = lambda k: None if f.get(k) in (None, "-") else (float(f[k]) if "." in f[k] else int(f[k]))  # noqa: E731
        row.update({k: num(k) for k in ("prompt_tokens", "cached_tokens", "cached_ram", "cached_disk",
                                        "completion_tokens", "ttft_s", "duration_s")})
        row["ignored"] = f.get("ignored")
        row["restored_share"] = row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else None
        row["prefilled_tokens"] = row["prompt_tokens"] - row["cached_tokens"]
        if row["ttft_s"] is None:  # no token at all (the first one sampled was the end): at most its duration
            row["ttft_at_most_s"] = row["duration_s"]
    log.info(f"  prompt {row.get('prompt_tokens')}, cached {row.get('cached_tokens')} (ram {row.get('cached_ram')}, "
             f"disk {row.get('cached_disk')}), TTFT {ttft(row)} s, exit {row['exit']}, "
             f"{len(made)} requests, load {row['loadavg']}")
    return row


def ttft(row: dict) -> str:
    if row.get("ttft_s") is not None:
        return f"{row['ttft_s']:.3f}"
    return f"<{row['ttft_at_most_s']:.3f}" if row.get("ttft_at_most_s") is not None else "-"


# --- the run ---------------------------------------------------------------------------------------

def measure(args, env: dict, root: Path) -> dict:
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    folder, logfile = root / "prefix-cache", root / "ring.log"
    out = {"clients": {c: {"rows": []} for c in clients}, "rings": []}
    setups = {}
    try:
        with Ring(args, env, folder, logfile) as ring:
            out["rings"].append({"startup_s": round(ring.startup_s, 1), "command": ring.command,
                                 "model": ring.model, "loadavg": round(os.getloadavg()[0], 2)})
            for client in clients:
                setups[client] = client_setup(client, root, ring)
                for name in ("cold", "turn", "session"):
                    out["clients"][client]["rows"].append(step(ring, client, *setups[client], name, args.timeout))
            out["settle_s"] = settle(folder)
            out["disk_before_restart"] = per_subfolder(folder)
            out["status_before_restart"] = ring.status().get("prefix_cache")
        with Ring(args, env, folder, logfile) as ring:
            out["rings"].append({"startup_s": round(ring.startup_s, 1), "loadavg": round(os.getloadavg()[0], 2)})
            for client in clients:
                setups[client] = client_setup(client, root, ring)  # the new port
                out["clients"][client]["rows"].append(step(ring, client, *setups[client], "disk", args.timeout))
            out["status_after_restart"] = ring.status().get("prefix_cache")
    except (RuntimeError, OSError) as e:
        out["error"] = str(e)
        log.error(f"agents: {e}")
    if logfile.exists():  # what each ring said of its prefix cache as it stopped
        out["stop_lines"] = [line for line in logfile.read_text(errors="replace").splitlines()
                             if line.startswith(("prefix cache: ", "trinity: server stopped"))]
    return out


def print_report(results: dict) -> None:
    print(f"\n{'client':<12} {'step':<8} {'prompt':>7} {'cached':>7} {'ram':>7} {'disk':>7} {'share':>6} "
          f"{'prefill':>7} {'TTFT s':>8} {'exit':>5} {'client s':>9} {'reqs':>5} {'load':>5}")
    for client, c in results["clients"].items():
        for r in c["rows"]:
            share = r.get("restored_share")
            print(f"{NAMES[client]:<12} {r['step']:<8} {str(r.get('prompt_tokens')):>7} "
                  f"{str(r.get('cached_tokens')):>7} {str(r.get('cached_ram')):>7} {str(r.get('cached_disk')):>7} "
                  f"{('-' if share is None else format(share, '.3f')):>6} {str(r.get('prefilled_tokens')):>7} "
                  f"{ttft(r):>8} {str(r['exit']):>5} {r['wall_s']:>9.1f} {len(r['requests']):>5} {r['loadavg']:>5}")
    print("(TTFT: rank 0's, of the step's first long request; <x: no token came, x is the request's duration. "
          "exit: the client's status; reqs: the requests it made)")
    for sub, d in (results.get("disk_before_restart") or {}).items():
        print(f"disk tier before the restart, {sub}: {d['files']} files, {d['bytes'] / 2**20:.1f} MiB")
    for line in results.get("stop_lines", []):
        print(line)
    if "error" in results:
        print(f"FAILED: {results['error'][:3000]}")


def main(args) -> None:
    shrink(args, clients="codex", max_tokens_cap=16)
    if shutil.which("node") is None or not CODEX.exists() or not CLAUDE_WRAPPER.exists():
        raise SystemExit("the coding agents are not installed: README's set-up (npm install --prefix .agents ...)")
    env = bench_env(args.blas)
    if args.blas == "openblas":
        env["OPENBLAS_NUM_THREADS"] = "1"
    env["TRINITY_KEEPALIVE_S"] = str(args.keepalive)
    root = Path(tempfile.mkdtemp(prefix="trinity-bench-agents-"))
    out = out_path(args, "agents")
    settings = dict(vars(args), model=args.model or "embedded")
    try:
        results = measure(args, env, root)
    finally:
        if args.keep:
            print(f"kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.model or 'the embedded model'}: a ring of two (launch run), BLAS {args.blas}, "
          f"--max-tokens-cap {args.max_tokens_cap}")
    print_report(results)
    print(f"wrote {save(out, results, settings)}")
