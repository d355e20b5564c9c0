"""The soak's measurements of the processes it watches, and its report.

Memory: each rank's resident memory (VmRSS) is sampled every --sample-every seconds. The report
gives it at marks (0/10/20/30 min on a 30-minute soak: every third of the soak on a shorter
one) and, per rank, the least-squares slope in MiB/min over the samples after warm-up (by
default the first third of the soak: on the CPU backend MLX's buffer cache alone fills up to
its 32 MiB limit during the first minutes, and glibc's heap grows with it). A rank that
leaks shows a slope that stays positive after warm-up; a flat rank shows one near zero.
"""

import json
import os
import subprocess
from collections import Counter
from pathlib import Path
from typing import List, Optional


def rss_bytes(pid: int) -> Optional[int]:
    """Resident memory of a process (VmRSS), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # no /proc (macOS)
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
        return int(out.stdout.strip()) * 1024 if out.stdout.strip() else None
    except (OSError, ValueError):
        return None


def cpu_seconds(pid: int) -> Optional[float]:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        return state != "Z"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def mib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def slope_mib_per_min(points: List[tuple]) -> Optional[float]:
    """Least-squares slope of (seconds, bytes) points, in MiB per minute; None under 3 points."""
    if len(points) < 3:
        return None
    n = len(points)
    mt, mb = sum(t for t, _ in points) / n, sum(b for _, b in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return sum((t - mt) * (b - mb) for t, b in points) / var * 60 / 2**20


def memory_trend(samples: List[dict], ranks: int, soak_s: float, warmup_s: float) -> dict:
    """RSS at marks, and each rank's slope after warm-up (see the module's docstring)."""
    every = 600.0 if soak_s >= 20 * 60 else max(soak_s / 3, 1.0)
    marks, m = [], 0.0
    while m <= soak_s + 1e-6:
        nearest = min(samples, key=lambda s: abs(s["t"] - m))
        marks.append({"minute": round(m / 60, 1), "t": nearest["t"], "rss": nearest["rss"]})
        m += every
    if marks[-1]["t"] != samples[-1]["t"]:
        marks.append({"minute": round(samples[-1]["t"] / 60, 1), "t": samples[-1]["t"], "rss": samples[-1]["rss"]})
    after = [s for s in samples if s["t"] >= warmup_s]
    slopes = [slope_mib_per_min([(s["t"], s["rss"][r]) for s in after if s["rss"][r] is not None])
              for r in range(ranks)]
    return {"rss_marks": marks, "warmup_s": warmup_s, "samples_after_warmup": len(after),
            "rss_slope_mib_per_min": slopes}


def print_report(r: dict) -> None:
    """The table of samples and the summary, from the results soak.py writes as JSON."""
    ranks, c = r["settings"]["ranks"], Counter(r["counts"])
    print(f"\nper-rank resident memory (MiB), sampled every {r['settings']['sample_every']:g} s")
    print(f"{'time s':>8}{'requests':>10}" + "".join(f"{'rank ' + str(i):>11}" for i in range(ranks))
          + f"{'launcher cpu s':>16}")
    for s in r["samples"]:
        cpu = "-" if s["launcher_cpu_s"] is None else f"{s['launcher_cpu_s']:.1f}"
        print(f"{s['t']:>8.0f}{s['requests']:>10}" + "".join(f"{mib(v):>11}" for v in s["rss"]) + f"{cpu:>16}")
    print(f"\nsoak: {r['soak_s'] / 60:.1f} min, {ranks} ranks, {r['settings']['clients']} clients, model {r['model']}")
    print(f"requests {r['requests']}: ok {r['ok']} (greedy, checked against mlx-lm {c['ok_greedy']}; sampled "
          f"{c['ok_sampled']}; of these {c['cancel_too_late']} ended before their planned cancel), cancelled "
          f"{c['cancelled']} (greedy prefix checked {c['cancelled_prefix_checked']}), invalid rejected "
          f"{c['invalid_rejected']}, errors {c['errors']}, wrong outputs {c['wrong_outputs']}, near-tie divergences "
          f"{c['near_tie_divergences']}; cut short when time was up {c['cut_at_end']} (prefix checked, not counted)")
    print(f"tokens streamed {c['tokens']} ({c['tokens'] / max(r['soak_s'], 1e-9):.1f}/s); references computed "
          f"{r['references_computed']}; max |logprob - mlx-lm| {r['max_logprob_diff']:.2e}")
    print("memory growth first->last sample (MiB): " + ", ".join(
        f"rank {i} {mib(a)} -> {mib(b)} ({'-' if g is None else f'{g / 2**20:+.1f}'})"
        for i, (a, b, g) in enumerate(zip(r["rss_first"], r["rss_last"], r["rss_growth"]))))
    print("memory at marks (MiB): " + "; ".join(
        f"{m['minute']:g} min: " + ", ".join(mib(v) for v in m["rss"]) for m in r["rss_marks"]))
    print(f"memory slope after warm-up (t >= {r['warmup_s']:.0f} s, least squares over {r['samples_after_warmup']} "
          "samples): " + ", ".join(f"rank {i} " + ("-" if v is None else f"{v:+.2f} MiB/min")
                                   for i, v in enumerate(r["rss_slope_mib_per_min"])))
    print(f"peak RSS (MiB): {', '.join(mib(v) for v in r['rss_peak'])}; GetModelInfo peak_memory_bytes at start "
          f"{r['model_info_peak_memory_start']}, at end {r['model_info_peak_memory_end']}")
    first, last = r["samples"][0], r["samples"][-1]
    print(f"launcher: CPU {first['launcher_cpu_s']}->{last['launcher_cpu_s']} s over the soak; exit status after "
          f"SIGTERM {r['launcher_status']} in {r['stop_s']:.1f} s; restarts {r['restarts']}; processes left behind "
          f"{r['orphans']}")
    for e in r["error_messages"][:10]:
        print(f"  error: {e}")
    for w in r["wrong"][:5]:
        print(f"  wrong: {json.dumps(w)}")

