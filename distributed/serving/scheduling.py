"""What the front ends (grpc_service.py, http_api.py, metrics.py) need of a scheduler.

Two kinds answer it: rank 0's runtime Scheduler (runtime/scheduler.py), and the
launcher's RemoteScheduler (launch/router/), which forwards each request to rank 0
and replays it on a restarted ring. The front ends never know which they have.
"""

from typing import List, Optional, Protocol

from ..runtime.request import GenerationRequest


class Handle(Protocol):
    request: GenerationRequest

    def events(self):
        """TokenEvent (after a PromptEvent if asked for) as they come, then one FinishEvent."""

    def cancel(self) -> None:
        """Stop this request (within a decode step); a no-op once finished."""


class Scheduling(Protocol):
    prefix_cache: Optional[object]  # the prefix cache's counters, or None (the router has none)

    def submit(self, request: GenerationRequest) -> Handle:
        """Queue a request; raises QueueFull or RingUnavailable (runtime/scheduler.py)."""

    def rank_info(self) -> List[dict]:
        """Each rank's row, as run_trinity.py --json's `ranks`; raises RingUnavailable."""

    def rank_reports(self) -> dict:
        """rank -> its counters for the metrics (runtime/rank_stats.py); {} if not known here."""

    @property
    def waiting(self) -> int:
        """Requests queued, not running yet."""

    @property
    def running(self) -> int:
        """Requests running."""
