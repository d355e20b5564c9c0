"""The HTTP transport under the OpenAI API and --metrics (http_api.py): uvicorn, with
httptools' parser (llhttp: a body framed both by Transfer-Encoding and Content-Length,
or by two Content-Lengths, is a 400, never a second request), on an asyncio loop in a
thread of its own (the scheduler keeps the main thread), IPv4 or IPv6, TLS with
--tls-cert, listening from construction.

Connections cost no thread: idle keep-alive connections and clients still sending
headers or a body live on the event loop, under the timeouts below and a bound on
connections (more get 503). A request's blocking part (planning, tokenizing, waiting
for the scheduler's events) runs on a bounded pool of worker threads (`Workers`), and
writes through `Exchange`, which hands each write to the event loop."""

import asyncio
import contextlib
import logging
import queue
import socket
import threading
from typing import Callable, List, Optional, Tuple

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .. import TrinityError
from .options import ServeOptions, split_address

HEADER_TIMEOUT_S = 30.0  # a request's line and headers must arrive within this (slowloris)
MAX_HEADER_BYTES = 64 * 1024  # a request's line and headers together (h11's bound is 16 KiB): more is 431
BODY_TIMEOUT_S = 60.0  # at most this between two pieces of a request's body
KEEP_ALIVE_S = 60.0  # an idle kept-alive connection is closed after this
WRITE_TIMEOUT_S = 300.0  # a client that leaves a reply unread this long is dropped (its request cancelled)
MAX_CONNECTIONS = 1024  # open connections (or requests) beyond this are answered 503 (uvicorn's limit_concurrency)
STOP_GRACE_S = 5.0  # at stop, in-flight requests get this long before their tasks are cancelled
BACKLOG = 128

log = logging.getLogger("distributed.serving.http")


class ClientGone(OSError):
    """The client closed its connection, or left a write unread past WRITE_TIMEOUT_S."""


class _Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size bound for each request's headers
    (uvicorn bounds only the idle time between requests, and httptools no size)."""

    _headers_due = None
    _header_bytes = 0

    def data_received(self, data: bytes) -> None:
        pending = self._headers_due is not None
        super().data_received(data)
        if pending and self._headers_due is not None:  # all of it was headers, and they are not done
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES:
                self._disarm()
                if not self.transport.is_closing():
                    self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n"
                                         b"content-length: 0\r\n\r\n")
                    self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._headers_due is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_bytes = 0
        self._headers_due = self.loop.call_later(HEADER_TIMEOUT_S, self._too_slow)

    def _disarm(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _too_slow(self) -> None:
        self._headers_due = None
        if not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    """Signals are the main thread's (run_trinity.py's, the launcher's): none installed here."""

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Workers:
    """Daemon threads for requests' blocking parts: at most `limit` at once, more wait in line
    (holding no thread). Daemon: a request blocked at the process's exit does not hold it."""

    def __init__(self, limit: int, name: str = "http"):
        self.limit, self.name = limit, name
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = self._idle = self._pending = 0

    async def run(self, fn: Callable):
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._pending += 1
            if self._pending > self._idle and self._threads < self.limit:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self._threads}", daemon=True).start()
        self._jobs.put((fn, loop, future))
        return await future

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            fn, loop, future = self._jobs.get()
            with self._lock:
                self._idle -= 1
                self._pending -= 1
            try:
                outcome = (fn(), None)
            except BaseException as e:  # noqa: B036 - handed to the awaiting task
                outcome = (None, e)
            try:
                loop.call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:
                pass  # the loop has closed (the server stopped)


def _settle(future, result, error) -> None:
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(result)


