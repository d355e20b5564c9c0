"""The OpenAI-compatible HTTP API, with the `openai` package as the client, over an
in-process 2-stage pipeline; greedy output is checked against `run_trinity.py --json`."""

import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from types import SimpleNamespace

import openai
import pytest
from mlx_lm.utils import load_tokenizer

from conftest import ROOT, RUN, free_port_range, run_json, wait_until
from distributed.runtime.request import FinishEvent
from distributed.runtime.scheduler import RequestHandle, RingUnavailable, Scheduler
from distributed.serving.http_api import start_http_server
from distributed.serving.options import ServeOptions
from distributed.serving.chat_format import ModelInfo
from distributed.shard.config import read_config
from reference import PROMPT
from stages import in_process_pipeline

MAX_CONTEXT, CAP = 1024, 1000
HI = [{"role": "user", "content": "hi"}]


def start(**options):
    return start_http_server(ServeOptions(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", **options))


def client(front, key="none", scheme="http", **kwargs):
    port = front if isinstance(front, int) else front.port
    return openai.OpenAI(base_url=f"{scheme}://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60, **kwargs)


@pytest.fixture(scope="module")
def served(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (4, 4))
    tokenizer = load_tokenizer(hf_checkpoint, eos_token_ids=read_config(hf_checkpoint)["eos_token_id"])
    scheduler = Scheduler(pipeline, tokenizer, max_queue=2).start()
    info = ModelInfo("tiny", 259, MAX_CONTEXT, CAP)
    open_front, secured = start(), start(auth_token="sekret")
    for front in (open_front, secured):
        front.attach(scheduler, tokenizer, info)
    yield SimpleNamespace(front=open_front, secured=secured, scheduler=scheduler, tokenizer=tokenizer,
                          info=info, client=client(open_front))
    for front in (open_front, secured):
        front.stop()
    scheduler.close()


@pytest.fixture(scope="module")
def cli(hf_checkpoint):
    """run_trinity.py --json for a prompt (args), computed once each."""
    cache = {}

    def get(*args):
        if args not in cache:
            cache[args] = run_json(["--model", str(hf_checkpoint), "--max-tokens", "24", *args])
        return cache[args]

    return get


def ids_reference(cli):
    return cli("--prompt-ids", ",".join(map(str, PROMPT)))


def close(a, b, tol=1e-5):
    return len(a) == len(b) and all(abs(x - y) < tol for x, y in zip(a, b))


def test_models(served):
    assert [m.id for m in served.client.models.list().data] == ["tiny"]


@pytest.mark.parametrize("prompt", ["ids", "text"])
def test_completion_equals_cli(served, cli, prompt):
    if prompt == "ids":
        ref, kwargs = ids_reference(cli), dict(prompt=PROMPT)
    else:
        ref, kwargs = cli("--prompt", "hello there", "--no-chat-template"), dict(prompt="hello there")
    out = served.client.completions.create(model="tiny", max_tokens=24, temperature=0, logprobs=1, **kwargs)
    choice = out.choices[0]
    assert choice.text == ref["text"] and choice.finish_reason == ref["finish_reason"]
    assert close(choice.logprobs.token_logprobs, ref["logprobs"])
    assert out.usage.prompt_tokens == len(ref["prompt_token_ids"])
    assert out.usage.completion_tokens == len(ref["token_ids"])
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.object == "text_completion" and out.model == "tiny"

    chunks = list(served.client.completions.create(model="tiny", max_tokens=24, temperature=0, logprobs=1,
                                                   stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == ref["text"]
    assert close([lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs],
                 ref["logprobs"])
    assert [c.choices[0].finish_reason for c in chunks][-1] == ref["finish_reason"]
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_equals_cli(served, cli):
    ref = cli("--prompt", "hi")
    out = served.client.chat.completions.create(model="tiny", messages=HI, max_completion_tokens=24,
                                                temperature=0, logprobs=True)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref["text"]
    assert choice.finish_reason == ref["finish_reason"] and out.object == "chat.completion"
    assert close([c.logprob for c in choice.logprobs.content], ref["logprobs"])
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ref["prompt_token_ids"]), len(ref["token_ids"]))

    chunks = list(served.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_tokens=24,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref["finish_reason"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref["token_ids"])


def test_stop_strings_and_sampling_extensions(served, cli):
    text = ids_reference(cli)["text"]
    stop = text[10:12]
    out = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\0"])
    assert out.choices[0].text == text[: text.index(stop)] and out.choices[0].finish_reason == "stop"
    out = served.client.completions.create(model="tiny", prompt=PROMPT, temperature=0)
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"  # OpenAI's default
    for extra in ({"top_k": 1}, {"min_p": 1.0}):  # at temperature 1, both leave only the greedy token
        out = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0, extra_body=extra)
        assert out.choices[0].text == text

    def sample(seed):
        return served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, seed=seed).choices[0].text

    assert sample(3) == sample(3) != sample(4)


BAD = [
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [5, 259]}, "prompt"),
    ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"prompt": [["a"]]}, "prompt"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": [5] * MAX_CONTEXT}, "max_tokens"),  # no room left in the context (more max_tokens: clamped)
    ("completions", {"max_tokens": "many"}, "max_tokens"),
    ("completions", {"temperature": -0.5}, "temperature"),
    ("completions", {"top_p": 0}, "top_p"),
    ("completions", {"top_p": 1.5}, "top_p"),
    ("completions", {"extra_body": {"min_p": 1.5}}, "min_p"),
    ("completions", {"extra_body": {"top_k": -1}}, "top_k"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"seed": -1}, "seed"),  # it used to end the ring (mx.random.key raised in the scheduler)
    ("chat", {"seed": 2**64}, "seed"),
    ("completions", {"stop": ""}, "stop"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"temperature": -1}, "temperature"),
    ("chat", {"top_p": 2}, "top_p"),
    ("chat", {"n": 129}, "n"),
]


