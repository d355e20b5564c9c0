"""OpenAI-compatible HTTP API on rank 0 (`run_trinity.py --serve … --http HOST:PORT`).

GET /v1/models, POST /v1/completions and POST /v1/chat/completions, streamed
(server-sent events ending in `data: [DONE]`) or not, shaped as OpenAI's API so
the `openai` package works unchanged. Which fields are taken, and the requests
they become, is openai_fields.py's; the JSON that comes back, openai_replies.py's;
chat messages and tool calls, tools.py's. Errors are OpenAI error bodies: 400 bad
input or a field that is not implemented (naming it), 401 missing or wrong bearer
token, 404 a model this server does not serve, 429 queue full, 503 loading or
pipeline down. Defaults follow OpenAI: temperature 1; max_tokens 16 for
completions, the rest of the context (up to the server's cap) for chat.
"""

import hmac
import json
import select
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .. import TrinityError
from ..runtime.request import RequestError
from ..runtime.scheduler import QueueFull, RingUnavailable
from .openai_fields import ApiError, param_of, plan
from .openai_replies import Reply
from .options import ServeOptions, split_address

MAX_BODY = 16 * 2**20


def _down(reason: str) -> ApiError:
    return ApiError(503, f"the pipeline is down: {reason}", "service_unavailable")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "trinity-pipeline"
    timeout = 300  # seconds a connection may sit idle, or a client may leave a write unread

    def log_message(self, format, *args):
        pass

    def setup(self):
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # here, in this connection's thread, not in the accepting one

    def do_GET(self):
        self._serve()

    do_POST = do_GET

    def _serve(self):
        front = self.server.front_end
        self._body_read, self._started = self.command == "GET", False
        routes = {("GET", "/v1/models"): self._models,
                  ("POST", "/v1/completions"): lambda body, *state: self._generate(body, False, *state),
                  ("POST", "/v1/chat/completions"): lambda body, *state: self._generate(body, True, *state)}
        try:
            front.check_auth(self.headers.get("Authorization"))
            route = routes.get((self.command, self.path.split("?")[0].rstrip("/")))
            if route is None:
                raise ApiError(404, f"no such endpoint: {self.command} {self.path}", code="unknown_url")
            body = self._read_body() if self.command == "POST" else None
            route(body, *front.attached())
        except ApiError as e:
            self._send_json(e.status, e.body())
        except OSError:
            self.close_connection = True  # the client went away
        except Exception as e:
            if self._started:
                self.close_connection = True
            else:
                self._send_json(500, ApiError(500, f"{type(e).__name__}: {e}", "server_error").body())

    def _read_body(self) -> dict:
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            raise ApiError(411, "a Content-Length header is required")
        if int(length) > MAX_BODY:
            raise ApiError(413, f"the body is over {MAX_BODY} bytes")
        raw = self.rfile.read(int(length))
        self._body_read = True
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def _send_json(self, status: int, obj: dict):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if not self._body_read:
            self.send_header("Connection", "close")  # an unread body would be taken for the next request
        self.end_headers()
        self.wfile.write(data)

    def _models(self, body, scheduler, tokenizer, info):
        model = {"id": info.model_id, "object": "model", "created": self.server.front_end.created,
                 "owned_by": "trinity-pipeline", "max_model_len": info.max_context}
        self._send_json(200, {"object": "list", "data": [model]})

    def _generate(self, body: dict, chat: bool, scheduler, tokenizer, info):
        try:
            run = plan(body, chat, tokenizer, info)
        except RequestError as e:
            param = param_of(e, body, chat)
            raise ApiError(400, f"{param}: {str(e).split(': ', 1)[1]}", param=param) from None
        handles = []
        try:
            for request in run.requests:  # one per choice
                handles.append(scheduler.submit(request))
            reply = Reply(run, info.model_id, tokenizer)
            self._stream(handles, reply) if run.stream else self._whole(handles, reply)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}", "rate_limit_exceeded") from None
        except RingUnavailable as e:
            raise _down(str(e)) from None
        finally:  # finished ones ignore it; others (the client hung up, a choice failed) stop within a step
            for handle in handles:
                handle.cancel()

    def _whole(self, handles, reply):
        for choice, handle in zip(reply.choices, handles):
            choice.opening()
            for event in handle.events():
                if self._client_gone():
                    self.close_connection = True
                    return
                choice.add(event)
        if reply.error:
            raise _down(reply.error)
        self._send_json(200, reply.whole())

    def _stream(self, handles, reply):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._started = True
        for choice, handle in zip(reply.choices, handles):  # choices one after the other, each with its index
            for chunk in choice.opening():
                self._event(chunk)
            for event in handle.events():
                chunks = choice.add(event)
                if choice.error:
                    self._event(_down(choice.error).body())  # the `openai` package raises APIError on it
                    break
                for chunk in chunks:
                    self._event(chunk)
            if choice.error:
                break
        else:
            if reply.plan.include_usage:
                self._event(reply.usage_chunk())
            self._event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")

    def _event(self, obj):
        data = b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _client_gone(self) -> bool:
        """Whether the client has closed its end (checked between tokens of a whole reply)."""
        if isinstance(self.connection, ssl.SSLSocket):
            return False  # no peeking under TLS: the final write notices instead
        try:
            return bool(select.select([self.connection], [], [], 0)[0]) and not self.connection.recv(1, socket.MSG_PEEK)
        except OSError:
            return True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def handle_error(self, request, client_address):
        pass  # a connection that failed (reset, TLS handshake); API errors are answered in the handler


class _Server6(_Server):
    address_family = socket.AF_INET6


class HttpFrontEnd:
    """Listens from construction; answers 503 until attach(), and again after set_not_serving()."""

    def __init__(self, options: ServeOptions):
        host, port = split_address(options.http_address, "--http")
        try:
            self.server = (_Server6 if ":" in host else _Server)((host, port), _Handler)
        except OSError as e:
            raise TrinityError(f"--http {options.http_address}: cannot listen ({e})") from None
        if options.tls_cert:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(options.tls_cert, options.tls_key)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True, do_handshake_on_connect=False)
        self.server.front_end = self
        self.port = self.server.server_address[1]
        self.auth_token = options.auth_token
        self.created = int(time.time())
        self.unavailable, self._state = "the model is loading", None
        threading.Thread(target=self.server.serve_forever, name="http", daemon=True).start()

    def describe(self) -> str:
        host = self.server.server_address[0]
        return f"{'[' + host + ']' if ':' in host else host}:{self.port} (HTTP)"

    def attach(self, scheduler, tokenizer, info) -> None:
        """The model is loaded on every rank: start serving."""
        self._state = (scheduler, tokenizer, info)
        self.unavailable = None

    def set_not_serving(self, reason: str) -> None:
        self.unavailable = f"the pipeline is down: {reason}"

    def stop(self) -> None:
        self.unavailable = "the server is shutting down"
        self.server.shutdown()
        self.server.server_close()

    def check_auth(self, header) -> None:
        if self.auth_token is None:
            return
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.auth_token.encode()):
            raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer TOKEN)", code="invalid_api_key")

    def attached(self):
        if self.unavailable is not None or self._state is None:
            raise ApiError(503, self.unavailable or "the model is loading", "service_unavailable")
        return self._state


def start_http_server(options: ServeOptions) -> HttpFrontEnd:
    """Listen on options.http_address now; 503 until attach()."""
    return HttpFrontEnd(options)
