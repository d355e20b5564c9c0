"""One request path for every API (openai_api.Adapter): chat completions, the Responses, Messages
and Ollama APIs over an in-process 2-stage pipeline. A streamed request whose client hangs up
is cancelled and loses nothing else; a full queue is a 429 in the API's own error shape."""

import http.client
import json
import threading
from types import SimpleNamespace

import openai
import pytest
from mlx_lm.utils import load_tokenizer

from conftest import wait_until
from distributed.runtime.request import FinishEvent
from distributed.runtime.scheduler import Scheduler
from distributed.serving.http_api import start_http_server
from distributed.serving.options import ServeOptions
from distributed.serving.chat_format import ModelInfo
from distributed.shard.config import read_config
from reference import PROMPT
from stages import in_process_pipeline

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (4, 4))
    tokenizer = load_tokenizer(hf_checkpoint, eos_token_ids=read_config(hf_checkpoint)["eos_token_id"])
    # No end of sequence: a stream then ends at its max tokens or when cancelled, never by
    # itself first (greedy, this checkpoint answers "hi" with 110 tokens and EOS, which a
    # loaded machine could finish before it saw the client hang up).
    tokenizer.eos_token_ids = set()
    scheduler = Scheduler(pipeline, tokenizer, max_queue=2).start()
    front = start_http_server(ServeOptions(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0"))
    front.attach(scheduler, tokenizer, ModelInfo("tiny", 259, 1024, 1000))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{front.port}/v1", api_key="none", max_retries=0, timeout=60)
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    yield SimpleNamespace(front=front, scheduler=scheduler, client=client, greedy=greedy)
    front.stop()
    scheduler.close()




API_STREAMS = {
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 900, "stream": True}),
    "responses": ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 900, "stream": True}),
    "messages": ("/v1/messages", {"model": "tiny", "messages": HI, "max_tokens": 900, "stream": True}),
    "ollama": ("/api/chat", {"model": "tiny", "messages": HI, "options": {"num_predict": 900}}),
}


def post(port: int, route: str, body: dict):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


@pytest.mark.parametrize("api", API_STREAMS)
def test_every_api_cancels_a_stream_whose_client_hangs_up(served, submitted, api):
    route, body = API_STREAMS[api]
    conn, response = post(served.front.port, route, body)
    assert response.status == 200
    response.read1(64)  # the stream has begun
    conn.close()
    finish = [e for e in submitted[0].events() if isinstance(e, FinishEvent)][0]
    assert finish.finish_reason == "cancelled" and finish.completion_tokens < 900
    out = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.choices[0].text == served.greedy  # the ring lost nothing


def error_message(api: str, body: dict) -> str:
    """The message of an error body in each API's shape."""
    if api == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
        return body["error"]["message"]
    if api == "ollama":
        return body["error"]
    return body["error"]["message"]


@pytest.mark.parametrize("api", API_STREAMS)
def test_every_api_answers_a_full_queue_with_429(served, api):
    started, release = threading.Event(), threading.Event()
    blocker = threading.Thread(target=served.scheduler.call, args=(lambda _: (started.set(), release.wait()),))
    blocker.start()
    started.wait(30)
    bound = served.scheduler.capacity
    waiting = [threading.Thread(target=served.client.completions.create,
                                kwargs=dict(model="tiny", prompt=PROMPT, max_tokens=2)) for _ in range(bound)]
    try:
        for t in waiting:
            t.start()
        wait_until(lambda: served.scheduler.waiting == bound)
        route, body = API_STREAMS[api]
        conn, response = post(served.front.port, route, body)
        assert response.status == 429
        assert f"{bound} requests are already running or waiting" in error_message(api, json.loads(response.read()))
        conn.close()
    finally:
        release.set()
        blocker.join()
        for t in waiting:
            t.join()
