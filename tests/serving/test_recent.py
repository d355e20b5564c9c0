"""recent.py's arithmetic (the last minute's tok/s, TTFT percentiles, forward shares, the
chart's 10 s steps) on a clock the test moves, and status.py's document before the model
loads (the real figures on a real ring: test_pages.py)."""

from distributed.serving.health import Health
from distributed.serving.recent import Recent, percentile
from distributed.serving.request_log import RequestLog
from distributed.serving.status import status_document


class Clock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def test_percentile_is_the_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([3.0, 1.0, 2.0], 0.99) == 3.0
    assert percentile(list(range(1, 101)), 0.99) == 99


def test_tokens_and_first_tokens_of_the_last_minute_only():
    clock = Clock()
    recent = Recent(clock)
    for _ in range(30):
        recent.token()
    recent.first_token(0.5)
    clock.now += 10
    for _ in range(30):
        recent.token()
    recent.first_token(0.1)
    assert recent.figures() == {"window_s": 60.0, "tokens_per_s": 6.0, "first_tokens": 2, "ttft_p50_s": 0.1,
                                "ttft_p99_s": 0.5}  # 60 tokens over the 10 s since the start
    clock.now += 55  # the first second's tokens and first token are over a minute old
    assert recent.figures() == {"window_s": 60.0, "tokens_per_s": 0.5, "first_tokens": 1, "ttft_p50_s": 0.1,
                                "ttft_p99_s": 0.1}


def test_history_steps_of_10_s_over_five_minutes():
    clock = Clock(1000.0)
    recent = Recent(clock)
    recent.token()
    recent.first_token(0.2)
    clock.now = 1025.0
    for _ in range(5):
        recent.token()
    points = recent.history()["points"]
    assert points == [{"tokens_per_s": 0.1, "ttft_p50_s": 0.2}, {"tokens_per_s": 0.0, "ttft_p50_s": None},
                      {"tokens_per_s": 1.0, "ttft_p50_s": None}]  # the last: 5 tokens in its 5 s so far
    clock.now = 1000.0 + 3600
    assert len(recent.history()["points"]) == 30 and recent.history()["points"][-1]["tokens_per_s"] == 0


def test_forward_share_from_the_oldest_snapshot_that_has_the_rank():
    clock = Clock()
    recent = Recent(clock)
    assert recent.forward_shares({0: {"forward_seconds": 1.0}}) == {0: None}  # nothing a second old yet
    clock.now += 2
    shares = recent.forward_shares({0: {"forward_seconds": 2.0}, 1: {"forward_seconds": 5.0}})
    assert shares == {0: 0.5, 1: None}  # rank 1 was first heard now
    clock.now += 4
    assert recent.forward_shares({0: {"forward_seconds": 2.0}, 1: {"forward_seconds": 6.0}}) == {0: 0.1667, 1: 0.25}


def test_status_before_the_model_loads():
    doc = status_document(Health(), RequestLog())
    assert (doc["status"], doc["reason"], doc["model"], doc["ranks"]) == ("loading", "the model is loading", None, [])
    assert doc["requests"] == {"running": 0, "waiting": 0, "max_batch": None, "served": 0, "outcomes": {}}
    assert doc["prefix_cache"] is None and doc["speculative"] is None and doc["ring"] == {"failures": 0, "restarts": 0}
