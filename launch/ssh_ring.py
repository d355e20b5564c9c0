"""Remote hosts of the ring backend, started over ssh by us instead of by mlx.launch.

mlx.launch relays every rank's output through a select() loop with short
timeouts, which keeps a core of the launching machine busy for the life of the
ring. SshRing starts each remote rank with one `ssh` client whose stdout and
stderr are ours (inherited: nothing to relay, no loop), and local entries
(127.0.0.1) directly, as DirectRing does. A rank gets what mlx.launch would give
it: MLX_RANK, MLX_HOSTFILE (a temporary file on its host holding the ring
hostfile), the --env values, our working directory when that host has it (or
--cwd), and the command as given (the interpreter: --python, default ours), plus
TRINITY_CONTROL_ADDR at rank 0's hostfile IP.

Stopping a remote rank: no pseudo-terminal (`ssh -T`), and no second ssh
connection to kill a recorded pid. The ssh client's stdin is a pipe from us, and
a small sh wrapper on the remote host runs the rank in the background and reads
that pipe: each line is a signal name to send the rank, and end of file (we
closed it, we died even by SIGKILL, our ssh client died, or the connection
dropped) sends SIGTERM. So every way the launcher can go away ends the remote
ranks, through the stream ssh already has, with stdout and stderr kept apart
(`ssh -tt`, as mlx.launch uses, would merge them into one terminal stream and
turn a rank's stderr into our stdout). A background job of a non-interactive
shell ignores SIGINT, so SIGINT and SIGHUP reach remote ranks as SIGTERM, which
the ranks treat alike.

How we call ssh: `--ssh CMD` or the TRINITY_SSH environment variable (a command
line, e.g. "ssh -F ~/.ssh/trinity_config" or "ssh -p 2222 -i key"), default
"ssh", followed by `-T -o BatchMode=yes -o LogLevel=ERROR` (options given in CMD
come first, so they win).
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from typing import IO, Dict, List, Optional

from distributed.startup.control_link import CONTROL_ENV

from .hostfile import Host
from .processes import free_ports, group_alive, signal_group
from .ring import DirectRing, Failure, log

SSH_ENV = "TRINITY_SSH"
SSH_OPTIONS = ["-T", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]
SSH_FAILED = 255  # ssh's own exit status when it could not connect (or lost the connection)
KILL_WAIT_S = 2.0  # after "KILL" went to the remote ranks, before we kill their ssh clients
# What each signal becomes on the remote host (see the module docstring for SIGINT).
REMOTE_SIGNALS = {signal.SIGTERM: "TERM", signal.SIGINT: "TERM", signal.SIGHUP: "TERM",
                  signal.SIGCONT: "CONT", signal.SIGKILL: "KILL"}

# Runs the rank in the background (stdin /dev/null) and turns lines on our stdin,
# kept as fd 3 (a background job's own stdin is /dev/null), into signals for it.
WRAPPER = """\
exec 3<&0
{command} </dev/null &
pid=$!
(while read -r sig <&3; do kill -s "$sig" "$pid"; done; kill -s TERM "$pid") >/dev/null 2>&1 &
watcher=$!
wait "$pid" 2>/dev/null
code=$?
kill "$watcher" 2>/dev/null
{cleanup}exit "$code"
"""


def ssh_command(spec: Optional[str] = None) -> List[str]:
    """The ssh client command line: --ssh's, else $TRINITY_SSH, else plain ssh."""
    return shlex.split(spec or os.environ.get(SSH_ENV) or "ssh")


def remote_script(command: List[str], exports: Dict[str, str], hostfile_json: Optional[str],
                  cwd: Optional[str], default_cwd: str) -> str:
    """The sh script one remote rank runs (as mlx.launch's launch script, plus the wrapper)."""
    lines = []
    if cwd:  # asked for: its absence is an error
        lines.append(f"cd {shlex.quote(cwd)} || exit 1")
    else:  # ours, where that host has it (mlx.launch does the same)
        lines.append(f"if [ -d {shlex.quote(default_cwd)} ]; then cd {shlex.quote(default_cwd)}; fi")
    lines += [f"export {key}={shlex.quote(value)}" for key, value in exports.items()]
    cleanup = ""
    if hostfile_json is not None:
        lines.append(f'hostfile=$(mktemp) && printf "%s\\n" {shlex.quote(hostfile_json)} > "$hostfile" '
                     '&& export MLX_HOSTFILE="$hostfile" || exit 1')
        cleanup = 'rm -f "$hostfile"\n'
    return "\n".join(lines) + "\n" + WRAPPER.format(command=shlex.join(command), cleanup=cleanup)


