"""OpenAI-compatible HTTP API on rank 0 (`run_trinity.py --serve … --http HOST:PORT`).

GET /v1/models, POST /v1/completions and POST /v1/chat/completions, streamed
(server-sent events ending in `data: [DONE]`) or not, shaped as OpenAI's API so
the `openai` package works unchanged. Which fields are taken, and the requests
they become, is openai_fields.py's; the JSON that comes back, openai_replies.py's;
chat messages and tool calls, tools.py's. Errors are OpenAI error bodies: 400 bad
input or a field that is not implemented (naming it), 401 missing or wrong bearer
token, 404 a model this server does not serve, 429 queue full, 503 loading or
pipeline down, 507 a rank had no memory for the request (runtime/memory_guard.py). Defaults follow OpenAI: temperature 1; max_tokens 16 for
completions, the rest of the context (up to the server's cap) for chat.

Monitoring: GET /health (health.py; open without a token, as gRPC's health),
GET /metrics (metrics.py) and GET /v1/status (status.py), which with the status
page (GET /, pages.py) alone are served on --metrics HOST:PORT; GET /chat is the
chat page. Each generation request is logged and counted (request_log.py).
"""

import hmac
import json
import select
import socket
import ssl
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler
from typing import Optional

from ..runtime.memory_guard import is_out_of_memory
from ..runtime.request import RequestError
from ..runtime.scheduler import QueueFull, RingUnavailable
from . import pages
from .adapters import ADAPTERS, ERROR_BODIES, ROUTES
from .health import Health
from .http_server import serve_http
from .openai_fields import ApiError, param_of, plan
from .openai_replies import Reply
from .options import ServeOptions
from .request_log import RequestLog
from .status import status_document

MAX_BODY = 16 * 2**20
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


def _down(reason: str) -> ApiError:
    """A request that failed: 507 if a rank had no memory for it (it alone failed), else the ring is down."""
    if is_out_of_memory(reason):
        return ApiError(507, reason, "insufficient_memory")
    return ApiError(503, f"the pipeline is down: {reason}", "service_unavailable")


