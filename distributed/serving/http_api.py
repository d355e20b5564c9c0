"""OpenAI-compatible HTTP API on rank 0 (`run_trinity.py --serve … --http HOST:PORT`).

GET /v1/models, POST /v1/completions and POST /v1/chat/completions, streamed
(server-sent events ending in `data: [DONE]`) or not, shaped as OpenAI's API so
the `openai` package works unchanged. Which fields are taken, and the requests
they become, and the JSON that comes back, are openai_api.py's;
chat messages and tool calls, tools.py's. Errors are OpenAI error bodies: 400 bad
input or a field that is not implemented (naming it), 401 missing or wrong bearer
token, 404 a model this server does not serve, 429 queue full, 503 loading or
pipeline down, 507 a rank had no memory for the request (runtime/memory_guard.py). Defaults follow OpenAI: temperature 1; max_tokens 16 for
completions, the rest of the context (up to the server's cap) for chat.

Before any of that, cheaply: without a token, a foreign Host or Origin is 403
(check_origin); a POST body must be application/json (415), at most MAX_BODY (413, before
reading past it), UTF-8 JSON, an object nested at most MAX_DEPTH deep without lone
surrogates (400), its text within text_bound() of the context and its rows within the batch
(400, before tokenizing). An unexpected exception is logged with its traceback and answered
500 "internal error", never with its text. The transport (uvicorn, worker threads) is
http_server.py's; GET /openapi.json, openapi.py's.

Monitoring: GET /health (Health; open without a token, as gRPC's health),
GET /metrics (metrics.py) and GET /v1/status (status.py), which with the status
page (GET /, pages.py) alone are served on --metrics HOST:PORT; GET /chat is the
chat page. Each generation request is logged and counted (request_log.py).
"""

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import time
import urllib.parse
from typing import Optional, Tuple

from starlette.datastructures import Headers

from ..runtime.request import RequestError, failure_kind
from ..runtime.scheduler import QueueFull, RingUnavailable
from ..shard.memory import MAX_BATCH
from . import anthropic_api, ollama_api, openapi, pages, responses_api
from .http_server import BODY_TIMEOUT_S, ClientGone, Exchange, Workers, serve_http
from .openai_api import Completion, param_of, parse_body, plan, prompt_count
from .options import ALLOWED_HOSTS_ENV, ServeOptions, split_address
from .protocol import ApiError, Reply
from .request_log import RequestLog
from .sealed import Sealer
from .status import status_document

MAX_BODY = 16 * 2**20
MAX_DEPTH = 64  # JSON nesting a body may have (tool schemas included)
BYTES_PER_TOKEN, TEXT_SLACK = 4, 64 * 1024  # a request's text bound: see text_bound()
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: every client skips it, and its idle timer starts over
log = logging.getLogger("distributed.serving.http")
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
# The APIs served besides OpenAI's completions and chat (openai_api.Adapter), by route: generation
# routes (ADAPTED_ROUTES; each front end's adapters()), plain ones (ROUTES: fn(body, scheduler, tokenizer,
# info) -> (status, JSON)), and each route's error shape (ERROR_BODIES: fn(ApiError) -> JSON).
ADAPTED_ROUTES = {responses_api.ROUTE, *anthropic_api.ADAPTERS, *ollama_api.ADAPTERS}
ROUTES = {**responses_api.ROUTES, **anthropic_api.ROUTES, **ollama_api.ROUTES}
ERROR_BODIES = {**responses_api.ERROR_BODIES, **anthropic_api.ERROR_BODIES, **ollama_api.ERROR_BODIES}


def _down(reason: str) -> ApiError:
    """A request that failed, by whose failure (runtime/request.py failure_kind): 400 its own input,
    507 a rank had no memory for it (it alone failed), 503 a reset (retry) or the ring is down."""
    kind = failure_kind(reason)
    if kind == "request":
        return ApiError(400, reason)
    if kind == "memory":
        return ApiError(507, reason, "insufficient_memory")
    return ApiError(503, reason if kind == "reset" else f"the pipeline is down: {reason}", "service_unavailable")


