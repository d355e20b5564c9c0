"""`run_trinity.py --serve`'s options (addresses, authentication, TLS, limits) and
the checks that refuse unsafe or inconsistent ones before anything loads."""

import ipaddress
import os
from dataclasses import dataclass
from typing import Optional

from .. import TrinityError

AUTH_TOKEN_ENV = "TRINITY_AUTH_TOKEN"


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


def split_address(address: str, flag: str):
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise TrinityError(f"{flag} {address!r} is not HOST:PORT")
    if int(port) > 65535:  # gRPC would wrap it round to another port
        raise TrinityError(f"{flag} {address}: port {port} is out of range (0-65535)")
    return host.strip("[]") or "127.0.0.1", int(port)


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

