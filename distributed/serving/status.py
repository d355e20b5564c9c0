"""`GET /v1/status` (on the HTTP API's port and on --metrics'): one JSON document of
what the status page (pages/) shows, for scripts too.

    status, reason       health's state (serving, loading, down, recovering, stopping) and why
    model, uptime_s      the served id; seconds since this server started
    kv_bits              --kv-bits: the full-attention KV caches' bits (null: whole, the model's dtype)
    ranks                rows as run_trinity.py --json's and GetModelInfo's (rank, host, layers
                         [start, end), embed, head, peak_memory_bytes, parameter_bytes,
                         memory_bytes) plus active_memory_bytes, cache_memory_bytes (MLX's now),
                         kv_cache_bytes, prefix_cache_bytes, forward_share (forward seconds
                         per second over the last minute) and alive
    requests             running, waiting, max_batch, served (ended so far) and their outcomes;
                         step_budget: tokens (B now), fixed, itl_target_ms, step_ms (a step alone),
                         carried_tokens (prompt tokens sent beside decoding rows) and largest_chunk
    tokens               prompt, cached, generated (as the clients' usage counts them)
    last_minute          tokens_per_s, ttft_p50_s, ttft_p99_s (request_log.Recent)
    history              step_s, points: tokens_per_s and ttft_p50_s per step, last five minutes
    prefix_cache         entries, hits, lookups, hit_rate, disk (null where the server has none):
                         the disk tier's folder, loads, load_failures, tokens, load_seconds and rank
                         0's files (entries, bytes, writes, write_drops, corrupt, ...; null where off)
    speculative          passes, drafted, accepted, acceptance, cancelled (null unless it speculates)
    ring                 failures, restarts (under `launch run --serve`, the router's count)
    loop                 rank 0's scheduler loop: seconds by part since start (admit, build, launch,
                         sample, wait, accept, prefix, idle, other: runtime/loop_clock.py), steps
                         taken and wall_s (null in the router)

It reads the plain numbers the metrics read (metrics.py): it never waits for the ring.
In the launcher's router the per-rank live figures are rank 0's own (its --metrics):
here they are null, and ranks are as GetModelInfo last reported them.
"""

import time
from typing import Optional

from .metrics import loop_clock_of, prefix_cache_of, speculation_of

LIVE = ("active_memory_bytes", "cache_memory_bytes", "kv_cache_bytes", "prefix_cache_bytes")  # RankStats


def _ratio(part: int, whole: int) -> Optional[float]:
    return round(part / whole, 4) if whole else None


def status_document(health, requests) -> dict:
    """The document, from a front end's Health (http_api.py) and its RequestLog."""
    state, reason = health.state
    metrics, totals = requests.metrics, requests.totals()
    scheduler, info = metrics.scheduler, metrics.info
    doc = {
        "status": state, "reason": reason, "model": info.model_id if info else None,
        "uptime_s": round(time.monotonic() - requests.started, 1), "kv_bits": info.kv_bits if info else None,
        "ranks": _ranks(info.ranks if info else [], scheduler, requests.recent, state),
        "requests": {"running": scheduler.running if scheduler else 0, "waiting": scheduler.waiting if scheduler else 0,
                     "max_batch": info.max_batch if info else None, "served": sum(totals["outcomes"].values()),
                     "outcomes": totals["outcomes"], "step_budget": _step_budget(scheduler)},
        "tokens": {"prompt": totals["prompt_tokens"], "cached": totals["cached_tokens"],
                   "generated": totals["generated_tokens"]},
        "last_minute": requests.recent.figures(), "history": requests.recent.history(),
        "prefix_cache": None, "speculative": None,
        "ring": {"failures": metrics.restarts + metrics.ring_failed, "restarts": metrics.restarts},
        "loop": None,
    }
    clock = loop_clock_of(scheduler)
    if clock is not None:
        doc["loop"] = clock.report()
    prefix = prefix_cache_of(scheduler)
    if prefix is not None:
        doc["prefix_cache"] = {"entries": len(prefix.index.entries), "hits": prefix.hits, "lookups": prefix.lookups,
                               "hit_rate": _ratio(prefix.hits, prefix.lookups), "disk": _disk(prefix)}
    spec = speculation_of(scheduler)
    if spec is not None:
        doc["speculative"] = {"passes": spec.passes, "drafted": spec.drafted, "accepted": spec.accepted,
                              "acceptance": _ratio(spec.accepted, spec.drafted), "cancelled": spec.cancelled}
    return doc


def _step_budget(scheduler):
    """The prompt tokens a step carries beside decoding rows (runtime/step_budget.py; null in the router)."""
    batcher = getattr(scheduler, "batcher", None)
    return batcher.budget.describe() if batcher is not None else None


def _disk(prefix):
    """The disk tier (null where it is off): loads on every rank, and rank 0's own files."""
    if prefix.disk is None:
        return None
    stats = prefix.disk.stats()
    return {"folder": str(prefix.disk.folder), "loads": prefix.disk_hits, "load_failures": prefix.disk_failed,
            "tokens": prefix.disk_tokens, "load_seconds": round(prefix.disk_seconds, 3),
            **{k: stats.get(k) for k in ("entries", "bytes", "writes", "write_drops", "write_errors", "corrupt",
                                          "fingerprint_mismatches", "evicted")}}


def _ranks(rows, scheduler, recent, state: str) -> list:
    """The rank map with each rank's live figures (rank 0's own now, the others' as last heard)."""
    reports = scheduler.rank_reports() if scheduler else {}
    shares = recent.forward_shares(reports) if reports else {}
    out = []
    for row in rows:
        rank, report = row["rank"], reports.get(row["rank"])
        live = {key: report.get(key, 0) if report else None for key in LIVE}
        if report:
            live["peak_memory_bytes"] = report.get("peak_memory_bytes", row["peak_memory_bytes"])
        # Alive: part of a ring that serves (a failure ends the whole ring; which rank failed is in `reason`).
        out.append({**row, **live, "forward_share": shares.get(rank), "alive": state == "serving"})
    return out
