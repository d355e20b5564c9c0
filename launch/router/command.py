"""`launch run … -- run-trinity … --serve ADDR`: which front ends move into the launcher's
router, and the command the ranks get instead.

The router takes --serve and --http (and the TLS files, which serve those); rank 0
gets `--serve` on an internal address instead, the same in every attempt of the
ring: 127.0.0.1 when rank 0 (the first host) is this machine, else that host's IP.
When re-planning drops rank 0's host, the next host becomes rank 0 and gets a new
internal address (serve_on_first_host), which the router then calls.
--metrics stays with rank 0 (its per-rank metrics), as do --auth-token (the router
sends the token to rank 0 too), --allowed-hosts (the router's HTTP port takes it too) and
the limits (--max-queue, --max-tokens-cap).
"""

import secrets
from dataclasses import dataclass
from typing import List, Optional, Tuple

from distributed.serving.options import AUTH_TOKEN_ENV, ServeOptions, check_options, split_hosts

from ..hostfile import Hostfile
from ..processes import free_ports

ROUTER_FLAGS = ("--serve", "--http", "--tls-cert", "--tls-key")  # taken from the ranks' command


@dataclass
class RouterPlan:
    options: ServeOptions  # the router's front ends
    upstream: str  # rank 0's internal HOST:PORT
    token: Optional[str]  # sent to rank 0 with every call
    command: List[str]  # the ranks' command
    envs: List[str]  # K=V for every rank


def take_flag(cmd: List[str], flag: str) -> Tuple[List[str], Optional[str]]:
    """cmd without `flag VALUE` / `flag=VALUE` (every occurrence), and the last value."""
    out, value, i = [], None, 0
    while i < len(cmd):
        a = cmd[i]
        if a == flag and i + 1 < len(cmd):
            value, i = cmd[i + 1], i + 2
            continue
        if a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return out, value


def plan_router(cmd: List[str], hf: Hostfile) -> Optional[RouterPlan]:
    """None when the command does not serve (--serve); raises TrinityError on bad options."""
    rest, values = list(cmd), {}
    for flag in ROUTER_FLAGS:
        rest, values[flag] = take_flag(rest, flag)
    if values["--serve"] is None:
        return None
    _, token = take_flag(cmd, "--auth-token")
    _, max_queue = take_flag(cmd, "--max-queue")
    _, max_batch = take_flag(cmd, "--max-batch")
    _, allowed = take_flag(cmd, "--allowed-hosts")  # stays in the ranks' command too (rank 0's --metrics)
    options = check_options(ServeOptions(
        grpc_address=values["--serve"], http_address=values["--http"], auth_token=token,
        insecure="--insecure" in cmd, tls_cert=values["--tls-cert"], tls_key=values["--tls-key"],
        max_queue=int(max_queue) if max_queue and max_queue.lstrip("-").isdigit() else 64,
        max_batch=int(max_batch) if max_batch and max_batch.isdigit() else None,
        allowed_hosts=split_hosts(allowed) if allowed is not None else None))
    envs = []
    host = internal_host(hf)
    token = options.auth_token
    if host != "127.0.0.1" and token is None:
        # Rank 0 listens on the network: only the router may call it.
        token = secrets.token_urlsafe(24)
        envs.append(f"{AUTH_TOKEN_ENV}={token}")
    elif token is not None and take_flag(cmd, "--auth-token")[1] is None:  # from our environment: remote ranks too
        envs.append(f"{AUTH_TOKEN_ENV}={token}")
    upstream = f"{host}:{free_ports(1)[0]}"
    return RouterPlan(options, upstream, token, [*rest, "--serve", upstream], envs)


def internal_host(hf: Hostfile) -> str:
    """Where rank 0 serves the router: its host's ring IP, or loopback when it is this machine."""
    rank0 = hf.hosts[0]
    return "127.0.0.1" if rank0.is_local or not rank0.ips else rank0.ips[0]


def serve_on_first_host(command: List[str], hf: Hostfile) -> Tuple[List[str], str]:
    """The ranks' command with rank 0's internal --serve on hf's first host (rank 0's host
    was planned out), and that address. The token stays: a lost rank 0 was remote, so
    plan_router gave the ranks one."""
    upstream = f"{internal_host(hf)}:{free_ports(1)[0]}"
    return [*take_flag(command, "--serve")[0], "--serve", upstream], upstream
