"""GET /v1/status, the status page (/) and the chat page (/chat) on a real 2-rank ring (the
embedded default model, no --model given, split 2,4, speculating, with --auth-token and --metrics), in a real
headless chromium (tests/browser.py). One ring and one browser for the module; each test
signs in itself (the token stays in the tab's sessionStorage), so none needs another first.
`TRINITY_SCREENSHOTS=docs` writes the screenshots of docs/serving.md of both pages."""

import json
import re
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from selenium.webdriver.common.keys import Keys

from browser import Browser, chat, counter, page_state, ranks
from conftest import wait_until
from distributed.serving.proto import generation_pb2 as pb
from grpc_server import SERVER_ARGS, TOKEN, Server

LONG = 1000  # max tokens of the reply the stop button cuts (the embedded model runs on past 256 greedily)
CANCELLED = re.compile(r"request front_end=http route=/v1/chat/completions status=200 outcome=cancelled "
                       r"prompt_tokens=\d+ cached_tokens=\d+ cached_ram=\d+ cached_disk=\d+ completion_tokens=(\d+)")


@pytest.fixture(scope="module")
def ring():
    server = Server(None, 2, [*SERVER_ARGS, "--split", "2,4", "--http", "127.0.0.1:0", "--metrics",
                                       "127.0.0.1:0", "--auth-token", TOKEN, "--prompt-lookup"])
    try:
        server.wait_serving()
        _, port = server.http_address()
        metrics = re.search(r"127\.0\.0\.1:(\d+) \(metrics\)", server.output(0)).group(1)
        yield SimpleNamespace(server=server, base=f"http://127.0.0.1:{port}", metrics=f"http://127.0.0.1:{metrics}")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


