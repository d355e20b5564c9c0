"""Which of our modules one streamed chat completion crosses.

Runs `run_trinity.py --stages N --serve … --http …` (the embedded model) inside this process with a
profiler on every thread, sends one streamed `POST /v1/chat/completions` (8 tokens) once the server
is warm (one request before it, not counted), and prints the modules under distributed/ and launch/
whose functions ran between the request's first byte and its last, with the count. `--tree` runs
another checkout's code (e.g. a worktree of an older commit), to compare.
"""

import http.client
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from bench.harness import ROOT, flags, free_ports


def add_arguments(p) -> None:
    flags(p, smoke=False)
    p.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose code runs (default: this one)")
    p.add_argument("--stages", type=int, default=2)


def chat(port: int) -> None:
    body = json.dumps({"model": "trinity-tiny", "messages": [{"role": "user", "content": "The"}], "max_tokens": 8,
                       "temperature": 0, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    response.read()
    conn.close()


def wait_serving(port: int) -> None:
    for _ in range(600):
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit("the server never served")


def main(args) -> None:
    port, root = free_ports(1)[0], args.tree.resolve()  # the port before the other checkout's code comes first
    sys.path.insert(0, str(root))
    os.chdir(root)
    from distributed import cli

    seen, recording = set(), threading.Event()

    def profile(frame, event, arg):
        if recording.is_set() and event == "call":
            path = frame.f_code.co_filename
            if path.startswith(str(root)) and "/.venv/" not in path:
                seen.add(os.path.relpath(path, root))

    def client():
        wait_serving(port)
        chat(port)  # warm: compiled kernels, loaded templates
        recording.set()
        chat(port)
        recording.clear()
        os.kill(os.getpid(), signal.SIGINT)

    threading.setprofile(profile)
    sys.setprofile(profile)
    threading.Thread(target=client, daemon=True).start()
    try:
        cli.main(["--stages", str(args.stages), "--serve", "127.0.0.1:0", "--http", f"127.0.0.1:{port}"])
    except (SystemExit, KeyboardInterrupt):
        pass
    sys.setprofile(None)
    ours = sorted(m for m in seen if m.startswith(("distributed/", "launch/")))
    print("\n".join(ours))
    print(f"{len(ours)} modules ({root})")