def submit(scheduler, request, run, name=lambda param: param):
    """scheduler.submit; a grammar the library rejects is a 400 naming the field it came from
    (`name`: as the client's API calls it)."""
    try:
        return scheduler.submit(request)
    except RequestError as e:
        param = name(run.constrained_by if e.field == "grammar" else e.field)
        raise ApiError(400, f"{param}: {str(e).split(': ', 1)[1]}", param=param) from None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "trinity-pipeline"
    timeout = 300  # seconds a connection may sit idle, or a client may leave a write unread

    def log_message(self, format, *args):
        pass  # request_log.py writes one line per generation request instead

    def log_request(self, code="-", size="-"):
        self._status = int(code)  # send_response's status, for the access log

    def setup(self):
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # here, in this connection's thread, not in the accepting one

    def do_GET(self):
        self._serve()

    do_POST = do_GET

    def _serve(self):
        front = self.server.front_end
        self._body_read, self._started, self._status, error = self.command == "GET", False, None, None
        path = self.path.split("?")[0].rstrip("/")
        if self.command == "GET" and path in ("/health", "/metrics", "/v1/status"):
            return self._monitor(path)
        page = pages.find(path, front.auth_token is not None, front.api) if self.command == "GET" else None
        if page is not None:  # open: a page holds no secret, and asks for the token itself
            return self._send(200, *page, headers=pages.HEADERS)
        routes = {("GET", "/v1/models"): self._models,
                  ("POST", "/v1/completions"): lambda body, *state: self._generate(body, False, *state),
                  ("POST", "/v1/chat/completions"): lambda body, *state: self._generate(body, True, *state)}
        for key, adapter in ADAPTERS.items():
            routes[key] = lambda body, *state, adapter=adapter: self._adapted(adapter, body, *state)
        for key, answer in ROUTES.items():
            routes[key] = lambda body, *state, answer=answer: self._send_json(*answer(body, *state))
        generation = front.api and self.command == "POST" and (path in GENERATION_ROUTES or ("POST", path) in ADAPTERS)
        self._trace = front.requests.begin("http", path, self.client_address[0]) if generation else None
        self._error_body = ERROR_BODIES.get(path, ApiError.body) if front.api else ApiError.body
        try:
            front.check_auth(self.headers)
            route = routes.get((self.command, path)) if front.api else None
            if route is None:
                raise ApiError(404, f"no such endpoint: {self.command} {self.path}", code="unknown_url")
            body = self._read_body() if self.command == "POST" else None
            route(body, *front.attached())
        except ApiError as e:
            self._send_json(e.status, self._error_body(e))
            error = str(e)
        except OSError:
            self.close_connection = True  # the client went away
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            if self._started:
                self.close_connection = True
            else:
                self._send_json(500, self._error_body(ApiError(500, error, "server_error")))
        finally:
            if self._trace is not None:
                self._trace.end(self._status, error)

    def _monitor(self, path: str):
        """GET /health (open to probes, like gRPC's health), /metrics or /v1/status."""
        front = self.server.front_end
        try:
            if path == "/health":
                return self._send_json(*front.health.answer())
            front.check_auth(self.headers)
            if path == "/v1/status":
                query = urllib.parse.parse_qs(self.path.partition("?")[2], keep_blank_values=True)
                if query:  # none is implemented: refused by name, never ignored
                    raise ApiError(400, f"/v1/status takes no query parameters: got {', '.join(sorted(query))}",
                                   param=sorted(query)[0])
                return self._send_json(200, status_document(front.health, front.requests))
            self._send(200, *front.requests.metrics.exposition())
        except ApiError as e:
            self._send_json(e.status, e.body())

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
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str, headers=()):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name in headers:
            self.send_header(name, headers[name])
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
                handles.append(submit(scheduler, request, run))
            reply = self._trace.reply = Reply(run, info.model_id, tokenizer)  # its usage: the access log's
            self._stream(handles, reply) if run.stream else self._whole(handles, reply)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}", "rate_limit_exceeded") from None
        except RingUnavailable as e:
            raise _down(str(e)) from None
        finally:  # finished ones ignore it; others (the client hung up, a choice failed) stop within a step
            for handle in handles:
                handle.cancel()

    def _adapted(self, adapter, body: dict, scheduler, tokenizer, info):
        """An API served over chat completions (adapters.py): its body as a chat body, its
        reply made from the OpenAI one, event by event."""
        try:
            chat_body = adapter.to_chat(body, info, tokenizer)  # or a completions body: "prompt", no "messages"
            run = plan(chat_body, "messages" in chat_body or "prompt" not in chat_body, tokenizer, info)
        except RequestError as e:
            param = adapter.param(param_of(e, {}, True))
            raise ApiError(400, f"{param}: {str(e).split(': ', 1)[1]}", param=param) from None
        handle = None
        try:
            handle = submit(scheduler, run.requests[0], run, adapter.param)
            reply = self._trace.reply = Reply(run, info.model_id, tokenizer)
            out, choice = adapter.reply(reply, body), reply.choices[0]
            if not run.stream:
                choice.opening()
                for event in self._trace.events(handle):
                    if self._client_gone():
                        self.close_connection = True
                        return
                    choice.add(event)
                if reply.error:
                    raise _down(reply.error)
                return self._send_json(200, out.whole(reply.whole()))
            self._open_stream(out.content_type)
            self._chunk(out.opening(choice.opening()))
            for event in self._trace.events(handle):
                chunks = choice.add(event)
                if choice.error:
                    self._chunk([out.failure(self._error_body(_down(choice.error)))])
                    break
                self._chunk(out.add(chunks))
            else:
                self._chunk(out.closing())
            self.wfile.write(b"0\r\n\r\n")
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}", "rate_limit_exceeded") from None
        except RingUnavailable as e:
            raise _down(str(e)) from None
        finally:
            if handle is not None:
                handle.cancel()

    def _open_stream(self, content_type: str):
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._started = True

    def _chunk(self, frames):
        for data in frames:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _whole(self, handles, reply):
        for choice, handle in zip(reply.choices, handles):
            choice.opening()
            for event in self._trace.events(handle):
                if self._client_gone():
                    self.close_connection = True
                    return
                choice.add(event)
        if reply.error:
            raise _down(reply.error)
        self._send_json(200, reply.whole())

    def _stream(self, handles, reply):
        self._open_stream("text/event-stream")
        for choice, handle in zip(reply.choices, handles):  # choices one after the other, each with its index
            for chunk in choice.opening():
                self._event(chunk)
            for event in self._trace.events(handle):
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
        self._chunk([b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"])

    def _client_gone(self) -> bool:
        """Whether the client has closed its end (checked between tokens of a whole reply)."""
        if isinstance(self.connection, ssl.SSLSocket):
            return False  # no peeking under TLS: the final write notices instead
        try:
            return bool(select.select([self.connection], [], [], 0)[0]) and not self.connection.recv(1, socket.MSG_PEEK)
        except OSError:
            return True


class HttpFrontEnd:
    """Listens from construction; answers 503 until attach(), and again after set_not_serving().
    With api=False (--metrics), only /health and /metrics."""

    def __init__(self, options: ServeOptions, requests: Optional[RequestLog] = None, api: bool = True):
        self.auth_token = options.auth_token
        self.created = int(time.time())
        self.requests, self.api, self.health, self._state = requests or RequestLog(), api, Health(), None
        flag, address = ("--http", options.http_address) if api else ("--metrics", options.metrics_address)
        self.server = serve_http(address, flag, _Handler, options, self)
        self.port = self.server.server_address[1]

    def describe(self) -> str:
        host = self.server.server_address[0]
        return f"{'[' + host + ']' if ':' in host else host}:{self.port} ({'HTTP' if self.api else 'metrics'})"

    def attach(self, scheduler, tokenizer, info) -> None:
        """The model is loaded on every rank: start serving."""
        self._state = (scheduler, tokenizer, info)
        self.health.serving()

    def set_not_serving(self, reason: str) -> None:
        self.health.down(reason)

    def set_recovering(self, reason: str) -> None:
        """The ring is down and restarting: 503 on /health, requests still taken (they wait)."""
        self.health.recovering(reason)

    def stop(self) -> None:
        self.health.stopping()
        self.server.shutdown()
        self.server.server_close()

    def check_auth(self, headers) -> None:
        """`Authorization: Bearer TOKEN`, or Anthropic's `x-api-key: TOKEN`."""
        if self.auth_token is None:
            return
        scheme, _, token = (headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            token = headers.get("x-api-key") or ""
        if not hmac.compare_digest(token.strip().encode(), self.auth_token.encode()):
            raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer TOKEN, or x-api-key: TOKEN)",
                           code="invalid_api_key")

    def attached(self):
        reason = self.health.refusal
        if reason is not None or self._state is None:
            raise ApiError(503, reason or "the model is loading", "service_unavailable")
        return self._state


def start_http_server(options: ServeOptions, requests: Optional[RequestLog] = None, api: bool = True) -> HttpFrontEnd:
    """Listen on options.http_address (api=False: options.metrics_address) now; 503 until attach()."""
    return HttpFrontEnd(options, requests, api)