def call(url, token=TOKEN, body=None):
    """(status, JSON body) of a GET, or of a POST of `body`."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def model_info(ring):
    return ring.server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30,
                                         metadata=[("authorization", f"Bearer {TOKEN}")])


def signed_in(browser, url, token=TOKEN):
    """Open `url`; where the page asks for the token (first time in this tab), give it."""
    browser.open(url)
    if browser.find("#auth").is_displayed():
        browser.find("#auth-token").send_keys(token, Keys.ENTER)
        browser.wait(lambda: not browser.find("#auth").is_displayed(), "the token form closes")


def test_status_json_on_both_ports_needs_the_token(ring):
    info = model_info(ring)
    for base in (ring.base, ring.metrics):
        assert call(f"{base}/v1/status", token=None)[0] == 401
        assert call(f"{base}/v1/status", token="wrong")[0] == 401
        status, doc = call(f"{base}/v1/status")
        assert status == 200 and doc["status"] == "serving" and doc["model"] == info.model_id, doc
        assert [(r["rank"], r["host"], r["layers"], r["embed"], r["head"], r["memory_bytes"]) for r in doc["ranks"]] == [
            (r.rank, r.host, [r.layer_start, r.layer_end], r.embed, r.head, r.memory_bytes) for r in info.ranks]
        assert all(r["alive"] for r in doc["ranks"]) and doc["ring"] == {"failures": 0, "restarts": 0}
        assert doc["ranks"][0]["active_memory_bytes"] >= doc["ranks"][0]["parameter_bytes"] > 0  # rank 0's own, now
        assert doc["requests"]["max_batch"] == info.max_batch and doc["prefix_cache"]["hit_rate"] is None
        assert doc["speculative"] == {"passes": 0, "drafted": 0, "accepted": 0, "acceptance": None,
                                     "cancelled": 0}
        assert doc["history"]["step_s"] == 10 and 1 <= len(doc["history"]["points"]) <= 30
    status, error = call(f"{ring.base}/v1/status?ranks=0&x")
    assert status == 400 and error["error"]["message"] == "/v1/status takes no query parameters: got ranks, x"
    chat = {"messages": [{"role": "user", "content": "The"}], "max_tokens": 2}
    assert call(f"{ring.base}/v1/chat/completions", token="wrong", body=chat)[0] == 401
    assert call(f"{ring.metrics}/chat")[0] == 404  # no API on --metrics' port: no chat page either
    with urllib.request.urlopen(f"{ring.metrics}/", timeout=30) as page:  # open: the page asks for the token
        assert page.headers["Content-Security-Policy"].startswith("default-src 'self'")
        assert b'<meta name="trinity-auth" content="bearer">' in page.read()


def test_status_page_shows_every_rank_as_get_model_info_reports(ring, browser):
    browser.open(ring.base + "/")
    browser.driver.execute_script("sessionStorage.clear()")
    browser.open(ring.base + "/")
    assert browser.find("#auth").is_displayed() and "access token" in browser.text("#auth-message")
    browser.find("#auth-token").send_keys(TOKEN, Keys.ENTER)
    browser.wait(lambda: page_state(browser) == "serving" and len(ranks(browser)) == 2, "the ring drawn")
    assert TOKEN not in browser.driver.current_url
    boxes, widths = {int(box["rank"]): box for box in ranks(browser)}, {}
    for r in model_info(ring).ranks:
        box = boxes[r.rank]
        assert (box["host"], box["start"], box["end"]) == (r.host, str(r.layer_start), str(r.layer_end))
        assert r.host in box["text"] and f"layers [{r.layer_start}, {r.layer_end})" in box["text"]
        assert ("embed" in box["text"]) == r.embed and ("head" in box["text"]) == r.head
        widths[r.rank] = box["width"] / (r.layer_end - r.layer_start)
    assert abs(widths[0] - widths[1]) / widths[1] < 0.1, widths  # to scale: 2 layers, half of 4 layers' width
    assert browser.console_errors() == []


def chart_top(browser) -> float:
    """The height of the tok/s line's highest point above the chart's axis (y 125)."""
    return 125 - min(float(point.split(",")[1]) for point in browser.attribute("#chart .tps polyline", "points").split())


def test_counters_and_chart_change_after_requests(ring, browser, tmp_path):
    signed_in(browser, ring.base + "/")
    browser.wait(lambda: counter(browser, "served").isdigit(), "the counters")
    top, before = chart_top(browser), call(f"{ring.base}/v1/status")[1]
    served, generated = before["requests"]["served"], before["tokens"]["generated"]
    for prompt in ("The", "A", "In"):
        status, out = call(f"{ring.base}/v1/completions", body={"prompt": prompt, "max_tokens": 40, "temperature": 0})
        assert status == 200 and out["usage"]["completion_tokens"] == 40
    # At least: a request is counted just after its answer is out, so an earlier one may still come in.
    browser.wait(lambda: int(counter(browser, "served")) >= served + 3, "3 more requests served")
    browser.wait(lambda: int(counter(browser, "generated tokens")) >= generated + 120, "their tokens counted")
    browser.wait(lambda: chart_top(browser) > top, "the chart shows the tokens")
    assert counter(browser, "TTFT p50").endswith(" ms") and counter(browser, "speculative acceptance") != "off"
    browser.screenshot("status-page.png", tmp_path)
    assert browser.console_errors() == []


def test_chat_page_streams_a_reply_to_a_typed_message(ring, browser, tmp_path):
    signed_in(browser, ring.base + "/chat")
    browser.find("#system").send_keys("You continue the text.")
    reply = chat(browser, "The", 30)
    browser.wait(lambda: reply.get_attribute("data-finish"), "the reply ends")
    assert reply.get_attribute("data-finish") == "length"
    _, whole = call(f"{ring.base}/v1/chat/completions", body={
        "messages": [{"role": "system", "content": "You continue the text."}, {"role": "user", "content": "The"}],
        "max_tokens": 30, "temperature": 0})
    shown = reply.find_element("css selector", ".content").text
    assert shown.split() == whole["choices"][0]["message"]["content"].split()
    stats = reply.find_element("css selector", ".stats").text
    assert re.search(r"^30 tokens · [\d.]+ tok/s · first token after \d+ ms · \d+ prompt tokens, \d+ cached · length$",
                     stats), stats
    browser.screenshot("chat-page.png", tmp_path)
    assert browser.console_errors() == []


def test_the_stop_button_cancels_the_request_on_the_server(ring, browser):
    signed_in(browser, ring.base + "/chat")
    cancelled = len(CANCELLED.findall(ring.server.output(0)))
    reply = chat(browser, "The", LONG)
    # The reply grows past the window's foot; the composer stays in view, Stop on top of the reply.
    browser.wait(lambda: browser.js("return arguments[0].getBoundingClientRect().bottom > innerHeight", reply),
                 "the reply longer than the window", timeout=120)
    assert browser.js("""const r = arguments[0].getBoundingClientRect();
        return r.bottom <= innerHeight && document.elementFromPoint((r.left + r.right) / 2, (r.top + r.bottom) / 2)
        === arguments[0]""", browser.find("#stop")), "Stop out of view or under the reply"
    browser.find("#stop").click()
    browser.wait(lambda: reply.get_attribute("data-finish") == "stopped", "the page stops")
    assert not browser.find("#send").get_property("disabled")
    wait_until(lambda: len(CANCELLED.findall(ring.server.output(0))) > cancelled, timeout=60)
    assert int(CANCELLED.findall(ring.server.output(0))[-1]) < LONG  # the server cut it short
    wait_until(lambda: call(f"{ring.base}/v1/status")[1]["requests"]["running"] == 0, timeout=60)
    assert browser.console_errors() == []


def test_a_wrong_token_is_refused_then_the_right_one_works(ring, browser):
    browser.open(ring.base + "/")
    browser.driver.execute_script("sessionStorage.clear()")
    browser.open(ring.base + "/")
    browser.find("#auth-token").send_keys("wrong-token", Keys.ENTER)
    browser.wait(lambda: "refused" in browser.text("#auth-message") and browser.find("#auth").is_displayed(),
                 "the refusal")
    assert ranks(browser) == [] and page_state(browser) == ""
    browser.find("#auth-token").send_keys(TOKEN, Keys.ENTER)
    browser.wait(lambda: page_state(browser) == "serving" and len(ranks(browser)) == 2, "the ring drawn")


def test_the_chat_page_asks_again_after_a_wrong_token_and_sends_the_message(ring, browser):
    browser.open(ring.base + "/chat")
    browser.driver.execute_script("sessionStorage.clear()")
    browser.open(ring.base + "/chat")
    browser.find("#auth-token").send_keys("wrong-token", Keys.ENTER)  # taken: the server judges it at the send
    reply = chat(browser, "The", 5)
    browser.wait(lambda: "refused" in browser.text("#auth-message") and browser.find("#auth").is_displayed(),
                 "the refusal")
    browser.find("#auth-token").send_keys(TOKEN, Keys.ENTER)
    browser.wait(lambda: reply.get_attribute("data-finish"), "the reply ends")
    assert reply.get_attribute("data-finish") == "length" and reply.find_element("css selector", ".content").text
