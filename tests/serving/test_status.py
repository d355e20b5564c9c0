"""status.py's document before the model loads (the real figures on a real ring: test_pages.py)."""

from distributed.serving.http_api import Health
from distributed.serving.request_log import RequestLog
from distributed.serving.status import status_document


def test_status_before_the_model_loads():
    doc = status_document(Health(), RequestLog())
    assert (doc["status"], doc["reason"], doc["model"], doc["ranks"]) == ("loading", "the model is loading", None, [])
    assert doc["requests"] == {"running": 0, "waiting": 0, "max_batch": None, "served": 0, "outcomes": {},
                               "step_budget": None}
    assert doc["prefix_cache"] is None and doc["speculative"] is None and doc["ring"] == {"failures": 0, "restarts": 0}
