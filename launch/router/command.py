"""`launch run … -- run-trinity … --serve ADDR`: which front ends move into the launcher's
router, and the command the ranks get instead.

The router takes --serve and --http (and the TLS files, which serve those); rank 0
gets `--serve` on an internal address instead: 127.0.0.1 when rank 0 (the first host)
is this machine, else that host's IP, on a port free when the attempt starts (a
restart gets a fresh one: the port let go of may be taken meanwhile). When re-planning
drops rank 0's host, the next host becomes rank 0 and gets a new internal address
(serve_on_first_host, both through Router.rebind), which the router then calls.
--metrics stays with rank 0 (its per-rank metrics), as do --auth-token (the router
sends the token to rank 0 too), --allowed-hosts (the router's HTTP port takes it too) and
the limits (--max-queue, --max-tokens-cap).
"""

import secrets
from dataclasses import dataclass
from typing import List, Optional, Tuple

from distributed.command_line import read_command, without_flags
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


def plan_router(cmd: List[str], hf: Hostfile) -> Optional[RouterPlan]:
    """None when the command does not serve (--serve); raises TrinityError on bad options.
    The ranks' command is read by run-trinity's own parser (distributed/cli.py)."""
    settings = read_command(cmd).settings
    given = settings.serving
    if given.serve is None:
        return None
    # --allowed-hosts stays in the ranks' command too (rank 0's --metrics)
    options = check_options(ServeOptions(
        grpc_address=given.serve, http_address=given.http, auth_token=given.auth_token, insecure=given.insecure,
        tls_cert=given.tls_cert, tls_key=given.tls_key, max_queue=given.max_queue,
        max_batch=settings.sizing.max_batch,
        allowed_hosts=split_hosts(given.allowed_hosts) if given.allowed_hosts is not None else None))
    envs = []
    host = internal_host(hf)
    token = options.auth_token
    if host != "127.0.0.1" and token is None:
        # Rank 0 listens on the network: only the router may call it.
        token = secrets.token_urlsafe(24)
        envs.append(f"{AUTH_TOKEN_ENV}={token}")
    elif token is not None and given.auth_token is None:  # from our environment: remote ranks too
        envs.append(f"{AUTH_TOKEN_ENV}={token}")
    upstream = f"{host}:{free_ports(1)[0]}"
    return RouterPlan(options, upstream, token, [*without_flags(cmd, ROUTER_FLAGS), "--serve", upstream], envs)


def internal_host(hf: Hostfile) -> str:
    """Where rank 0 serves the router: its host's ring IP, or loopback when it is this machine."""
    rank0 = hf.hosts[0]
    return "127.0.0.1" if rank0.is_local or not rank0.ips else rank0.ips[0]


def serve_on_first_host(command: List[str], hf: Hostfile) -> Tuple[List[str], str]:
    """The ranks' command with rank 0's internal --serve on hf's first host (rank 0's host
    was planned out), and that address. The token stays: a lost rank 0 was remote, so
    plan_router gave the ranks one."""
    upstream = f"{internal_host(hf)}:{free_ports(1)[0]}"
    return [*without_flags(command, ["--serve"]), "--serve", upstream], upstream
