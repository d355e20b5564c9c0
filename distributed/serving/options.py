"""`run_trinity.py --serve`'s options (addresses, authentication, TLS, limits) and
the checks that refuse unsafe or inconsistent ones before anything loads."""

import ipaddress
import os
from dataclasses import dataclass
from typing import List, Optional

from .. import TrinityError

AUTH_TOKEN_ENV = "TRINITY_AUTH_TOKEN"
ALLOWED_HOSTS_ENV = "TRINITY_ALLOWED_HOSTS"  # --allowed-hosts' default (as Ollama's OLLAMA_ORIGINS)


@dataclass
class ServeOptions:
    grpc_address: str  # HOST:PORT
    http_address: Optional[str] = None  # HOST:PORT for the OpenAI-compatible API
    metrics_address: Optional[str] = None  # HOST:PORT for /metrics and /health alone
    auth_token: Optional[str] = None  # clients send `authorization: Bearer <token>`
    insecure: bool = False  # allow a non-loopback bind without a token
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    max_queue: int = 64
    max_tokens_cap: int = 4096
    max_batch: Optional[int] = None  # --max-batch; None: rank 0 sets it from memory (at most MAX_BATCH)
    # Without a token, the HTTP ports answer only these names besides local ones and IP addresses
    # (Host), and only pages of them (Origin): --allowed-hosts a,b; "*" lets every name in.
    allowed_hosts: Optional[List[str]] = None


def split_address(address: str, flag: str):
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise TrinityError(f"{flag} {address!r} is not HOST:PORT")
    if int(port) > 65535:  # gRPC would wrap it round to another port
        raise TrinityError(f"{flag} {address}: port {port} is out of range (0-65535)")
    return host.strip("[]") or "127.0.0.1", int(port)


def split_hosts(value: Optional[str]) -> List[str]:
    """--allowed-hosts a,b (or its environment variable) as a list of names."""
    return [h.strip() for h in (value or "").split(",") if h.strip()]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_options(options: ServeOptions) -> ServeOptions:
    """Refuse unsafe or inconsistent settings before anything loads."""
    options.auth_token = options.auth_token or os.environ.get(AUTH_TOKEN_ENV) or None
    if options.allowed_hosts is None:
        options.allowed_hosts = split_hosts(os.environ.get(ALLOWED_HOSTS_ENV))
    for flag, address in (("--serve", options.grpc_address), ("--http", options.http_address),
                          ("--metrics", options.metrics_address)):
        if address is None:
            continue
        host, _ = split_address(address, flag)
        if not is_loopback(host) and not options.auth_token and not options.insecure:
            raise TrinityError(
                f"{flag} {address} is not a loopback address: set --auth-token (or {AUTH_TOKEN_ENV}) "
                "or pass --insecure to serve without authentication"
            )
    if bool(options.tls_cert) != bool(options.tls_key):
        raise TrinityError("--tls-cert and --tls-key go together")
    for path in (options.tls_cert, options.tls_key):
        if path and not os.path.exists(path):
            raise TrinityError(f"TLS file {path} does not exist")
    if options.max_queue < 1:
        raise TrinityError(f"--max-queue must be at least 1, got {options.max_queue}")
    return options

