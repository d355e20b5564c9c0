"""Fixtures of the HTTP tests that serve an in-process scheduler (each module's `served`)."""

import pytest


@pytest.fixture
def submitted(served, monkeypatch):
    """The handles of requests submitted during a test."""
    handles = []
    submit = served.scheduler.submit
    monkeypatch.setattr(served.scheduler, "submit", lambda request: handles.append(submit(request)) or handles[-1])
    return handles