def submit(scheduler, request, run, name=lambda param: param):
    """scheduler.submit; a grammar the library rejects is a 400 naming the field it came from
    (`name`: as the client's API calls it)."""
    try:
        return scheduler.submit(request)
    except RequestError as e:
        param = name(run.constrained_by if e.field == "grammar" else e.field)
        raise ApiError(400, e.as_named(param), param=param) from None


class _Handler:
    """One request: cheap checks on the event loop (`precheck`), the rest on a worker thread
    (`run`), which writes through the Exchange."""

    def __init__(self, front: "HttpFrontEnd", x: Exchange):
        self.front, self.x = front, x
        self.command, self.path, self.headers = x.method, x.target, x.headers
        self._status, self._trace, self._route, self._body_read = None, None, None, self.command != "POST"
        self._started = False
        self._error_body = ApiError.body

    # ---- on the event loop: nothing here blocks

    def precheck(self) -> Optional[Tuple[int, bytes, str, dict]]:
        """An answer that needs no body and no worker thread (monitoring, pages, refusals), or
        None: the request goes on (its body is read, then run())."""
        front, path = self.front, self.path.split("?")[0].rstrip("/")
        self._error_body = ERROR_BODIES.get(path, ApiError.body) if front.api else ApiError.body
        if self.command == "GET" and path == "/health":  # open to any probe: it tells only whether we serve
            return self._monitor(path)
        try:
            front.check_origin(self.headers)
        except ApiError as e:
            return self._answer(e.status, self._error_body(e))
        if self.command == "GET" and path in ("/metrics", "/v1/status"):
            return self._monitor(path)
        if self.command == "GET" and front.api and path == "/openapi.json":
            return self._answer(200, openapi.document())
        page = pages.find(path, front.auth_token is not None, front.api) if self.command == "GET" else None
        if page is not None:  # open: a page holds no secret, and asks for the token itself
            return 200, page[0], page[1], pages.HEADERS
        routes = {("GET", "/v1/models"): self._models,
                  ("POST", "/v1/completions"): lambda body, *state: self._generate(body, False, *state),
                  ("POST", "/v1/chat/completions"): lambda body, *state: self._generate(body, True, *state)}
        for key, adapter in front.adapters.items():
            routes[key] = lambda body, *state, adapter=adapter: self._adapted(adapter, body, *state)
        for key, answer in ROUTES.items():
            routes[key] = lambda body, *state, answer=answer: self._plain(answer, body, *state)
        generation = front.api and self.command == "POST" and (path in GENERATION_ROUTES or ("POST", path) in ADAPTED_ROUTES)
        self._trace = front.requests.begin("http", path, self.x.client) if generation else None
        try:
            front.check_auth(self.headers)
            self._route = routes.get((self.command, path)) if front.api else None
            if self._route is None:
                raise ApiError(404, f"no such endpoint: {self.command} {self.path}", code="unknown_url")
            if self.command == "POST":
                self._check_framing()
        except ApiError as e:
            self._end_trace(e.status, str(e))
            return self._answer(e.status, self._error_body(e))
        return None

    def _answer(self, status: int, obj: dict) -> Tuple[int, bytes, str, dict]:
        self._status = status
        return status, json.dumps(obj).encode(), "application/json", {}

    def _check_framing(self) -> None:
        """A POST's Content-Type and announced size, before its body is read."""
        kind = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise ApiError(415, f"the body must be JSON, sent as Content-Type: application/json "
                                f"(got {json.dumps((self.headers.get('Content-Type') or 'none')[:60])})")
        length = self.headers.get("Content-Length")
        if length is None:
            if "chunked" not in (self.headers.get("Transfer-Encoding") or "").lower():
                raise ApiError(411, "a Content-Length header is required")
        elif not length.strip().isdigit():
            raise ApiError(400, "the Content-Length header is not a number")
        elif int(length) > MAX_BODY:
            raise ApiError(413, f"the body is over {MAX_BODY} bytes")

    def refusal(self, status: int, message: str) -> Tuple[int, bytes, str, dict]:
        """The answer to a body that could not be read whole (too large, too slow)."""
        error = ApiError(status, message)
        self._end_trace(status, message)
        return self._answer(status, self._error_body(error))

    def _monitor(self, path: str):
        """GET /health (open to probes, like gRPC's health), /metrics or /v1/status."""
        front = self.front
        try:
            if path == "/health":
                return self._answer(*front.health.answer())
            front.check_auth(self.headers)
            if path == "/v1/status":
                query = urllib.parse.parse_qs(self.path.partition("?")[2], keep_blank_values=True)
                if query:  # none is implemented: refused by name, never ignored
                    raise ApiError(400, f"/v1/status takes no query parameters: got {', '.join(sorted(query))}",
                                   param=sorted(query)[0])
                return self._answer(200, status_document(front.health, front.requests))
            data, content_type = front.requests.metrics.exposition()
            return 200, data, content_type, {}
        except ApiError as e:
            return self._answer(e.status, e.body())

    # ---- on a worker thread

    def run(self) -> None:
        error = None
        try:
            body = self._parse(self.x.body) if self.command == "POST" else None
            scheduler, tokenizer, info = self.front.attached()
            if body is not None:
                _check_size(body, info)
            # A generation's request is arriving until it is submitted: a burst prefills together.
            with scheduler.arriving() if self._trace is not None else contextlib.nullcontext():
                self._route(body, scheduler, tokenizer, info)
        except ApiError as e:
            error = str(e)
            if not self._started:  # else the connection ends, the reply cut short
                self._send_json(e.status, self._error_body(e))
        except ClientGone:
            pass  # nothing to answer: its requests are cancelled (the routes' finally)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            log.exception("internal error serving %s %s", self.command, self.path.split("?")[0][:200])
            if not self._started:
                self._send_json(500, self._error_body(ApiError(500, "internal error", "server_error")))
        finally:
            self._end_trace(self._status, error)

    def _end_trace(self, status, error) -> None:
        if self._trace is not None:
            self._trace.end(status, error)
            self._trace = None

    @staticmethod
    def _parse(raw: bytes) -> dict:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ApiError(400, f"the body is not valid UTF-8 (byte {e.start})") from None
        try:
            body = json.loads(text)
        except RecursionError:
            raise ApiError(400, f"the body's JSON is nested too deep (at most {MAX_DEPTH} levels)") from None
        except ValueError as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        _check_json(body)
        return body

    def _send_json(self, status: int, obj: dict):
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str, headers=()):
        self._status = status
        self.x.start(status, [("Content-Type", content_type), ("Content-Length", str(len(data))),
                              *((name, headers[name]) for name in headers)], whole=data)

    def _plain(self, answer, body, *state):
        """A plain route (ROUTES): its JSON, or a 400 naming the field its RequestError names."""
        try:
            status, obj = answer(body, *state)
        except RequestError as e:
            raise ApiError(400, str(e), param=e.field) from None
        self._send_json(status, obj)

    def _models(self, body, scheduler, tokenizer, info):
        model = {"id": info.model_id, "object": "model", "created": self.front.created,
                 "owned_by": "trinity-pipeline", "max_model_len": info.max_context}
        self._send_json(200, {"object": "list", "data": [model]})

    def _generate(self, body: dict, chat: bool, scheduler, tokenizer, info):
        request = None
        try:
            request = parse_body(body, chat, info)
            _check_rows(request, info)
            run = plan(request, tokenizer, info)
        except RequestError as e:
            param = param_of(e, request)
            raise ApiError(400, e.as_named(param), param=param) from None
        handles = []
        try:
            for generation in run.requests:  # one per choice
                handles.append(submit(scheduler, generation, run))
            reply = self._trace.follow(Reply(run, info.model_id, tokenizer))  # its usage: the access log's
            self._stream(handles, Completion(reply)) if run.stream else self._whole(handles, Completion(reply))
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}", "rate_limit_exceeded") from None
        except RingUnavailable as e:
            raise _down(str(e)) from None
        finally:  # finished ones ignore it; others (the client hung up, a choice failed) stop within a step
            for handle in handles:
                handle.cancel()

    def _adapted(self, adapter, body: dict, scheduler, tokenizer, info):
        """An API served over chat completions (ADAPTED_ROUTES): its body parsed into its typed
        request and the chat (or completions) request that becomes, its reply rendered from the
        typed one, event by event."""
        try:
            request, chat = adapter.parse(body, info, tokenizer)  # its errors name the API's fields
        except RequestError as e:
            raise ApiError(400, str(e), param=e.field) from None
        try:
            run = plan(chat, tokenizer, info)
        except RequestError as e:
            param = adapter.param(param_of(e, chat))
            raise ApiError(400, e.as_named(param), param=param) from None
        handle = None
        try:
            handle = submit(scheduler, run.requests[0], run, adapter.param)
            reply = self._trace.follow(Reply(run, info.model_id, tokenizer))
            out, choice = adapter.reply(reply, request), reply.choices[0]
            if not run.stream:
                self._take(reply, [handle])
                return self._send_json(200, out.whole())
            self._open_stream(out.content_type)
            choice.opening()
            self._chunk(out.opening())
            idle = keepalive_s() if out.content_type == "text/event-stream" else None  # NDJSON has no comments
            for event in self._trace.events(handle, idle):
                if event is None:
                    self._chunk([KEEPALIVE])
                    continue
                deltas = choice.add(event)
                if choice.error:
                    self._chunk([out.failure(self._error_body(_down(choice.error)))])
                    break
                self._chunk(out.add(deltas))
            else:
                self._chunk(out.closing())
            self.x.end()
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}", "rate_limit_exceeded") from None
        except RingUnavailable as e:
            raise _down(str(e)) from None
        finally:
            if handle is not None:
                handle.cancel()

    def _open_stream(self, content_type: str):
        self._status = 200
        self.x.start(200, [("Content-Type", content_type), ("Cache-Control", "no-cache")])  # chunked
        self._started = True

    def _chunk(self, frames):
        data = b"".join(frames)
        if data:
            self.x.write(data)

    def _take(self, reply: Reply, handles) -> None:
        """Every event of each choice, for a whole (not streamed) answer; a failed one is its error."""
        for choice, handle in zip(reply.choices, handles):
            choice.opening()
            for event in self._trace.events(handle):
                if self.x.gone.is_set():
                    raise ClientGone("the client went away")
                choice.add(event)
        if reply.error:
            raise _down(reply.error)

    def _whole(self, handles, completion: Completion):
        self._take(completion.reply, handles)
        self._send_json(200, completion.whole())

    def _stream(self, handles, completion: Completion):
        self._open_stream("text/event-stream")
        for choice, handle in zip(completion.reply.choices, handles):  # one after the other, each with its index
            self._events(completion.opening(choice))
            for event in self._trace.events(handle, keepalive_s()):
                if event is None:
                    self._chunk([KEEPALIVE])
                    continue
                deltas = choice.add(event)
                if choice.error:
                    self._events([_down(choice.error).body()])  # the `openai` package raises APIError on it
                    break
                self._events(completion.chunks(choice, deltas))
            if choice.error:
                break
        else:
            if completion.reply.plan.include_usage:
                self._events([completion.usage_chunk()])
            self._events(["[DONE]"])
        self.x.end()

    def _events(self, objs):
        self._chunk([b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n" for obj in objs])


def keepalive_s() -> float:
    """Seconds without an event (a long prefill before the first token) after which a streamed
    reply gets KEEPALIVE, so clients with idle timeouts wait on: TRINITY_KEEPALIVE_S, 15 by default."""
    return float(os.environ.get("TRINITY_KEEPALIVE_S", "15"))


def _check_json(body) -> None:
    """400 for JSON nested deeper than MAX_DEPTH or a string (or key) holding a lone surrogate
    (an escape such as \\ud800 that names no character): nothing past here meets them."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the body's JSON is nested too deep (at most {MAX_DEPTH} levels)")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            for text in (key, item):
                if isinstance(text, str) and not text.isascii():
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        raise ApiError(400, "the body holds a lone surrogate (a \\ud800-\\udfff escape "
                                            "that is not half of a pair): not text") from None
            if isinstance(item, (dict, list)) and item:
                stack.append((item, depth + 1))


def text_bound(info) -> int:
    """The most bytes of text a request may carry: BYTES_PER_TOKEN for each token of the context,
    plus TEXT_SLACK (tools, schemas, the template's own words)."""
    return info.max_context * BYTES_PER_TOKEN + TEXT_SLACK


def _check_size(body: dict, info) -> None:
    """Refuse a body whose text could not fit the context before anything tokenizes it."""
    bound, size, stack = text_bound(info), 0, [body]
    while stack:
        value = stack.pop()
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            size += len(key) if isinstance(key, str) else 0
            if isinstance(item, str):
                size += len(item) if item.isascii() else len(item.encode("utf-8"))
            elif isinstance(item, (dict, list)):
                stack.append(item)
    if size > bound:
        raise ApiError(400, f"the request holds {size} bytes of text, over this server's bound of {bound} "
                            f"({BYTES_PER_TOKEN} bytes per token of its {info.max_context}-token context, plus "
                            f"{TEXT_SLACK // 1024} KiB): it cannot fit the context", code="context_length_exceeded")


def _check_rows(request, info) -> None:
    """A request's rows (its prompts times n) fit one batch, or it is refused before tokenizing."""
    n, prompts = max(1, request.n), prompt_count(request)
    if info.max_batch and n * prompts > info.max_batch:
        what = f"{prompts} prompts × n {n} = {n * prompts} choices" if prompts > 1 else f"n {n}"
        raise ApiError(400, f"n: {what}: over this server's batch of {info.max_batch} sequences (--max-batch)",
                       param="n")


class _App:
    """The ASGI application uvicorn serves: one _Handler per request."""

    def __init__(self, front: "HttpFrontEnd", workers: Workers):
        self.front, self.workers = front, workers

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        loop = asyncio.get_running_loop()
        x = Exchange(scope, loop, send, Headers(scope=scope))
        handler = _Handler(self.front, x)
        try:
            early = handler.precheck()
            if early is None and handler.command == "POST":
                x.body, early = await self._read_body(receive, handler)
                handler._body_read = x.body is not None
            if early is not None:
                return await self._reply(send, handler, *early)
            watch = asyncio.ensure_future(_watch(receive, x))
            try:
                await self.workers.run(handler.run)
            finally:
                watch.cancel()
        except Exception:  # a bug in the transport itself: logged, answered without its text
            log.exception("internal error serving %s %s", scope.get("method"), scope.get("path", "")[:200])
            if not x.started:
                await self._reply(send, handler, 500, json.dumps(ApiError(500, "internal error", "server_error")
                                                                 .body()).encode(), "application/json", {})

    async def _read_body(self, receive, handler):
        """(body, None), or (None, the refusal) for a body over MAX_BODY, too slow, or cut off."""
        parts, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), BODY_TIMEOUT_S)
            except asyncio.TimeoutError:
                return None, handler.refusal(408, f"the body did not arrive (nothing for {BODY_TIMEOUT_S:.0f} s)")
            if message["type"] == "http.disconnect":
                return None, handler.refusal(400, "the client went away before its body arrived")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY:
                return None, handler.refusal(413, f"the body is over {MAX_BODY} bytes")
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts), None

    @staticmethod
    async def _reply(send, handler, status: int, data: bytes, content_type: str, headers: dict):
        head = [(b"content-type", content_type.encode()), (b"content-length", str(len(data)).encode())]
        head += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        if not handler._body_read:
            head.append((b"connection", b"close"))  # an unread body is not read past: the connection ends
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": data, "more_body": False})


