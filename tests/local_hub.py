"""A real Hugging Face hub on localhost, offline: olah (a hub mirror from PyPI)
serving local git repositories (tests/shard/test_hub.py).

olah lives in a virtual environment of its own (its dependencies need not meet
ours), made by README's test set-up:
`python3 -m venv .olah-venv && .olah-venv/bin/pip install 'olah==0.5.4'`
(TRINITY_OLAH_PYTHON names another interpreter that has olah).
"""

import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import ROOT, free_port_range, needs

OLAH_PYTHON = Path(os.environ.get("TRINITY_OLAH_PYTHON", ROOT / ".olah-venv" / "bin" / "python"))
START_TIMEOUT_S = 60
# uvicorn's access log line for a file download: GET /ORG/NAME/resolve/COMMIT/FILE
_DOWNLOAD = re.compile(r'"GET /([^/ ]+/[^/ ]+)/resolve/[0-9a-f]+/(\S+) HTTP/[\d.]+" 200')


class LocalHub:
    """`with LocalHub(folder, {repo_id: checkpoint_folder}) as hub:` serves each
    checkpoint as the repo's `main` branch at hub.endpoint until the block ends."""

    def __init__(self, folder: Path, repos: dict):
        if not OLAH_PYTHON.exists():
            needs(f"olah in {OLAH_PYTHON} (scripts/setup-dev.sh makes it: .olah-venv)")
        if shutil.which("git") is None:
            needs("git (the hub serves local git repositories)")
        self.folder = Path(folder)
        self.port = free_port_range(1)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = self.folder / "olah.log"
        self.proc = None
        for repo_id, checkpoint in repos.items():
            self._commit(repo_id, Path(checkpoint))

    def _commit(self, repo_id: str, checkpoint: Path):
        repo = self.folder / "mirrors" / "models" / repo_id
        shutil.copytree(checkpoint, repo)
        git = ["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@localhost"]
        for step in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "checkpoint"]):
            subprocess.run([*git, *step], check=True, capture_output=True)

    def __enter__(self):
        (self.folder / "repos").mkdir(exist_ok=True)
        netloc = f"127.0.0.1:{self.port}"
        (self.folder / "olah.toml").write_text(
            f'[basic]\nhost = "127.0.0.1"\nport = {self.port}\nmirror-netloc = "{netloc}"\n'
            f'mirror-lfs-netloc = "{netloc}"\nmirrors-path = ["mirrors"]\nrepos-path = "repos"\n'
            "[accessibility]\noffline = true\n")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([str(OLAH_PYTHON), "-m", "olah.server", "--config", "olah.toml"],
                                         stdout=log, stderr=subprocess.STDOUT, cwd=self.folder,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def _wait_ready(self):
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"olah exited with status {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(self.endpoint + "/api/models/none/none", timeout=2)
                return
            except urllib.error.HTTPError:  # any HTTP answer: it serves
                return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"olah did not answer within {START_TIMEOUT_S} s:\n{self.log.read_text()[-3000:]}")

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def downloads(self, since: int = 0):
        """(repo_id, file) of each file served, from the access log's lines after line `since`."""
        lines = self.log.read_text().splitlines()[since:]
        return [m.groups() for m in map(_DOWNLOAD.search, lines) if m]

    def log_lines(self) -> int:
        return len(self.log.read_text().splitlines())
