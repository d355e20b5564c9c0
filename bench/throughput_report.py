"""bench_throughput.py's summary: checks of the runner's tokens against mlx-lm, the table
of speeds and memory per configuration, and the ratios against mlx-lm and P=1."""

import statistics

MIB = 2**20


def fmt_stream(s: dict) -> str:
    if "error" in s:
        return s["error"]
    return f"{s['aggregate_tps']:.1f} tok/s aggregate, {s['tokens']} tokens in {s['wall_s']:.2f} s, " \
           f"mean TTFT {s['mean_ttft_s'] * 1e3:.0f} ms"


def same_tokens(got: list, ref: list, eos: set) -> bool:
    """`got` (the runner, which stops at EOS and drops it) against `ref` (generate_step)."""
    if got != ref[: len(got)]:
        return False
    return len(got) == len(ref) or ref[len(got)] in eos


def median_of(runs: list, key: str):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(mlx: dict, runners: dict, eos: set, spec: dict) -> tuple:
    """Table rows (name -> numbers) and warnings."""
    rows, warnings = {}, []
    lens = [str(n) for n in spec["ttft_prompts"]]
    streams = [str(n) for n in spec["streams"]]
    if "error" not in mlx:
        hwm = mlx["vmhwm_bytes"]
        mem_mlx = {"mx_peak_load_mib": [mlx["mx_peak_load_bytes"] / MIB], "vmhwm_mib": [hwm and hwm / MIB]}
        rows["mlx-lm generate_step"] = dict(
            decode_tps=median_of(mlx["decode"], "decode_tps"),
            ttft_ms={n: median_of(mlx["ttft"][n], "ttft_s") * 1e3 for n in lens}, agg_tps={},
            tokens="ref", **mem_mlx)
        rows["mlx-lm batch_generate"] = dict(
            decode_tps=None, ttft_ms={}, agg_tps={n: mlx["batch"][n]["aggregate_tps"] for n in streams},
            tokens="-", **mem_mlx)
    for p, r in runners.items():
        name = f"runner P={p}"
        row = dict(decode_tps=None, ttft_ms={}, agg_tps={}, mean_stream_ttft_ms={}, tokens="?",
                   mx_peak_load_mib=[x["peak_memory_bytes"] / MIB for x in r.get("rank_map", [])],
                   vmhwm_mib=[x and x / MIB for x in r.get("vmhwm_bytes", [])])
        problems = [r["error"]] if r.get("error") else []
        if "decode" in r:
            row["decode_tps"] = median_of(r["decode"], "decode_tps")
        for n in lens:
            t = median_of(r.get("ttft", {}).get(n, []), "ttft_s")
            row["ttft_ms"][n] = t and t * 1e3
        for n in streams:
            s = r.get("streams", {}).get(n)
            if s and "error" in s:
                problems.append(f"{n} streams: {s['error']}")
            elif s:
                row["agg_tps"][n] = s["aggregate_tps"]
                row["mean_stream_ttft_ms"][n] = s["mean_ttft_s"] * 1e3 if s["mean_ttft_s"] is not None else None
        if "error" not in mlx and "decode" in r:
            checks = [same_tokens(d["token_ids"], mlx["decode"][0]["token_ids"], eos) for d in r["decode"]]
            checks += [same_tokens(t["token_ids"], mlx["ttft"][n][0]["token_ids"][:1], eos)
                       for n in lens if n in r.get("ttft", {}) for t in r["ttft"][n]]
            row["tokens"] = "yes" if all(checks) else "NO"
            if not all(checks):
                warnings.append(f"{name}: greedy single-stream tokens differ from mlx-lm generate_step "
                                f"(runner decode {r['decode'][0]['token_ids']} vs mlx-lm "
                                f"{mlx['decode'][0]['token_ids']})")
            # Streams vs batch_generate (informational).
            match = total = 0
            for n in streams:
                s = r.get("streams", {}).get(n)
                if s and "error" not in s:
                    for got, ref in zip(s["token_ids"], mlx["batch"][n]["token_ids"]):
                        total += 1
                        match += got == ref
            row["streams_equal_batch_generate"] = [match, total]
        row["error"] = "; ".join(problems) or None
        if problems:
            warnings.append(f"{name}: {row['error']}" + (f"\n{r['log_tail']}" if r.get("log_tail") else ""))
        rows[name] = row
    return rows, warnings