async def _watch(receive, x: Exchange) -> None:
    """Sets x.gone when the client disconnects (while its request runs on a worker)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            x.gone.set()
            return


LOADING = ("loading", "the model is loading")


class Health:
    """What `GET /health` answers (on the HTTP API's port and on --metrics'): 200 while
    serving, 503 with the reason otherwise. Its states follow the calls that drive
    gRPC's health service (grpc_service.py) alike: loading until attach(), serving,
    down once the ring breaks, stopping at shutdown; and, in the launcher's router
    (launch/router/), recovering while the ring restarts: requests are still taken
    then (they wait for it), so `refusal` is None while `reason` is not."""

    def __init__(self):
        self.state: Tuple[str, Optional[str]] = LOADING  # (status, reason); one attribute: read whole

    def serving(self) -> None:
        self.state = ("serving", None)

    def down(self, reason: str) -> None:
        self.state = ("down", f"the pipeline is down: {reason}")

    def recovering(self, reason: str) -> None:
        self.state = ("recovering", f"the pipeline is down: {reason}; requests wait for it to restart")

    def stopping(self) -> None:
        self.state = ("stopping", "the server is shutting down")

    @property
    def reason(self) -> Optional[str]:
        """Why requests are refused now; None while serving."""
        return self.state[1]

    @property
    def refusal(self) -> Optional[str]:
        """Why requests are refused now; None while serving or recovering."""
        return None if self.state[0] == "recovering" else self.state[1]

    def answer(self) -> Tuple[int, dict]:
        """HTTP status and JSON body."""
        status, reason = self.state
        return (200, {"status": status}) if reason is None else (503, {"status": status, "reason": reason})



class HttpFrontEnd:
    """Listens from construction; answers 503 until attach(), and again after set_not_serving().
    With api=False (--metrics), only /health and /metrics."""

    def __init__(self, options: ServeOptions, requests: Optional[RequestLog] = None, api: bool = True):
        self.auth_token = options.auth_token
        self.sealer = Sealer(options.auth_token)  # reasoning held by clients reads back on servers sharing it
        self.adapters = {**responses_api.adapters(self.sealer), **anthropic_api.ADAPTERS, **ollama_api.ADAPTERS}
        self.created = int(time.time())
        self.requests, self.api, self.health, self._state = requests or RequestLog(), api, Health(), None
        flag, address = ("--http", options.http_address) if api else ("--metrics", options.metrics_address)
        bound = split_address(address, flag)[0].lower()
        self.allowed = {*LOCAL_NAMES, bound, *(h.strip().lower() for h in options.allowed_hosts or () if h.strip())}
        workers = Workers((options.max_batch or MAX_BATCH) + options.max_queue + 32)
        self.server = serve_http(address, flag, _App(self, workers), options)
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
        self.server.stop()

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

    def check_origin(self, headers) -> None:
        """Without a token, only local names reach the server (DNS rebinding), and only pages of
        local origins (or its own) may call it from a browser (cross-site requests): a Host that
        is a name other than localhost, the bound address or one of --allowed-hosts is 403, as is
        an Origin that is none of those nor the server itself. Host may be any IP address (no
        rebinding gives one); --allowed-hosts '*' turns both checks off. GET /health is open to all."""
        if self.auth_token is not None or "*" in self.allowed:
            return
        host = headers.get("Host") or ""
        name = _host_name(host)
        if host and name not in self.allowed and not _is_ip(name):  # no Host (HTTP/1.0): no browser sent it
            raise ApiError(403, f"Host {json.dumps(host[:100])} is not allowed: without --auth-token this server "
                                f"answers only local names and IP addresses (add names with --allowed-hosts or "
                                f"{ALLOWED_HOSTS_ENV})", "permission_error")
        origin = headers.get("Origin")
        if origin is None:
            return
        scheme, _, rest = origin.partition("://")
        if rest and (rest.lower() == host.lower() or _host_name(rest) in self.allowed):
            return  # a page of this server, or of a local or allowed name
        raise ApiError(403, f"Origin {json.dumps(origin[:100])} is not allowed: without --auth-token only pages of "
                            f"this server, of local names or of --allowed-hosts ({ALLOWED_HOSTS_ENV}) may call it",
                       "permission_error")

    def attached(self):
        reason = self.health.refusal
        if reason is not None or self._state is None:
            raise ApiError(503, reason or "the model is loading", "service_unavailable")
        return self._state


def _host_name(host: str) -> str:
    """A Host header's (or an origin's host:port) name, lowercased, without port or brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def start_http_server(options: ServeOptions, requests: Optional[RequestLog] = None, api: bool = True) -> HttpFrontEnd:
    """Listen on options.http_address (api=False: options.metrics_address) now; 503 until attach()."""
    return HttpFrontEnd(options, requests, api)