class SshRing(DirectRing):
    """A ring hostfile with remote hosts: remote ranks over ssh, local ones directly."""

    name = "ssh"

    def __init__(self, command: List[str], hosts: List[Host], env: dict, envs: Optional[List[str]] = None,
                 starting_port: Optional[int] = None, ssh: Optional[List[str]] = None, cwd: Optional[str] = None):
        super().__init__(command, len(hosts), env, envs, [h.ips[0] for h in hosts], starting_port, cwd)
        self.hosts = hosts
        self.ssh = list(ssh or ssh_command())
        self.channels: Dict[int, IO[bytes]] = {}  # remote rank -> its ssh client's stdin

    def remote(self, rank: int) -> bool:
        return not self.hosts[rank].is_local

    def host(self, rank: int) -> str:
        return self.hosts[rank].ssh

    def plan(self) -> None:
        """Ring ports and the control port, all free here. On other hosts they are only
        likely free (random, below the ephemeral range); --starting-port fixes the ring's."""
        if self.starting_port is not None:
            ring_ports = [self.starting_port + r for r in range(self.size)]
            ports = ring_ports + free_ports(1, avoid=ring_ports)
        else:
            ports = free_ports(self.size + 1)
        self.ring = [[f"{ip}:{port}"] for ip, port in zip(self.ips, ports)]
        self.control = f"{self.ips[0]}:{ports[-1]}"

    def remote_exports(self, rank: int) -> Dict[str, str]:
        """The environment a remote rank gets: mlx.launch's (--env values, COLUMNS and
        LINES of our terminal, MLX_RANK; MLX_HOSTFILE is written there) and the control address."""
        exports = dict(e.split("=", 1) for e in self.envs)
        cols, lines = shutil.get_terminal_size((0, 0))
        if cols > 0 and "COLUMNS" not in exports:
            exports.update(COLUMNS=str(cols), LINES=str(lines))
        exports.update({"MLX_RANK": str(rank), CONTROL_ENV: self.control})
        return exports

    def ssh_argv(self, rank: int) -> List[str]:
        script = remote_script(self.command, self.remote_exports(rank),
                               json.dumps(self.ring) if self.size > 1 else None, self.cwd, os.getcwd())
        return [*self.ssh, *SSH_OPTIONS, self.hosts[rank].ssh, "sh -c " + shlex.quote(script)]

    def describe_commands(self) -> List[str]:
        self.plan()
        lines = [f"# ring {json.dumps(self.ring)}; control {self.control}"]
        for rank in range(self.size):
            if self.remote(rank):
                *ssh, script = self.ssh_argv(rank)
                lines.append(f"# rank {rank}: {shlex.join(ssh)} 'sh -c SCRIPT', SCRIPT being:")
                lines.append(shlex.split(script)[2])
            else:
                lines.append(f"# rank {rank} here (MLX_HOSTFILE: a local file holding the ring):")
                env = [f"MLX_RANK={rank}", f"{CONTROL_ENV}={self.control}", *self.envs]
                lines.append(shlex.join(["env", *env, *self.command]))
        return lines

    def start(self) -> None:
        self.plan()
        if self.size > 1 and not all(map(self.remote, range(self.size))):
            self.write_hostfile()  # for the local ranks
        for rank in range(self.size):
            if self.remote(rank):
                proc = self.popen(rank, self.ssh_argv(rank), self.env, stdin=subprocess.PIPE)
                self.channels[rank] = proc.stdin
                log(f"started rank {rank} on {self.host(rank)} over ssh (ssh client pid {proc.pid})")
            else:
                proc = self.popen(rank, self.command, self.rank_env(rank), cwd=self.cwd, stdin=self.stdin_for(rank))
                log(f"started rank {rank} (pid {proc.pid}) on {self.ips[rank]}")
        log("ring " + " -> ".join(a[0] for a in self.ring) + f"; control {self.control}")

    def send(self, rank: int, sig: int) -> None:
        """Signal one rank: a local one's process group, or a remote one through its ssh stdin."""
        if not self.remote(rank):
            signal_group(self.procs[rank].pid, sig)
            return
        channel = self.channels.get(rank)
        name = REMOTE_SIGNALS.get(sig, "TERM")
        if channel is None or channel.closed:
            return
        try:
            channel.write(f"{name}\n".encode())
            channel.flush()
        except OSError:  # ssh already gone (its pipe is broken): nothing left to tell
            pass

    def forward(self, sig: int) -> None:
        # Rank 0 stops the others through the ring; they get signals only if that fails.
        if 0 in self.running():
            self.send(0, sig)
        else:
            self.kill_all(signal.SIGTERM)

    def kill_all(self, sig: int) -> None:
        for rank in self.procs:
            self.send(rank, sig)
        if sig != signal.SIGKILL:
            return
        # The remote ranks were told KILL; their ssh clients end with them. Those that do
        # not (a dead link) are killed here, so nothing of ours is left on this machine;
        # the remote rank then gets end of file when sshd notices, so SIGTERM.
        for rank in self.channels:
            self.close_channel(rank)
        clients = [p.pid for r, p in self.procs.items() if self.remote(r)]
        end = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < end and any(group_alive(pid) for pid in clients):
            time.sleep(0.05)
        for pid in clients:
            signal_group(pid, signal.SIGKILL)

    def close_channel(self, rank: int) -> None:
        try:
            self.channels[rank].close()
        except OSError:
            pass

    def rank_failure(self, rank: int, code: int, detail: str = "") -> Failure:
        if not self.remote(rank):
            return super().rank_failure(rank, code, detail)
        if code == SSH_FAILED and not detail:
            detail = f"ssh failed with exit status {SSH_FAILED} (could not connect, or lost the connection)"
        elif 128 < code <= 128 + 64:  # the remote shell's way of saying "killed by signal n"
            code = 128 - code
        return Failure(rank, code, self.host(rank), detail=detail)

    def cleanup(self) -> None:
        for rank in self.channels:
            self.close_channel(rank)
        super().cleanup()