class Exchange:
    """One request as its worker thread sees it: what came (method, target, headers,
    client, body) and the way back (start / write / end, each handed to the event loop;
    ClientGone once the client has gone)."""

    def __init__(self, scope, loop, send, headers):
        self.method: str = scope["method"]
        query = scope.get("query_string") or b""
        raw = scope.get("raw_path") or scope["path"].encode()
        self.target = (raw + (b"?" + query if query else b"")).decode("latin-1")  # as the request line gave it
        self.headers = headers
        self.client: str = (scope.get("client") or ("",))[0]
        self.body: Optional[bytes] = None
        self.gone = threading.Event()  # set by the event loop once the client disconnects
        self.started = self.ended = False
        self._loop, self._send = loop, send

    def start(self, status: int, headers: List[Tuple[str, str]], whole: Optional[bytes] = None) -> None:
        """The status and headers; with `whole`, the whole body too (one hand-over)."""
        start = {"type": "http.response.start", "status": status,
                 "headers": [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in headers]}
        self._call(start, *([{"type": "http.response.body", "body": whole, "more_body": False}]
                            if whole is not None else []))
        self.started, self.ended = True, whole is not None

    def write(self, data: bytes, more: bool = True) -> None:
        self._call({"type": "http.response.body", "body": data, "more_body": more})
        self.ended = not more

    def end(self) -> None:
        self.write(b"", more=False)

    def _call(self, *messages) -> None:
        if self.gone.is_set():
            raise ClientGone("the client went away")
        future = asyncio.run_coroutine_threadsafe(_send_within(self._send, messages), self._loop)
        try:
            future.result(WRITE_TIMEOUT_S + 5)
        except BaseException as e:  # timed out, the loop closed, the task cancelled at stop
            future.cancel()
            self.gone.set()
            raise ClientGone(f"the client went away ({type(e).__name__})") from None
        if self.gone.is_set() and messages[-1]["type"] == "http.response.body" and messages[-1].get("more_body"):
            raise ClientGone("the client went away")


async def _send_within(send, messages) -> None:
    for message in messages:
        await asyncio.wait_for(send(message), WRITE_TIMEOUT_S)


def _socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class Listener:
    """A uvicorn server on its own thread, serving `app` on a socket bound at construction."""

    def __init__(self, address: str, flag: str, app, options: ServeOptions):
        host, port = split_address(address, flag)
        try:
            self.socket = _socket(host, port)
        except OSError as e:
            raise TrinityError(f"{flag} {address}: cannot listen ({e})") from None
        self.server_address = self.socket.getsockname()[:2]
        config = uvicorn.Config(
            app, http=_Protocol, loop="asyncio", ws="none", lifespan="off", interface="asgi3",
            log_config=None, log_level="warning", access_log=False, server_header=False,
            headers=[("server", "trinity-pipeline")], timeout_keep_alive=KEEP_ALIVE_S,
            limit_concurrency=MAX_CONNECTIONS, backlog=BACKLOG, timeout_graceful_shutdown=STOP_GRACE_S,
            ssl_certfile=options.tls_cert, ssl_keyfile=options.tls_key)
        try:
            config.load()  # here, so that a bad certificate stops the start
        except Exception as e:
            self.socket.close()
            raise TrinityError(f"{flag} {address}: cannot serve ({e})") from None
        self.server = _Server(config)
        self.thread = threading.Thread(target=self._run, name=f"http {address}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve(sockets=[self.socket]))
        except BaseException:  # noqa: B036 - a daemon thread: log, never raise into nothing
            log.exception("the HTTP server stopped")

    def stop(self) -> None:
        """Stop listening now; in-flight requests get STOP_GRACE_S (their streams end as the scheduler closes)."""
        self.server.should_exit = True
        self.thread.join(timeout=1.0)  # uvicorn notices within 0.1 s and closes the listening socket first
        if self.thread.is_alive():
            try:
                self.socket.close()
            except OSError:
                pass


def serve_http(address: str, flag: str, app, options: ServeOptions) -> Listener:
    """Listen on `address` (given as `flag`) now and serve the ASGI `app` from a thread of its own."""
    return Listener(address, flag, app, options)
