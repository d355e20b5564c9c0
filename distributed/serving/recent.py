"""Recent figures for `GET /v1/status` (status.py): over the last minute, tokens
streamed per second, time to first token and each rank's share of the time in its
forward computation; over the last five minutes, the same tok/s and TTFT in steps of
10 s (the status page's chart). The front ends' threads add to them as tokens stream
(request_log.py); a status request sums them. Tokens are counted in per-second
buckets and old samples dropped as they age, under a lock held for an append or a
sum: the scheduler never waits for them."""

import collections
import math
import threading
import time
from typing import Dict, List, Optional

WINDOW_S = 60.0
HISTORY_S, STEP_S = 300, 10  # the chart's span and step
MAX_SAMPLES = 10000  # first-token times kept at most (a busy server's last five minutes)


def percentile(values: List[float], p: float) -> Optional[float]:
    """The nearest-rank percentile (p in (0, 1]) of values; None if there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


class Recent:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.started = clock()
        self._lock = threading.Lock()
        self._tokens: "collections.deque[List[int]]" = collections.deque()  # [second, tokens streamed in it]
        self._ttft: "collections.deque" = collections.deque(maxlen=MAX_SAMPLES)  # (when, seconds to the first token)
        self._forward: "collections.deque" = collections.deque()  # (when, {rank: forward seconds so far})

    def token(self) -> None:
        """A token was streamed to a client."""
        second = int(self.clock())
        with self._lock:
            if self._tokens and self._tokens[-1][0] == second:
                self._tokens[-1][1] += 1
            else:
                self._tokens.append([second, 1])
                while self._tokens[0][0] <= second - HISTORY_S:
                    self._tokens.popleft()

    def first_token(self, seconds: float) -> None:
        """A request got its first token `seconds` after it arrived."""
        now = self.clock()
        with self._lock:
            self._ttft.append((now, seconds))
            while self._ttft[0][0] < now - HISTORY_S:
                self._ttft.popleft()

    def figures(self) -> dict:
        """tok/s (over the last minute, or since the start if shorter) and TTFT p50 / p99."""
        now = self.clock()
        with self._lock:
            tokens = sum(n for second, n in self._tokens if second > now - WINDOW_S)
            ttft = [s for when, s in self._ttft if when >= now - WINDOW_S]
        span = max(1.0, min(WINDOW_S, now - self.started))
        return {"window_s": WINDOW_S, "tokens_per_s": round(tokens / span, 2), "first_tokens": len(ttft),
                "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99)}

    def history(self) -> dict:
        """tok/s and TTFT p50 in each STEP_S since the start, over the last HISTORY_S, oldest first
        (the last step is the one under way: its tok/s is over its seconds so far)."""
        now = self.clock()
        last = int(now // STEP_S)
        first = max(last - HISTORY_S // STEP_S + 1, int(self.started // STEP_S))
        tokens, ttft = {}, {}
        with self._lock:
            for second, n in self._tokens:
                tokens[second // STEP_S] = tokens.get(second // STEP_S, 0) + n
            for when, seconds in self._ttft:
                ttft.setdefault(int(when // STEP_S), []).append(seconds)
        points = []
        for step in range(first, last + 1):
            span = min(now, (step + 1) * STEP_S) - max(self.started, step * STEP_S)
            points.append({"tokens_per_s": round(tokens.get(step, 0) / max(1.0, span), 2),
                           "ttft_p50_s": percentile(ttft.get(step, []), 0.5)})
        return {"step_s": STEP_S, "points": points}

    def forward_shares(self, reports: Dict[int, dict]) -> Dict[int, Optional[float]]:
        """Each rank's forward seconds per second since the oldest snapshot of the last minute
        (None until there is one a second old); `reports` (RankStats') becomes a snapshot."""
        now = self.clock()
        seconds = {rank: report.get("forward_seconds", 0.0) for rank, report in reports.items()}
        with self._lock:
            while self._forward and self._forward[0][0] < now - WINDOW_S:
                self._forward.popleft()
            snapshots = list(self._forward)
            if not snapshots or now - snapshots[-1][0] >= 1.0:  # one a second: pollers add no work
                self._forward.append((now, seconds))
        shares = {}
        for rank, s in seconds.items():  # from the oldest snapshot that has the rank (reports come late)
            then = next(((when, old[rank]) for when, old in snapshots if rank in old), None)
            ok = then is not None and now - then[0] >= 1.0
            shares[rank] = round(min(1.0, max(0.0, (s - then[1]) / (now - then[0]))), 4) if ok else None
        return shares
