"""The control channel's links: one line of JSON per message over plain TCP
(watchdog.py runs the protocol)."""

import json
import socket
import threading
import time
from typing import Optional, Tuple

from .. import TrinityError

CONTROL_ENV = "TRINITY_CONTROL_ADDR"
HELLO_TIMEOUT_S = 10.0  # a connection that says nothing this long is not one of ours
IO_TIMEOUT_S = 1.0  # a send to a dead link never blocks a thread for longer

Address = Tuple[str, int]


class Peer:
    def __init__(self, sock: socket.socket, host: Optional[str]):
        self.sock, self.host = sock, host
        self.last_seen = time.monotonic()
        self.gone = False  # said bye: its exit is expected
        self.lock = threading.Lock()  # one writer at a time
        self.buf = b""  # what arrived after the last complete line

    def send(self, msg: dict) -> None:
        with self.lock:
            try:
                self.sock.sendall((json.dumps(msg) + "\n").encode())
            except OSError:
                pass  # the reader or the monitor notices a dead peer

    def lines(self, deadline: Optional[float] = None):
        """Messages as they arrive; returns at EOF, a reset, or past `deadline`.
        What is not taken yet stays in self.buf for the next call."""
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if isinstance(msg, dict):
                    yield msg
            if len(self.buf) > 65536:
                return  # no line of ours is this long
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                if deadline is not None and time.monotonic() > deadline:
                    return
                continue  # the monitor judges silence, not this thread
            except OSError:
                return
            if not data:
                return
            self.last_seen = time.monotonic()
            self.buf += data



def listen(address: Address) -> socket.socket:
    """Rank 0's control listener on `address` (all interfaces if that IP is not ours)."""
    sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restarts reuse the port at once
    try:
        try:
            sock.bind(address)
        except OSError as e:
            if e.errno != 99:  # EADDRNOTAVAIL: e.g. a NAT address in the hostfile
                raise
            sock.bind(("", address[1]))
        sock.listen(64)
    except OSError as e:
        sock.close()
        raise TrinityError(f"rank 0 cannot listen for the other ranks on {address[0]}:{address[1]} ({e}); "
                           f"set {CONTROL_ENV}=HOST:PORT to a free address every rank can reach") from None
    return sock
