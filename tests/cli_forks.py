"""One-rank runs of run_trinity.py, each in a process of its own, without each paying the imports.

A one-rank run spends a second or two of CPU importing mlx_lm (transformers scanning its model
files) before it does anything; a refusal, nothing else. `CliForks` starts one process that imports
distributed.cli as run_trinity.py does (stop signals blocked first), then forks a child per run: the
child runs `main(args)` with its own stdout and stderr and exits with main's status, as the script
would. conftest.run_cli runs every one-rank run with no environment of its own this way."""

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SERVER = r'''
import json, os, sys, threading, traceback
from distributed.startup.lifecycle import block_stop_signals
block_stop_signals()  # as run_trinity.py, before anything starts a thread
from distributed.cli import main
import distributed.serving.chat_format  # rank 0 imports it on its first prompt (cli.prompt_tokens)

for line in sys.stdin:
    args, out, err, timeout = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        sys.argv = ["run_trinity.py", *args]
        code = 0
        try:
            main(args)
        except SystemExit as e:  # what the interpreter does with it
            if isinstance(e.code, int) or e.code is None:
                code = e.code or 0
            else:
                sys.stderr.write(f"{e.code}\n")
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    timer = threading.Timer(timeout, os.kill, (pid, 9))  # as subprocess.run's timeout: the run is killed
    timer.start()
    _, status = os.waitpid(pid, 0)
    timer.cancel()
    timer.join()
    print(os.waitstatus_to_exitcode(status), flush=True)
'''


class CliForks:
    """`with CliForks() as cli: cli.run(args)` -> subprocess.CompletedProcess, as conftest.run_cli
    gives for one rank."""

    def __enter__(self):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # as conftest.run_cli
        self.folder = tempfile.mkdtemp(prefix="cli-forks-")
        self.lock = threading.Lock()  # one run at a time: a test's threads wait their turn
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=ROOT, start_new_session=True)
        return self

    def run(self, args, timeout: float = 180) -> subprocess.CompletedProcess:
        """One run, in a child killed after `timeout` s (subprocess.TimeoutExpired, as subprocess.run)."""
        out, err = Path(self.folder) / "stdout", Path(self.folder) / "stderr"
        with self.lock:
            self.proc.stdin.write(json.dumps([[str(a) for a in args], str(out), str(err), timeout]) + "\n")
            self.proc.stdin.flush()
            status = self.proc.stdout.readline()
            assert status, "the fork server is gone"
            stdout, stderr = out.read_text(), err.read_text()
        if int(status) == -9:
            raise subprocess.TimeoutExpired(["run_trinity.py", *args], timeout, stdout, stderr)
        return subprocess.CompletedProcess(["run_trinity.py", *args], int(status), stdout, stderr)

    def __exit__(self, *exc):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        for name in ("stdout", "stderr"):
            (Path(self.folder) / name).unlink(missing_ok=True)
        os.rmdir(self.folder)
