"""The 8-second version of the soak (`python -m bench soak`): 4 local ranks serving gRPC under
random requests (10% cancelled, 5% invalid) from concurrent clients; no unexpected
error, no wrong greedy output, memory sampled for every rank, and a clean stop of the
launcher (SIGTERM: exit 0, not restarted although --restart allows it, nothing left)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a soak of 4 ranks

ROOT = Path(__file__).resolve().parents[2]


def test_soak_8_seconds_four_ranks(tmp_path):
    out = tmp_path / "soak.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "soak", "--minutes", "0.13", "--ranks", "4", "--clients", "4",
         "--restart", "1", "--sample-every", "1", "--out", str(out), "--log", str(tmp_path / "soak.log")],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    report = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    r = json.loads(out.read_text())
    assert r["errors"] == 0 and r["wrong_outputs"] == 0, report
    assert r["ok_greedy"] > 0 and r["ok_sampled"] + r["ok_greedy"] >= 5, report
    assert r["invalid_rejected"] >= 1 and r["cancelled"] + r["counts"].get("cancel_too_late", 0) >= 1, report
    # Memory for every rank, at every sample (about 8 over 8 seconds; each client's first request is
    # invalid or cancelled, so even a short soak has both).
    assert len(r["samples"]) >= 5
    assert all(len(s["rss"]) == 4 and all(v and v > 0 for v in s["rss"]) for s in r["samples"]), report
    assert len(r["rss_growth"]) == 4 and all(g is not None for g in r["rss_growth"])
    assert [m["minute"] for m in r["rss_marks"]][0] == 0 and len(r["rss_marks"]) >= 4
    assert len(r["rss_slope_mib_per_min"]) == 4 and all(v is not None for v in r["rss_slope_mib_per_min"]), report
    assert r["launcher_status"] == 0 and r["restarts"] == 0 and r["orphans"] == [], report
    assert "per-rank resident memory" in proc.stdout and "memory growth first->last" in proc.stdout
    assert "memory slope after warm-up" in proc.stdout


def test_memory_trend_marks_and_slope_after_warmup():
    from bench.soak_report import memory_trend

    # Rank 0 grows 1 MiB/min throughout; rank 1 jumps during warm-up, then stays flat.
    samples = [{"t": t, "rss": [2**27 + t * 2**20 // 60, 2**26 if t > 100 else 2**25]} for t in range(0, 1801, 10)]
    trend = memory_trend(samples, 2, 1800.0, warmup_s=600)
    assert [(m["minute"], m["t"]) for m in trend["rss_marks"]] == [(0, 0), (10, 600), (20, 1200), (30, 1800)]
    assert abs(trend["rss_slope_mib_per_min"][0] - 1.0) < 1e-9 and trend["rss_slope_mib_per_min"][1] == 0
    assert trend["samples_after_warmup"] == 121
    short = memory_trend(samples[:37], 2, 362.0, warmup_s=120)  # a 6-minute soak: marks every third
    assert [m["minute"] for m in short["rss_marks"]] == [0, 2, 4, 6]