@pytest.mark.parametrize("endpoint, fields, param", BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(BAD)])
def test_bad_input_is_400_naming_the_field(served, endpoint, fields, param):
    if endpoint == "chat":
        create, args = served.client.chat.completions.create, dict(model="tiny", messages=HI, max_tokens=4)
    else:
        create, args = served.client.completions.create, dict(model="tiny", prompt=PROMPT, max_tokens=4)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            create(**{**args, **fields}, stream=stream)
        assert e.value.status_code == 400 and e.value.param == param
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["code"] is None
        assert param in e.value.body["message"]
    assert served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_max_tokens_beyond_the_cap_or_the_context_is_clamped(served):
    """A limit is clamped, as vLLM and llama.cpp clamp it: the finish reason tells where the clamp ended the reply."""
    long = [5] * (MAX_CONTEXT - 3)
    for max_tokens in (CAP + 1, MAX_CONTEXT):  # over the cap; under it but over the context's room
        out = served.client.completions.create(model="tiny", prompt=long, max_tokens=max_tokens, temperature=0)
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3, out
    chat = served.client.chat.completions.create(model="tiny", messages=HI, max_tokens=10**6, temperature=0)
    assert chat.usage.completion_tokens <= CAP


def raw(front, path, body=None, headers=None):
    """(status, parsed body) of a plain urllib request."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})} if data is not None else headers or {}
    request = urllib.request.Request(f"http://127.0.0.1:{front.port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_malformed_bodies_and_unknown_paths(served):
    status, body = raw(served.front, "/v1/completions", b"{not json", {"Content-Type": "application/json"})
    assert status == 400 and "JSON" in body["error"]["message"]
    assert raw(served.front, "/v1/completions", [1, 2])[0] == 400
    assert raw(served.front, "/v1/nothing")[0] == 404
    status, body = raw(served.front, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_auth(served):
    ok = client(served.secured, "sekret")
    assert ok.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0).usage.completion_tokens == 2
    assert [m.id for m in ok.models.list().data] == ["tiny"]
    for call in (lambda c: c.models.list(), lambda c: c.chat.completions.create(model="tiny", messages=HI, max_tokens=2)):
        with pytest.raises(openai.AuthenticationError) as e:
            call(client(served.secured, "wrong"))
        assert e.value.status_code == 401
    assert raw(served.secured, "/v1/models")[0] == 401  # no Authorization header at all
    assert raw(served.secured, "/v1/completions", {"prompt": PROMPT})[0] == 401
    assert raw(served.front, "/v1/models")[0] == 200  # no token set: none needed


def test_503_until_attached_and_after_the_ring_breaks(served):
    front = start()
    try:
        c = client(front)
        for call in (lambda: c.models.list(), lambda: c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)):
            with pytest.raises(openai.InternalServerError) as e:
                call()
            assert e.value.status_code == 503 and "loading" in e.value.message
        front.attach(served.scheduler, served.tokenizer, served.info)
        assert c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0).usage.completion_tokens == 2
        front.set_not_serving("RuntimeError: rank 1 went away")
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="tiny", messages=HI, max_tokens=2, stream=True)
        assert e.value.status_code == 503 and "rank 1 went away" in e.value.message
    finally:
        front.stop()




def test_queue_full_is_429(served, cli):
    """The scheduler thread is held busy; requests fill the batch's room and the queue (max_batch 16
    + max_queue 2, none admitted yet), the next gets 429 naming both."""
    started, release = threading.Event(), threading.Event()
    blocker = threading.Thread(target=served.scheduler.call, args=(lambda _: (started.set(), release.wait()),))
    blocker.start()
    started.wait(30)
    results = []

    def request():
        results.append(served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0))

    bound = served.scheduler.capacity
    waiting = [threading.Thread(target=request) for _ in range(bound)]
    try:
        for t in waiting:
            t.start()
        wait_until(lambda: served.scheduler.waiting == bound)
        with pytest.raises(openai.RateLimitError) as e:
            served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, stream=True)
        assert e.value.status_code == 429
        assert f"{bound} requests are already running or waiting (--max-batch 16 + --max-queue 2)" in e.value.message
    finally:
        release.set()
        blocker.join()
        for t in waiting:
            t.join()
    assert [r.choices[0].text for r in results] == [ids_reference(cli)["text"]] * bound


def finish_of(handle) -> FinishEvent:
    return [e for e in handle.events() if isinstance(e, FinishEvent)][0]


def test_client_disconnect_mid_stream_cancels(served, cli, submitted):
    stream = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=900, temperature=0, stream=True)
    for _, _ in zip(stream, range(3)):
        pass
    stream.close()
    finish = finish_of(submitted[0])
    assert finish.finish_reason == "cancelled" and finish.completion_tokens < 900
    out = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.choices[0].text == ids_reference(cli)["text"]


def test_client_disconnect_while_waiting_for_a_whole_reply_cancels(served, cli, submitted):
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 900, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", served.front.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: submitted)
    finish = finish_of(submitted[0])
    assert finish.finish_reason == "cancelled" and finish.completion_tokens < 900
    out = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.choices[0].text == ids_reference(cli)["text"]


class BrokenScheduler:
    """A scheduler whose pipeline is down: at submit, or after the request was taken."""

    def __init__(self, at_submit: bool):
        self.at_submit = at_submit

    def arriving(self):
        return contextlib.nullcontext()

    def submit(self, request):
        if self.at_submit:
            raise RingUnavailable("RuntimeError: link to rank 1 lost")
        handle = RequestHandle(request)
        handle.emit(FinishEvent("error", len(request.prompt_ids), 0, error="RuntimeError: link to rank 1 lost"))
        return handle


def test_pipeline_failure_is_503(served):
    front = start()
    try:
        c = client(front)
        front.attach(BrokenScheduler(at_submit=False), served.tokenizer, served.info)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        assert e.value.status_code == 503 and "link to rank 1 lost" in e.value.message
        with pytest.raises(openai.APIError, match="link to rank 1 lost"):  # headers were sent: an error event
            list(c.chat.completions.create(model="tiny", messages=HI, max_tokens=4, stream=True))
        front.attach(BrokenScheduler(at_submit=True), served.tokenizer, served.info)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError, match="link to rank 1 lost"):
                c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, stream=stream)
    finally:
        front.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls(served, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    front = start(tls_cert=str(cert), tls_key=str(key))
    try:
        front.attach(served.scheduler, served.tokenizer, served.info)
        verify = ssl.create_default_context(cafile=str(cert))
        c = client(front, scheme="https", http_client=openai.DefaultHttpxClient(verify=verify))
        out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == out.choices[0].text
        with pytest.raises(openai.APIConnectionError):
            client(front).models.list()  # plain HTTP to the TLS port
    finally:
        front.stop()


def test_run_trinity_serve_process(hf_checkpoint, cli):
    """The real `run_trinity.py --stages 2 --serve … --http …`, stopped by SIGTERM."""
    base = free_port_range(2)
    proc = subprocess.Popen(
        [sys.executable, RUN, "--model", str(hf_checkpoint), "--stages", "2", "--serve", f"127.0.0.1:{base}",
         "--http", f"127.0.0.1:{base + 1}", "--auth-token", "sekret"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    c = client(base + 1, "sekret")

    def up():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            return c.models.list().data[0].id == str(hf_checkpoint)
        except (openai.APIConnectionError, openai.InternalServerError):  # not listening yet / loading
            return False

    try:
        wait_until(up, timeout=120, interval=0.2)
        out = c.completions.create(model=str(hf_checkpoint), prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1)
        ref = ids_reference(cli)
        assert out.choices[0].text == ref["text"] and close(out.choices[0].logprobs.token_logprobs, ref["logprobs"])
        chunks = c.chat.completions.create(model=str(hf_checkpoint), messages=HI, max_tokens=24, temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == cli("--prompt", "hi")["text"]
        with pytest.raises(openai.AuthenticationError):
            client(base + 1, "wrong").models.list()
    finally:
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"127.0.0.1:{base + 1} (HTTP)" in stdout
