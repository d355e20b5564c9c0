"""What rank 0's front ends report about each generation request: one access-log
line on stderr when it ends, and its metrics (metrics.py); and one line of what the
server served when it stops.

A front end calls begin() as a request arrives, reads the request's events
through the Trace (which times its first token and the gaps between tokens) and
calls end() with the status it answered once the answer is out (so a scrape made
the instant a client has its answer may not count it yet).

    trinity: request front_end=http route=/v1/completions status=200 outcome=length prompt_tokens=5
        cached_tokens=0 cached_ram=0 cached_disk=0 completion_tokens=16 ttft_s=0.041 duration_s=0.210 client=127.0.0.1   (one line)

A request that carried fields accepted with no effect here (openai_api.py's compatibility
rule: `reasoning.summary`, `context_management`, …) names them at the line's end
(` ignored=reasoning.summary,include`), and a limit held to what the server allows
(` clamped=max_tokens`); each is counted by name (trinity_ignored_fields, trinity_clamped_fields).

The same requests feed the recent figures of `GET /v1/status` (Recent, read by status.py): over
the last minute, tokens streamed per second, time to first token and each rank's share of the
time in its forward computation; over the last five minutes, the same tok/s and TTFT in steps of
10 s (the status page's chart). The front ends' threads add to them as tokens stream
(RequestLog's Trace); a status request sums them. Tokens are counted in per-second
buckets and old samples dropped as they age, under a lock held for an append or a
sum: the scheduler never waits for them.
"""

import collections
import json
import logging
import math
import threading
import time
from typing import Dict, Iterator, List, Optional, Tuple

from ..runtime.memory_guard import is_out_of_memory
from ..runtime.request import FinishEvent, TokenEvent
from .metrics import Metrics

# A request that never ran: its outcome from the status it got (HTTP status or gRPC code name).
REFUSED = {400: "invalid", 411: "invalid", 413: "invalid", 401: "unauthenticated", 404: "not_found",
           429: "queue_full", 500: "server_error", 503: "unavailable",
           "INVALID_ARGUMENT": "invalid", "UNAUTHENTICATED": "unauthenticated", "NOT_FOUND": "not_found",
           "RESOURCE_EXHAUSTED": "queue_full", "UNAVAILABLE": "unavailable", "DEADLINE_EXCEEDED": "cancelled",
           "CANCELLED": "cancelled", "UNKNOWN": "server_error", "INTERNAL": "server_error"}

ACCESS = logging.getLogger("trinity.access")  # one line per request and per server event


def write_line(text: str) -> None:
    """One access-log line (distributed/logs.py: the handler writes each record whole, so lines
    of concurrent requests never interleave; a reader gone at a stop raises nothing here)."""
    ACCESS.info(f"trinity: {text}")


STOP_WAIT_S = 1.0  # at a stop, for the requests still open to be logged
FAILED_WAIT_S = 0.5  # the same after a ring failure: rank 0 exits about 1 s after it


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



