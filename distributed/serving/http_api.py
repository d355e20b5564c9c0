"""OpenAI-compatible HTTP API on rank 0 (`run_trinity.py --serve … --http HOST:PORT`).

GET /v1/models, POST /v1/completions and POST /v1/chat/completions, streamed
(server-sent events ending in `data: [DONE]`) or not, shaped as OpenAI's API so
the `openai` package works unchanged. Input is validated by the code all front
ends share (requests.py). Errors are OpenAI error bodies: 400 bad input (naming
the field), 401 missing or wrong bearer token, 429 queue full, 503 loading or
pipeline down. Extensions: top_k and min_p (the `openai` package sends them in
`extra_body`). Defaults follow OpenAI: temperature 1; max_tokens 16 for
completions, the rest of the context (up to the server's cap) for chat.
"""

import hmac
import json
import select
import socket
import ssl
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .. import TrinityError
from ..runtime.request import RequestError, TokenEvent
from ..runtime.scheduler import QueueFull, RingUnavailable
from .options import ServeOptions, split_address
from .requests import build_request, prompt_ids

MAX_BODY = 16 * 2**20


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def _down(reason: str) -> ApiError:
    return ApiError(503, f"the pipeline is down: {reason}", "service_unavailable")


def _get(body: dict, name: str, kinds: tuple, default=None):
    """body[name] if it is one of `kinds` (a bool is no number here); `default` if absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join("number" if k is float else k.__name__ for k in kinds)
        raise RequestError(name, f"expected {names}, got {json.dumps(value)[:40]}")
    return value


def _text_parts(m):
    """Message content given as a list of text parts becomes one string."""
    parts = m.get("content") if isinstance(m, dict) else None
    if isinstance(parts, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        return {**m, "content": "".join(p["text"] for p in parts)}
    return m


def _prompt_ids(body: dict, chat: bool, tokenizer) -> list:
    """Token ids of the prompt; empty ones are left for build_request to refuse."""
    if chat:
        messages = _get(body, "messages", (list,), [])
        return prompt_ids(tokenizer, messages=[_text_parts(m) for m in messages]) if messages else []
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt_ids(tokenizer, prompt=prompt) if prompt else []  # raw text: no chat template
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt_ids(tokenizer, token_ids=prompt) if prompt else []
    raise RequestError("prompt", "expected a string or a list of token ids (one prompt per request)")


def _sampling(body: dict, chat: bool, max_name: str, prompt_len: int, info) -> dict:
    if _get(body, "n", (int,), 1) != 1:
        raise RequestError("n", "only n=1 is supported")
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise RequestError("stop", "expected a string or a list of strings")
    default_max = max(1, min(info.max_tokens_cap, info.max_context - prompt_len)) if chat else 16
    return dict(
        max_tokens=_get(body, max_name, (int,), default_max),
        temperature=float(_get(body, "temperature", (int, float), 1.0)),
        top_p=float(_get(body, "top_p", (int, float), 1.0)),
        top_k=_get(body, "top_k", (int,), 0),
        min_p=float(_get(body, "min_p", (int, float), 0.0)),
        seed=_get(body, "seed", (int,), None),
        stop=stop,
    )


class _Reply:
    """One completion built from scheduler events, whole or as stream chunks."""

    def __init__(self, chat: bool, model: str, tokenizer, logprobs: bool):
        self.chat, self.model, self.tokenizer, self.logprobs = chat, model, tokenizer, logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text, self.entries, self.offset = [], [], 0
        self.finish = self.error = None
        self.usage = {}

    def add(self, event) -> list:
        """Takes one event; returns its logprob entries."""
        entries = []
        if isinstance(event, TokenEvent):
            if self.logprobs:
                token = self.tokenizer.decode([event.token_id])
                entries = [{"token": token, "logprob": event.logprob, "bytes": list(token.encode()),
                            "top_logprobs": [], "offset": self.offset}]
            self.offset += len(event.text)
        else:
            self.finish = "length" if event.finish_reason == "length" else "stop"  # "cancelled": nobody listens
            self.error = event.error if event.finish_reason == "error" else None
            self.usage = {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
                          "total_tokens": event.prompt_tokens + event.completion_tokens,
                          "prompt_tokens_details": {"cached_tokens": event.cached_tokens}}
        self.text.append(event.text)
        self.entries += entries
        return entries

    def _logprobs(self, entries):
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [{k: e[k] for k in ("token", "logprob", "bytes", "top_logprobs")} for e in entries]}
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": None, "text_offset": [e["offset"] for e in entries]}

    def _frame(self, kind: str, choice: dict, entries, finish) -> dict:
        choice = {"index": 0, **choice, "logprobs": self._logprobs(entries), "finish_reason": finish}
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def chunk(self, text: str, entries=(), finish=None, role: bool = False) -> dict:
        if not self.chat:
            return self._frame("text_completion", {"text": text}, entries, finish)
        delta = {"role": "assistant", "content": ""} if role else {"content": text} if text else {}
        return self._frame("chat.completion.chunk", {"delta": delta}, entries, finish)

    def whole(self) -> dict:
        text = "".join(self.text)
        if self.chat:
            reply = self._frame("chat.completion", {"message": {"role": "assistant", "content": text}},
                                self.entries, self.finish)
        else:
            reply = self._frame("text_completion", {"text": text}, self.entries, self.finish)
        return {**reply, "usage": self.usage}


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
        max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        renamed = {"max_tokens": max_name, "token_ids": "prompt", **({"prompt": "messages", "token_ids": "messages"} if chat else {})}
        try:
            ids = _prompt_ids(body, chat, tokenizer)
            request = build_request(info, ids, **_sampling(body, chat, max_name, len(ids), info))
            logprobs = _get(body, "logprobs", (bool,) if chat else (int,), False)
            if logprobs is not False and logprobs < 0:
                raise RequestError("logprobs", f"must be >= 0, got {logprobs}")
            stream = _get(body, "stream", (bool,), False)
            usage_chunk = bool(_get(body, "stream_options", (dict,), {}).get("include_usage"))
        except RequestError as e:
            param = renamed.get(e.field, e.field)
            raise ApiError(400, f"{param}: {str(e).split(': ', 1)[1]}", param=param) from None
        try:
            handle = scheduler.submit(request)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}", "rate_limit_exceeded") from None
        except RingUnavailable as e:
            raise _down(str(e)) from None
        reply = _Reply(chat, info.model_id, tokenizer, logprobs is not False)
        try:
            self._stream(handle, reply, usage_chunk) if stream else self._whole(handle, reply)
        except Exception:  # mostly the client hanging up: the scheduler stops within one decode step
            handle.cancel()
            raise

    def _whole(self, handle, reply):
        for event in handle.events():
            if self._client_gone():
                handle.cancel()
                self.close_connection = True
                return
            reply.add(event)
        if reply.error:
            raise _down(reply.error)
        self._send_json(200, reply.whole())

    def _stream(self, handle, reply, usage_chunk: bool):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._started = True
        if reply.chat:
            self._event(reply.chunk("", role=True))
        for event in handle.events():
            entries = reply.add(event)
            if reply.error:
                self._event(_down(reply.error).body())  # the `openai` package raises APIError on it
                break
            if event.text or entries or reply.finish:
                self._event(reply.chunk(event.text, entries, reply.finish))
        else:
            if usage_chunk:
                self._event({**reply.chunk(""), "choices": [], "usage": reply.usage})
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
