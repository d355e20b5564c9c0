"""The HTTP front end against hostile clients, over real sockets to an in-process server:
request smuggling, bodies that are not JSON or not text, foreign Hosts and
Origins, sizes checked before tokenizing, internal errors answered without their text, and
the OpenAPI document."""

import json
import logging
import socket
import tracemalloc
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from mlx_lm.utils import load_tokenizer

from distributed.runtime.scheduler import Scheduler
from distributed.serving import http_api, http_server, openapi
from distributed.serving.http_api import ADAPTED_ROUTES, MAX_BODY, MAX_DEPTH, ROUTES, start_http_server, text_bound
from distributed.serving.options import ServeOptions
from distributed.serving.chat_format import ModelInfo
from distributed.shard.config import read_config
from reference import PROMPT
from stages import in_process_pipeline

MAX_CONTEXT, CAP, BATCH = 1024, 1000, 4
TRACEBACK_WORDS = ("Traceback", "Error:", "Exception", "File \"")


def start(**options):
    return start_http_server(ServeOptions(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", **options))


@pytest.fixture(scope="module")
def served(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (4, 4))
    tokenizer = load_tokenizer(hf_checkpoint, eos_token_ids=read_config(hf_checkpoint)["eos_token_id"])
    scheduler = Scheduler(pipeline, tokenizer, max_queue=2).start()
    info = ModelInfo("tiny", 259, MAX_CONTEXT, CAP, max_batch=BATCH)
    fronts = SimpleNamespace(open=start(), allowed=start(allowed_hosts=["rebind.attacker.example"]),
                             secured=start(auth_token="sekret"))
    for front in vars(fronts).values():
        front.attach(scheduler, tokenizer, info)
    yield SimpleNamespace(front=fronts.open, fronts=fronts, info=info, tokenizer=tokenizer)
    for front in vars(fronts).values():
        front.stop()
    scheduler.close()


def exchange(port: int, data: bytes, timeout: float = 30) -> bytes:
    """Everything the server sends back to `data` until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def request(port: int, method: str, path: str, body=None, headers=None):
    """(status, headers, parsed body or text) of one request over urllib."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    if data is not None:
        headers = {"Content-Type": "application/json", **(headers or {})}
    r = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(r, timeout=60) as response:
            status, head, raw = response.status, response.headers, response.read()
    except urllib.error.HTTPError as e:
        status, head, raw = e.code, e.headers, e.read()
    try:
        return status, head, json.loads(raw)
    except ValueError:
        return status, head, raw.decode(errors="replace")


def no_traceback(reply) -> None:
    text = reply if isinstance(reply, str) else json.dumps(reply)
    assert not any(word in text for word in TRACEBACK_WORDS), text


def message(reply) -> str:
    return reply["error"]["message"] if isinstance(reply.get("error"), dict) else reply["error"]


def completion(port: int, **fields):
    return request(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, **fields})


# ---- HTTP framing: one request is one request


def test_a_get_body_is_never_a_second_request(served):
    hidden = b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    out = exchange(served.front.port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                                      b"Content-Length: %d\r\n\r\n%s" % (len(hidden), hidden))
    assert out.count(b"HTTP/1.1 ") == 1 and out.startswith(b"HTTP/1.1 200") and b'"object": "list"' in out
    # kept alive: the body is read past, and the next request is the next one sent
    out = exchange(served.front.port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n%s"
                                      b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
                   % (len(hidden), hidden))
    assert out.count(b"HTTP/1.1 ") == 2 and b'"status": "serving"' in out and b"requests" not in out


@pytest.mark.parametrize("framing", [
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
    b"Content-Length: 5\r\nContent-Length: 50\r\n",
    b"Content-Length: 5\r\nContent-Length: 5\r\n",
    "Content-Length: \u00b2\r\n".encode("utf-8"),
    b"Content-Length: -5\r\n",
])
def test_ambiguous_framing_is_400(served, framing):
    body = b'{"prompt": "hi", "max_tokens": 1}'
    out = exchange(served.front.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                      b"Content-Type: application/json\r\n" + framing + b"\r\n0\r\n\r\n" + body)
    assert out.startswith(b"HTTP/1.1 400") and out.count(b"HTTP/1.1 ") == 1, out[:300]
    no_traceback(out.decode(errors="replace"))


def test_a_chunked_body_is_read(served):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    out = exchange(served.front.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                                      b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                                      b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    assert out.startswith(b"HTTP/1.1 200") and b'"completion_tokens": 2' in out


def test_bodies_over_the_limit_are_413_before_they_are_read(served):
    out = exchange(served.front.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n{" % (MAX_BODY + 1))
    assert out.startswith(b"HTTP/1.1 413") and b"connection: close" in out.lower()
    chunk = b"x" * 2**20  # chunked: refused once the cap is passed
    with socket.create_connection(("127.0.0.1", served.front.port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(MAX_BODY // len(chunk) + 2):
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            pass  # the server answered and closed
        out = s.recv(4096)
    assert out.startswith(b"HTTP/1.1 413")


# ---- bodies


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_body_not_sent_as_json_is_415(served, content_type):
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    head = b"" if content_type is None else f"Content-Type: {content_type}\r\n".encode()
    out = exchange(served.front.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                   + head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert out.startswith(b"HTTP/1.1 415"), out[:200]
    reply = json.loads(out.split(b"\r\n\r\n", 1)[1])
    assert "application/json" in message(reply) and "\n" not in message(reply)


def test_json_with_a_charset_is_taken(served):
    status, _, reply = request(
        served.front.port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0},
        {"Content-Type": "application/json; charset=utf-8"})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/api/chat"])
def test_deep_json_is_400_without_a_traceback(served, route):
    for depth in (MAX_DEPTH + 1, 100_000):
        status, _, reply = request(served.front.port, "POST", route,
                                   b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}")
        assert status == 400 and "nested too deep" in message(reply), reply
        no_traceback(reply)


@pytest.mark.parametrize("raw, words", [
    (b'{"prompt": "\\ud800", "max_tokens": 1}', "lone surrogate"),
    (b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "lone surrogate"),
    (b'{"\\ud800": 1}', "lone surrogate"),
    (b'{"prompt": "\xff\xfe", "max_tokens": 1}', "UTF-8"),
    (b'{"prompt": "hi"', "not valid JSON"),
    (b"[1, 2]", "JSON object"),
])
def test_bodies_that_are_not_text_are_400(served, raw, words):
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/messages/count_tokens", "/api/generate"):
        status, _, reply = request(served.front.port, "POST", route, raw)
        assert status == 400 and words in message(reply), (route, reply)
        no_traceback(reply)


def test_tools_that_are_not_objects_are_400(served):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [1]}
    for route, extra in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
        status, _, reply = request(served.front.port, "POST", route, {**body, **extra})
        assert status == 400 and "tools[0]" in message(reply), reply
        no_traceback(reply)


HI = [{"role": "user", "content": "hi"}]
NESTED = [  # (route, body, where the 400 says the fault is, what its message says)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "a string or a list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]},
     "messages[0].content[0].text", "a string"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]},
     "messages[0].tool_calls[0].function.name", "a string"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]},
     "tools[0].function.strict", "a boolean"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
     "response_format.json_schema.schema", "an object"),
    ("/v1/responses", {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": None}]}]},
     "input[0].content[0].text", "a string"),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": 1}}, "reasoning.effort", "a string"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}, "x": 1}}},
     "text.format.x", "not supported"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]},
     "messages[0].content[0].text", "a string"),
    ("/v1/messages", {"messages": HI, "thinking": {"type": "enabled", "budget_tokens": "2048"}},
     "thinking.budget_tokens", "an integer"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages[0].name", "not supported"),
    ("/api/chat", {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                               "arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "an object"),
    ("/api/chat", {"messages": HI, "think": 1}, "think", "a boolean or a string"),
]


@pytest.mark.parametrize("route, body, where, says", NESTED, ids=[f"{r}:{w}" for r, _, w, _ in NESTED])
def test_a_nested_part_of_the_wrong_type_is_400_naming_where(served, route, body, where, says):
    """Each API's body is typed down to its parts (parts.py and each API's own): the 400 names
    the place, however deep, in the API's own terms, and the server goes on serving."""
    extra = {"max_tokens": 4} if route == "/v1/messages" else {}
    status, _, reply = request(served.front.port, "POST", route, {"model": "tiny", **body, **extra})
    text = message(reply)
    assert status == 400 and text.startswith(f"{where}: ") and says in text, (route, reply)
    if isinstance(reply["error"], dict) and "param" in reply["error"]:
        assert reply["error"]["param"] == where
    no_traceback(reply)
    assert completion(served.front.port)[0] == 200


# ---- browser origins (no --auth-token)


@pytest.mark.parametrize("method, path, body", [("GET", "/v1/status", None), ("GET", "/v1/models", None),
                                                ("GET", "/", None), ("POST", "/v1/completions", {"prompt": "hi"})])
def test_a_foreign_host_is_403_unless_allowed(served, method, path, body):
    evil = {"Host": "rebind.attacker.example"}
    status, _, reply = request(served.front.port, method, path, body, evil)
    assert status == 403 and "Host" in message(reply) and "--allowed-hosts" in message(reply)
    assert request(served.fronts.allowed.port, method, path, body, evil)[0] in (200, 400)
    token = {**evil, "Authorization": "Bearer sekret"}  # a token guards the server instead
    assert request(served.fronts.secured.port, method, path, body, token)[0] in (200, 400)
    for local in ("localhost", "127.0.0.1", f"127.0.0.1:{served.front.port}", f"[::1]:{served.front.port}",
                  f"192.168.1.7:{served.front.port}"):  # local names and addresses (no rebinding gives an address)
        assert request(served.front.port, method, path, body, {"Host": local})[0] in (200, 400), local


def test_a_foreign_origin_is_403(served):
    port = served.front.port
    for origin in ("http://evil.example", "null", f"http://rebind.attacker.example:{port}", "http://192.168.1.7"):
        status, _, reply = request(
            port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, {"Origin": origin})
        assert status == 403 and "Origin" in message(reply), origin
    for origin in (f"http://127.0.0.1:{port}", "http://localhost:3000", "https://[::1]"):  # this server, local pages
        status, _, _ = request(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, {"Origin": origin})
        assert status == 200, origin
    status, _, _ = request(served.fronts.allowed.port, "GET", "/v1/models", None,
                           {"Origin": "https://rebind.attacker.example"})
    assert status == 200


# ---- limits before expensive work


def test_a_huge_prompt_is_refused_before_tokenizing(served):
    bound = text_bound(served.info)
    prompt = "hello world " * ((MAX_BODY - 1024) // 12)
    tracemalloc.start()
    try:
        status, _, reply = request(served.front.port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 400 and f"bound of {bound}" in message(reply) and "bytes" in message(reply)
    assert peak < 8 * MAX_BODY, f"{peak / 2**20:.0f} MiB"  # the body, its text and its JSON; no tokens
    just_over = "a" * (bound + 1)
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": just_over}]}),
                        ("/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": just_over}]}),
                        ("/v1/messages", {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": just_over}]}),
                        ("/v1/responses", {"input": just_over}),
                        ("/api/generate", {"model": "tiny", "prompt": just_over}),
                        ("/v1/completions", {"prompt": [just_over[:bound // 2], just_over[:bound // 2 + 2]]})):
        status, _, reply = request(served.front.port, "POST", route, body)
        assert status == 400 and f"bound of {bound}" in message(reply), (route, reply)
    status, _, reply = request(served.front.port, "POST", "/v1/messages/count_tokens",
                               {"model": "tiny", "messages": [{"role": "user", "content": "a" * (bound - 100)}]})
    assert status == 200 and reply["input_tokens"] > 0  # under the bound: counted


def test_rows_are_bounded_by_the_batch(served):
    status, _, reply = completion(served.front.port, n=BATCH + 1)
    assert status == 400 and reply["error"]["param"] == "n" and f"{BATCH}" in message(reply)
    status, _, reply = completion(served.front.port, prompt=["a", "b", "c"], n=2)
    assert status == 400 and "6" in message(reply)
    status, _, reply = completion(served.front.port, prompt=["a", "b"], n=2)
    assert status == 200 and len(reply["choices"]) == 4


# ---- errors


def test_an_internal_error_is_500_without_its_text(served, monkeypatch, caplog):
    def broken(*args):
        raise AttributeError("'int' object has no attribute 'get' (secret detail)")

    monkeypatch.setitem(http_api.ROUTES, ("GET", "/api/version"), broken)
    with caplog.at_level(logging.ERROR, logger="distributed.serving.http"):
        status, _, reply = request(served.front.port, "GET", "/api/version")
    assert status == 500 and reply == {"error": "internal error"}
    assert "secret detail" in caplog.text and "Traceback" in caplog.text  # logged, with its traceback
    status, _, reply = request(served.front.port, "GET", "/v1/models")
    assert status == 200


def test_openapi_document(served):
    status, head, doc = request(served.front.port, "GET", "/openapi.json")
    assert status == 200 and head["Content-Type"] == "application/json" and doc["openapi"].startswith("3.")
    routes = {(m.upper(), p) for p, methods in doc["paths"].items() for m in methods}
    assert ADAPTED_ROUTES | set(ROUTES) <= routes
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
            ("GET", "/health"), ("GET", "/v1/status"), ("GET", "/metrics")} <= routes
    for (method, path) in routes:
        if method == "POST":
            assert "schema" in doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    assert doc == openapi.document()


# ---- slow and endless headers hold no thread and no memory


def test_slow_or_endless_headers_end_the_connection(served, monkeypatch):
    monkeypatch.setattr(http_server, "HEADER_TIMEOUT_S", 0.5)
    with socket.create_connection(("127.0.0.1", served.front.port), timeout=30) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # and nothing more
        assert s.recv(4096) == b""  # closed
    with socket.create_connection(("127.0.0.1", served.front.port), timeout=30) as s:  # after a first request
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = b""
        while not first.endswith(b"}"):
            first += s.recv(4096)
        assert first.startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 1")
        assert s.recv(4096) == b""
    with socket.create_connection(("127.0.0.1", served.front.port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        reply = b""
        try:
            for _ in range(http_server.MAX_HEADER_BYTES // 1000 + 300):
                s.sendall(b"X-Pad: " + b"a" * 1000 + b"\r\n")
        except OSError:
            pass  # closed while sending
        try:
            reply = s.recv(4096)
        except OSError:
            pass
        assert reply == b"" or reply.startswith(b"HTTP/1.1 431")
    assert request(served.front.port, "GET", "/v1/models")[0] == 200