class RequestLog:
    def __init__(self, metrics: Optional[Metrics] = None, write=write_line):
        self.metrics = metrics or Metrics()
        self.write = write
        self.started = time.monotonic()
        self.recent = Recent()  # the last minute's tok/s and TTFT, for /v1/status
        self.outcomes: "collections.Counter[str]" = collections.Counter()
        self.prompt_tokens = self.cached_tokens = self.generated_tokens = 0
        self._lock = threading.Lock()
        self._stopped = False
        self._open = 0  # requests begun and not yet logged
        self._all_logged = threading.Condition(self._lock)

    def begin(self, front_end: str, route: str, client: str) -> "Trace":
        """A generation request arrived (front_end: "grpc" or "http")."""
        with self._lock:
            self._open += 1
        return Trace(self, front_end, route, client)

    def totals(self) -> dict:
        """What was served so far (a copy: safe from any thread)."""
        with self._lock:
            return {"outcomes": dict(self.outcomes), "prompt_tokens": self.prompt_tokens,
                    "cached_tokens": self.cached_tokens, "generated_tokens": self.generated_tokens}

    def ring_failed(self, reason: str) -> None:
        """Called as the ring fails, before the requests it ends are told (health must be
        down first): the stop line comes from a thread of its own once they are logged."""
        self.metrics.ring_failed = True
        threading.Thread(target=self.stopped, args=(f"the pipeline is down: {reason}", FAILED_WAIT_S),
                         name="stop-line", daemon=True).start()

    def stopped(self, why: str, wait: float = STOP_WAIT_S) -> None:
        """The server stops: one line of what it served (once), after the requests still
        open have been logged (their handlers are given their errors meanwhile), waiting
        `wait` seconds at most."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._all_logged.wait_for(lambda: self._open <= 0, timeout=wait)
            outcomes = ", ".join(f"{n} {outcome}" for outcome, n in sorted(self.outcomes.items()))
            self.write(f"server stopped ({why}): up {time.monotonic() - self.started:.1f} s, "
                       f"served {sum(self.outcomes.values())} requests" + (f" ({outcomes})" if outcomes else "")
                       + f", {self.prompt_tokens} prompt tokens ({self.cached_tokens} cached), "
                       f"{self.generated_tokens} generated tokens")

    def _ended(self, trace: "Trace", status, outcome: str, error: Optional[str]) -> None:
        m, fe = self.metrics, trace.front_end
        prompt, cached, completion = trace.tokens()
        with self._lock:
            self.outcomes[outcome] += 1
            self.prompt_tokens += prompt
            self.cached_tokens += cached
            self.generated_tokens += completion
        duration = time.perf_counter() - trace.start
        m.prompt_tokens.labels(fe).inc(prompt)
        m.cached_tokens.labels(fe).inc(cached)
        m.generated_tokens.labels(fe).inc(completion)
        m.reasoning_tokens.labels(fe).inc(trace.reasoning())
        m.duration.labels(fe).observe(duration)
        ignored, clamped = trace.adjusted()
        for name in ignored:
            m.ignored_fields.labels(name).inc()
        for name in clamped:
            m.clamped_fields.labels(name).inc()
        ttft = "-" if trace.first is None else f"{trace.first - trace.start:.3f}"
        disk = sum(f.disk_tokens for f in trace.finishes)
        self.write(f"request front_end={fe} route={trace.route} status={status} outcome={outcome} "
                   f"prompt_tokens={prompt} cached_tokens={cached} cached_ram={cached - disk} cached_disk={disk} "
                   f"completion_tokens={completion} "
                   f"ttft_s={ttft} duration_s={duration:.3f} client={trace.client}{self._memory()}"
                   + (f" ignored={','.join(ignored)}" if ignored else "") + (f" clamped={','.join(clamped)}" if clamped else "")
                   + (f" error={json.dumps(error)}" if error else ""))
        m.requests.labels(fe, outcome).inc()  # last: once a scrape counts the request, the rest is done
        with self._lock:
            self._open -= 1
            self._all_logged.notify_all()


    def _memory(self) -> str:
        """Each rank's MLX memory now (MiB, in rank order: active, buffer cache, peak), as last heard."""
        scheduler = self.metrics.scheduler
        reports = sorted(scheduler.rank_reports().items()) if scheduler is not None else []
        if not reports:  # not loaded yet, or the launcher's router
            return ""
        mib = lambda key: ",".join(f"{r.get(key, 0) / 2**20:.1f}" for _, r in reports)
        return (f" memory_active_mib={mib('active_memory_bytes')} memory_cache_mib={mib('cache_memory_bytes')}"
                f" memory_peak_mib={mib('peak_memory_bytes')}")