def ratios(rows: dict, spec: dict) -> dict:
    out = {}
    base = rows.get("mlx-lm generate_step", {}).get("decode_tps")
    p2 = rows.get("runner P=2", {}).get("decode_tps")
    if base and p2:
        out["decode_P2_over_mlx_lm"] = p2 / base
    out["agg8_over_agg1"] = {name: r["agg_tps"]["8"] / r["agg_tps"]["1"] for name, r in rows.items()
                             if "8" in r["agg_tps"] and "1" in r["agg_tps"]}
    longest = str(max(int(n) for n in spec["ttft_prompts"]))
    t1 = rows.get("runner P=1", {}).get("ttft_ms", {}).get(longest)
    t2 = rows.get("runner P=2", {}).get("ttft_ms", {}).get(longest)
    if t1 and t2:
        out[f"ttft{longest}_P2_over_P1"] = t2 / t1
    return out


def num(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def per_rank(values: list) -> str:
    return "/".join("?" if v is None else f"{v:.0f}" for v in values) if values else "-"


def print_table(rows: dict, spec: dict, rat: dict) -> None:
    lens = [str(n) for n in spec["ttft_prompts"]]
    streams = [str(n) for n in spec["streams"]]
    head = f"{'config':<23}{'decode tok/s':>13}" + "".join(f"{'TTFT@' + n + ' ms':>15}" for n in lens) \
        + "".join(f"{'agg@' + n:>9}" for n in streams) + f"  {'mx peak@load MiB/rank':<23}{'VmHWM MiB/rank':<16}tokens"
    print(head)
    for name, r in rows.items():
        print(f"{name:<23}{num(r['decode_tps']):>13}" + "".join(f"{num(r['ttft_ms'].get(n), '.0f'):>15}" for n in lens)
              + "".join(f"{num(r['agg_tps'].get(n)):>9}" for n in streams)
              + f"  {per_rank(r['mx_peak_load_mib']):<23}{per_rank(r['vmhwm_mib']):<16}{r['tokens']}"
              + ("  (error: see below)" if r.get("error") else ""))
    runner = {k: v for k, v in rows.items() if k.startswith("runner")}
    if runner:
        print("\nrunner, mean per-stream TTFT (ms) with n concurrent streams; streams whose tokens equal "
              "batch_generate's")
        print(f"{'config':<23}" + "".join(f"{'n=' + n:>9}" for n in streams) + "   =batch_generate")
        for name, r in runner.items():
            m = r.get("streams_equal_batch_generate")
            print(f"{name:<23}" + "".join(f"{num(r['mean_stream_ttft_ms'].get(n), '.0f'):>9}" for n in streams)
                  + (f"   {m[0]}/{m[1]}" if m else ""))
    print("\nratios (issue 5 targets)")
    if "decode_P2_over_mlx_lm" in rat:
        print(f"  single-stream decode, runner P=2 / mlx-lm generate_step: {rat['decode_P2_over_mlx_lm']:.2f}"
              "   (target >= 1.0)")
    for name, v in rat.get("agg8_over_agg1", {}).items():
        print(f"  aggregate@8 / aggregate@1, {name}: {v:.2f}   (target >= 4 for the runner)")
    for key, v in rat.items():
        if key.startswith("ttft"):
            print(f"  TTFT@{key[4:].split('_')[0]}, runner P=2 / P=1: {v:.2f}   (target < 1)")
