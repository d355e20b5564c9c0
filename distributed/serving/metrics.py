"""Rank 0's Prometheus metrics (prometheus-client), served at `/metrics` on the HTTP
API's port and on `--metrics HOST:PORT`.

Each server has a registry of its own, not prometheus-client's global one, so that
several servers (or tests) in one process do not clash. Requests are counted by the
front ends as each ends (request_log.py); the ring's state is read at scrape time
from plain numbers the runtime keeps (the scheduler's queue, the prefix cache's
counters, each rank's RankStats: runtime/pipeline.py, the other ranks' as last
heard with their heartbeats), so a scrape never waits for the ring, nor the ring
for a scrape, and a scrape still answers while the ring is stuck.
"""

from typing import Optional, Tuple

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self, restarts: int = 0):
        disable_created_metrics()  # no `_created` series beside every counter and histogram
        self.registry = registry = CollectorRegistry()
        front_end = ["front_end"]  # grpc or http
        self.requests = Counter(
            "trinity_requests", "Generation requests that ended, by front end and outcome: a finish reason (stop, "
            "length, cancelled, error) or why it was refused (invalid, queue_full, unavailable, unauthenticated, ...)",
            ["front_end", "outcome"], registry=registry)
        self.prompt_tokens = Counter("trinity_prompt_tokens", "Prompt tokens of requests that ran", front_end,
                                     registry=registry)
        self.cached_tokens = Counter("trinity_prompt_tokens_cached", "Prompt tokens restored from the prefix cache "
                                     "instead of computed (part of trinity_prompt_tokens)", front_end, registry=registry)
        self.generated_tokens = Counter("trinity_generated_tokens", "Tokens generated (completion tokens)",
                                        front_end, registry=registry)
        self.reasoning_tokens = Counter("trinity_reasoning_tokens", "Of the generated tokens, those generated while "
                                        "the reply was reasoning (checkpoints with think tokens; their end marker too)",
                                        front_end, registry=registry)
        self.ignored_fields = Counter(
            "trinity_ignored_fields", "Request fields accepted with no effect for this server and model (the "
            "compatibility rule: e.g. reasoning.summary, context_management), by field name", ["field"], registry=registry)
        self.clamped_fields = Counter(
            "trinity_clamped_fields", "Request limits held to what the server allows (max_tokens beyond the context "
            "or --max-tokens-cap), by field name", ["field"], registry=registry)
        self.ttft = Histogram("trinity_time_to_first_token_seconds", "From a request's arrival to its first token",
                              front_end, buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("trinity_inter_token_latency_seconds", "Between successive tokens of a request",
                             front_end, buckets=ITL_BUCKETS, registry=registry)
        self.duration = Histogram("trinity_request_duration_seconds", "From a request's arrival to its end",
                                  front_end, buckets=DURATION_BUCKETS, registry=registry)
        ProcessCollector(registry=registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.restarts = restarts  # rings before this one that failed and were restarted (launch run --restart)
        self.ring_failed = False
        self.scheduler = self.info = None  # once attached
        registry.register(_RingCollector(self))

    def attach(self, scheduler, info) -> None:
        """The model is loaded on every rank: the ring's metrics come from now on."""
        self.scheduler, self.info = scheduler, info

    def exposition(self) -> Tuple[bytes, str]:
        """The scrape's body and its Content-Type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def disk_tier_metrics(prefix):
    """The prefix cache's disk tier: rank 0's loads (a load reads the entry on every rank) and
    its own disk's counters (runtime/disk_cache.py: each rank keeps its own; rank 0's stand for all)."""
    yield _counter("prefix_cache_disk_loads", "Prompts that read a prefix from every rank's disk", prefix.disk_hits)
    yield _counter("prefix_cache_disk_load_failures", "Disk entries rank 0 held that another rank did not (none kept)",
                   prefix.disk_failed)
    yield _counter("prefix_cache_disk_tokens", "Prompt tokens read from the disk tier", prefix.disk_tokens)
    yield _counter("prefix_cache_disk_load_seconds", "Time reading entries from every rank's disk", prefix.disk_seconds)
    yield _counter("prefix_cache_disk_writes_queued", "Entries rank 0 asked every rank to write", prefix.disk_written)
    disk = prefix.disk.stats() if prefix.disk is not None else {}
    for key, text in (("bytes", "Bytes of rank 0's entry files"), ("entries", "Rank 0's entry files")):
        if key in disk:
            yield _gauge(f"prefix_cache_disk_{key}", text, disk[key])
    for key, text in (("writes", "Entry files rank 0 wrote"), ("write_drops", "Writes dropped (queue full, disk full)"),
                      ("write_errors", "Writes that failed"), ("corrupt", "Damaged entry files found and removed"),
                      ("fingerprint_mismatches", "Entry files of another checkpoint or split, removed"),
                      ("evicted", "Entry files removed as least recently used")):
        if key in disk:
            yield _counter(f"prefix_cache_disk_{key}", text, disk[key])


def prefix_cache_of(scheduler):
    """The scheduler's prefix cache (its counters), or None: off, not attached yet, or the
    launcher's router (rank 0's own metrics have it)."""
    return getattr(scheduler, "prefix_cache", None)


def speculation_of(scheduler):
    """The batcher's speculation counters (runtime/speculation.py), or None: not speculating,
    or no batcher here (the router)."""
    batcher = getattr(scheduler, "batcher", None)
    verifier = batcher.verifier if batcher is not None else None
    return verifier.stats if verifier is not None and verifier.drafter is not None else None


def loop_clock_of(scheduler):
    """Rank 0's loop clock (runtime/loop_clock.py), or None (the router has none)."""
    batcher = getattr(scheduler, "batcher", None)
    return batcher.clock if batcher is not None else None