class Trace:
    """One request, from its arrival to the answer's end; its choices (HTTP's n, several
    prompts) are read one handle after the other."""

    def __init__(self, log: RequestLog, front_end: str, route: str, client: str):
        self.log, self.front_end, self.route, self.client = log, front_end, route, client or "-"
        self.start = time.perf_counter()
        self.first: Optional[float] = None  # when its first token came
        self.finishes: List[FinishEvent] = []
        self.handles = 0  # read so far
        self.reply = None  # HTTP: the typed reply (protocol.Reply), whose usage the client is told
        self.reasoning_tokens = 0  # gRPC with separate_reasoning: of the completion tokens, the reasoning's
        self.clamped: List[str] = []  # client limits held to what the server allows (an HTTP plan has its own)
        self.done = False

    def clamp(self, name: str) -> None:
        """The client's `name` was held to what the server allows (the access log names it)."""
        self.clamped.append(name)

    def reasoned(self, tokens: int) -> None:
        """gRPC with separate_reasoning: of the completion tokens, `tokens` were the reasoning's."""
        self.reasoning_tokens = tokens

    def events(self, handle, idle: Optional[float] = None) -> Iterator:
        """handle.events(idle), timed as they come (None: `idle` seconds without one)."""
        itl, ttft = self.log.metrics.itl.labels(self.front_end), self.log.metrics.ttft.labels(self.front_end)
        recent = self.log.recent
        self.handles += 1
        last = None
        for event in handle.events(idle):
            if event is None:
                yield None
                continue
            now = time.perf_counter()
            if isinstance(event, TokenEvent):
                recent.token()
                if self.first is None:
                    self.first = now
                    ttft.observe(now - self.start)
                    recent.first_token(now - self.start)
                elif last is not None:
                    itl.observe(now - last)
                last = now
            elif isinstance(event, FinishEvent):
                self.finishes.append(event)
            yield event

    def follow(self, reply):
        """An HTTP request's reply (protocol.Reply): the log counts its usage and names what its plan
        ignored and clamped. Returns it."""
        self.reply = reply
        return reply

    def tokens(self) -> Tuple[int, int, int]:
        """(prompt, cached, completion) tokens, as the client is told them."""
        if self.reply is not None:
            usage = self.reply.usage()
            return usage.prompt, usage.cached, usage.completion
        return tuple(sum(getattr(f, name) for f in self.finishes)
                     for name in ("prompt_tokens", "cached_tokens", "completion_tokens"))

    def adjusted(self) -> Tuple[List[str], List[str]]:
        """(ignored, clamped) field names, each once, in the order the request gave them."""
        plan = self.reply.plan if self.reply is not None else None
        ignored = plan.ignored if plan else []
        clamped = self.clamped + (plan.clamped if plan else [])
        return list(dict.fromkeys(n for n in ignored if n)), list(dict.fromkeys(n for n in clamped if n))

    def reasoning(self) -> int:
        """Reasoning tokens, as the client is told them (0 where the reply is not split)."""
        if self.reply is not None:
            return self.reply.usage().reasoning or 0
        return self.reasoning_tokens

    def end(self, status, error: Optional[str] = None) -> None:
        """Log and count the request (once): `status` is what the client got (an HTTP status, a
        gRPC code name; None if it went away before any); its outcome is its finish reason if
        it ran to the end, else what the status says (cancelled if the client went away)."""
        if self.done:
            return
        self.done = True
        if self.finishes and len(self.finishes) == self.handles:  # every choice read to its end
            reasons = [f.finish_reason for f in self.finishes]
            outcome = next((r for r in reasons if r in ("error", "cancelled")), reasons[0])
            error = error or next((f.error for f in self.finishes if f.error), None)
            outcome = "out_of_memory" if outcome == "error" and is_out_of_memory(error) else outcome
        elif status in (None, 200, "OK"):
            outcome = "cancelled"  # the client went away mid-answer
        else:
            outcome = REFUSED.get(status, str(status).lower())
        self.log._ended(self, "-" if status is None else status, outcome, error)
