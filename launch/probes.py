"""launch/host_probe.py running on each host: started as the ranks would be (over the launcher's
ssh for remote hosts, in our working directory where that host has it, with the ranks'
interpreter), spoken to line by line, and ended however the doctor ends (its stdin closes).
"""

import json
import os
import queue
import shlex
import signal
import subprocess
import threading
from pathlib import Path
from typing import List, Optional

from .hostfile import Host
from .processes import signal_group
from .ssh_ring import SSH_OPTIONS

SOURCE = (Path(__file__).parent / "host_probe.py").read_text()
ANSWER_S = 60.0  # a probe's longest step (importing mlx on a cold disk, a hub query)


def probe_argv(host: Host, request: dict, python: str, ssh: List[str]) -> List[str]:
    """PYTHON -c SOURCE REQUEST, here for a local host, else through ssh (as SshRing's ranks)."""
    argv = [python, "-c", SOURCE, json.dumps(request)]
    if host.is_local:
        return argv
    script = f"if [ -d {shlex.quote(os.getcwd())} ]; then cd {shlex.quote(os.getcwd())}; fi; exec {shlex.join(argv)}"
    return [*ssh, *SSH_OPTIONS, host.ssh, "sh -c " + shlex.quote(script)]


class Probe:
    """One host's probe process: JSON lines in and out, stderr kept for the error message."""

    def __init__(self, host: Host, request: dict, python: str, ssh: List[str], env: Optional[dict] = None):
        self.host = host
        self.proc = subprocess.Popen(probe_argv(host, request, python, ssh), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                     start_new_session=True, text=True)
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.stderr: List[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.err_reader = threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True)
        self.err_reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def next(self, timeout: float = ANSWER_S) -> Optional[dict]:
        """The probe's next answer; None when it ended (or said nothing within `timeout`)."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        return None if line is None else json.loads(line)

    def ask(self, request: dict) -> Optional[dict]:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        return self.next()

    def error(self) -> str:
        """Why it gave no answer: its stderr's last line, or its exit status."""
        if self.proc.poll() is not None:
            self.err_reader.join(timeout=2)
        text = "".join(self.stderr).strip()
        if text:
            return text.splitlines()[-1][:300]
        code = self.proc.poll()
        return f"exited with status {code}" if code is not None else f"no answer within {ANSWER_S:.0f} s"

    def close(self) -> None:
        """End of file ends the probe; a probe that hangs is killed with its group."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