def _counter(name: str, doc: str, value: Optional[float] = None, labels=None) -> CounterMetricFamily:
    return CounterMetricFamily(f"trinity_{name}", doc, value=value, labels=labels)


def _gauge(name: str, doc: str, value: Optional[float] = None, labels=None) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"trinity_{name}", doc, value=value, labels=labels)


class _RingCollector:
    """The ring's state, read at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []  # the families vary (none before the model is loaded): no check at registration

    def collect(self):
        m = self.metrics
        yield _counter("ring_restarts", "Times `launch run --restart` restarted the ring before this one "
                       "(TRINITY_RESTARTS)", m.restarts)
        yield _counter("ring_failures", "Ring failures (a rank died, froze or was cut off), counting those before "
                       "launcher restarts; rank 0 exits about 1 s after its ring fails", m.restarts + m.ring_failed)
        s, info = m.scheduler, m.info
        if s is None:
            return
        yield _gauge("requests_waiting", "Requests queued for admission (at most --max-queue)", s.waiting)
        yield _gauge("sequences_running", "Requests admitted and decoding (or prefilling)", s.running)
        yield _gauge("max_batch", "Sequences that may decode together (--max-batch)", info.max_batch)
        batcher = getattr(s, "batcher", None)
        if batcher is not None and batcher.budget.tokens is not None:
            yield _gauge("step_token_budget", "Prompt tokens a step may carry beside decoding rows now "
                         "(--max-step-tokens, or as --itl-target-ms sets it)", batcher.budget.tokens)
        clock = loop_clock_of(s)
        if clock is not None:
            report = clock.report()
            loop = _counter("loop_seconds", "Seconds of rank 0's scheduler loop by part (runtime/loop_clock.py: admit, "
                            "build, launch, sample, wait, accept, prefix, idle, other)", labels=["part"])
            for part, seconds in report["seconds"].items():
                loop.add_metric([part], seconds)
            yield loop
            yield _counter("loop_steps", "Decode steps (and verification passes) whose tokens rank 0 took", report["steps"])
        prefix = prefix_cache_of(s)
        if prefix is not None:
            yield _gauge("prefix_cache_entries", "Prefix-cache entries", len(prefix.index.entries))
            yield _gauge("prefix_cache_budget_bytes", "Prefix-cache bytes allowed on any rank (--prefix-cache-bytes)",
                         prefix.budget)
            yield _counter("prefix_cache_hits", "Prompts that restored a cached prefix", prefix.hits)
            yield _counter("prefix_cache_misses", "Prompts looked up in the prefix cache without a usable entry",
                           prefix.lookups - prefix.hits)
            yield from disk_tier_metrics(prefix)
        spec = speculation_of(s)
        if spec is not None:
            yield _counter("speculative_passes", "Verification frames: a row's last token and its drafts", spec.passes)
            yield _counter("speculative_drafted", "Draft tokens verified", spec.drafted)
            yield _counter("speculative_cancelled", "Verification frames drafted ahead on drafts that did not hold, "
                           "dropped", spec.cancelled)
            yield _counter("speculative_accepted", "Draft tokens equal to the target's draw (streamed unless a "
                           "stop came first)", spec.accepted)
        reports = s.rank_reports()  # {} in the router
        if reports:
            yield from self._ranks(reports, {r["rank"]: r["host"] for r in info.ranks})
        limits = _gauge("rank_memory_limit_bytes", "Each rank's --memory-limit (ranks without one: none)",
                        labels=["rank", "host"])
        for r in info.ranks:
            if r.get("memory_limited"):
                limits.add_metric([str(r["rank"]), r["host"]], r["memory_bytes"])
        yield limits

    @staticmethod
    def _ranks(reports: dict, hosts: dict):
        labels = ["rank", "host"]
        families = [
            ("forward_seconds", _counter("rank_forward_seconds", "Seconds of each rank's forward computation (its "
                                         "layers; rank 0 also the embedding, head and sampling, and counted from "
                                         "sending its work until it sees it done: runtime/pipeline.py RankStats); other "
                                         "ranks' as of their last heartbeat (about 1 s old at most)", labels=labels)),
            ("forward_frames", _counter("rank_forward_frames", "Forward frames (prompt chunks, decode steps) each "
                                        "rank computed", labels=labels)),
            ("mixed_frames", _counter("rank_mixed_frames", "Forward frames each rank computed that carried a "
                                      "prompt chunk beside a decode step (chunked prefill)", labels=labels)),
            ("kv_cache_bytes", _gauge("kv_cache_bytes", "Bytes of KV cache each rank holds for running requests",
                                      labels=labels)),
            ("prefix_cache_bytes", _gauge("prefix_cache_bytes", "Bytes of prefix-cache entries each rank holds",
                                          labels=labels)),
            ("active_memory_bytes", _gauge("rank_memory_active_bytes", "Bytes each rank's MLX arrays hold now "
                                           "(mx.get_active_memory)", labels=labels)),
            ("cache_memory_bytes", _gauge("rank_memory_cache_bytes", "Bytes of freed buffers each rank's MLX keeps "
                                          "for reuse (mx.get_cache_memory; bounded under --memory-limit)",
                                          labels=labels)),
            ("peak_memory_bytes", _gauge("rank_memory_peak_bytes", "Each rank's peak MLX memory (mx.get_peak_memory)",
                                         labels=labels)),
            ("memory_refused_frames", _counter("rank_memory_refused_frames", "Frames a rank did not run for lack of "
                                               "memory (their requests failed, the ring went on)", labels=labels)),
        ]
        for key, family in families:
            for rank, report in sorted(reports.items()):
                family.add_metric([str(rank), hosts.get(rank, "?")], report.get(key, 0))
            yield family
