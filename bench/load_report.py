"""bench_load.py's summary: per configuration, prompt length and stream count the aggregate tok/s,
TTFT p50 / p99, the exactness counts and the ratios against mlx-lm, against P=1 (of the same
checkout) and, with --baseline, of this checkout against the other at the same P; the TTFT
under load against TTFT alone; the long prompts' TTFT. Every number here comes from the raw
results, which go to the JSON file as they are."""

from common import percentile

BASELINE = "mlx-lm"


def stream_row(run: dict) -> dict:
    """One run's numbers; `exact` = streams equal to their prompt run alone on the same config."""
    if run is None:
        return None
    alone = run.get("alone", [])
    same = sum(run["token_ids"][k] == tokens for k, tokens in enumerate(alone))
    ttfts, itl = run["ttfts_s"], run.get("itl_s") or {}
    return {"tok_s": run["aggregate_tps"], "p50_ms": ms(percentile(ttfts, 50)), "p99_ms": ms(percentile(ttfts, 99)),
            "itl_p50_ms": ms(itl.get("p50")), "itl_p99_ms": ms(itl.get("p99")), "exact": [same, len(alone)]}


def ms(seconds):
    return None if seconds is None else seconds * 1e3


def ratio(a, b):
    return a / b if a is not None and b else None


def pick(counts: list, wanted: int):
    """`wanted` if it was measured, else the largest count measured (None if none)."""
    return wanted if wanted in counts else (max(counts) if counts else None)


def p1_of(name: str, names) -> str:
    """The P=1 configuration of `name`'s checkout ("runner P=2 (ring)" -> "runner P=1"), if measured."""
    prefix = name.split(" P=")[0] + " P=1"
    return next((n for n in names if n.startswith(prefix)), None)


def summarize(results: dict, spec: dict) -> dict:
    """results: config name -> load_measure output. Returns the table, the per-length TTFT
    ratios, the long-prompt rows and the exactness against mlx-lm, all JSON-ready."""
    table = []
    for name, res in results.items():
        p1 = p1_of(name, results)
        other = name.replace("runner", "baseline", 1) if name.startswith("runner") else None  # --baseline
        for length in spec["prompt_lens"]:
            for n in spec["streams"]:
                row = stream_row(res.get("streams", {}).get(str(length), {}).get(str(n)))
                if row is None:
                    continue
                base, one, theirs = (stream_row(results.get(c, {}).get("streams", {}).get(str(length), {}).get(str(n)))
                                     for c in (BASELINE, p1, other))
                row.update(config=name, prompt_len=length, streams=n,
                           vs_mlx_lm=ratio(row["tok_s"], base and base["tok_s"]) if name != BASELINE else None,
                           vs_p1=ratio(row["tok_s"], one and one["tok_s"]) if name not in (BASELINE, p1) else None,
                           vs_base=ratio(row["tok_s"], theirs and theirs["tok_s"]))
                table.append(row)
    at, burst = pick(spec["streams"], 64), pick(spec["streams"], 32)
    load = []
    for name, res in results.items():
        for length in spec["prompt_lens"] if spec["streams"] else []:
            runs = res.get("streams", {}).get(str(length), {})
            p50 = {n: percentile(runs[str(n)]["ttfts_s"], 50) for n in spec["streams"] if str(n) in runs}
            load.append({"config": name, "prompt_len": length, "at": at, "p50_ms_at": ms(p50.get(at)),
                         "burst": burst, "burst_over_alone": ratio(p50.get(burst), p50.get(1))})
    long_rows = []
    for length in spec["long"]:
        row = {"prompt_len": length}
        for name, res in results.items():
            row[name] = ms(res.get("long", {}).get(str(length), {}).get("median_ttft_s"))
        long_rows.append(row)
    return {"table": table, "ttft_under_load": load, "long": long_rows, "vs_mlx_lm_alone": against_mlx_lm(results)}


def against_mlx_lm(results: dict) -> dict:
    """Each runner's prompts alone against mlx-lm generate_step's alone: [equal, compared]."""
    ref = results.get(BASELINE, {}).get("streams", {})
    out = {}
    for name, res in results.items():
        if name == BASELINE:
            continue
        same = total = 0
        for length, runs in res.get("streams", {}).items():
            for n, run in runs.items():
                theirs = ref.get(length, {}).get(n, {}).get("alone", [])
                for mine, other in zip(run.get("alone", []), theirs):
                    same, total = same + (mine == other), total + 1
        out[name] = [same, total]
    return out


def num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(head: list, rows: list) -> None:
    """Columns as wide as their widest cell; the first left-aligned, the others right-aligned."""
    cells = [head] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    for r in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


def print_report(summary: dict, results: dict, spec: dict) -> None:
    names = list(results)
    if summary["table"]:
        print_streams(summary, spec)
    if summary["long"]:
        print_long(summary["long"], names, spec)
    exact = summary["vs_mlx_lm_alone"]
    if any(total for _, total in exact.values()):
        print("\nrunner alone vs mlx-lm generate_step alone (same prompts): " +
              ", ".join(f"{n} {s}/{t}" for n, (s, t) in exact.items()))
    for name, res in results.items():
        if res.get("error"):
            print(f"\n{name} FAILED: {res['error']}")


def print_streams(summary: dict, spec: dict) -> None:
    print()
    rows = summary["table"]
    with_base = any(r.get("vs_base") is not None for r in rows)
    print_table(["config", "prompt", "streams", "tok/s", "TTFT p50 ms", "p99 ms", "ITL p50 ms", "p99 ms", "exact",
                 "x mlx-lm", "x P=1"] + (["x base"] if with_base else []),
                [[r["config"], str(r["prompt_len"]), str(r["streams"]), num(r["tok_s"], ".1f"), num(r["p50_ms"], ".0f"),
                  num(r["p99_ms"], ".0f"), num(r.get("itl_p50_ms"), ".0f"), num(r.get("itl_p99_ms"), ".0f"),
                  "%d/%d" % tuple(r["exact"]), num(r["vs_mlx_lm"], ".2f"),
                  num(r["vs_p1"], ".2f")] + ([num(r.get("vs_base"), ".2f")] if with_base else []) for r in rows])
    gap = spec.get("arrival_gap") or 0
    print("  tok/s = generated tokens / (last stream's end - first request); TTFT = request sent -> first token "
          "(client side); ITL = the gaps between a stream's tokens, all streams (runners; mlx-lm's batch "
          "call has none)" + (f"; stream i arrived {gap} s x i after the first (--arrival-gap)" if gap else "")
          + "; p99 is nearest-rank (the max below 100 streams); exact = streams whose greedy tokens "
          f"equal the same prompt run alone on that config (the first {spec['check']} of each run); "
          "x mlx-lm, x P=1" + (", x base (this checkout / --baseline's at the same P)" if with_base else "")
          + ": tok/s ratios")
    load = summary["ttft_under_load"]
    if load:
        at, burst = load[0]["at"], load[0]["burst"]
        print()
        print_table(["config", "prompt", f"TTFT p50 at {at} streams, ms", f"TTFT p50 {burst} at once / 1 alone"],
                    [[r["config"], str(r["prompt_len"]), num(r["p50_ms_at"], ".0f"), num(r["burst_over_alone"], ".2f")]
                     for r in load])


def short(name: str) -> str:
    """"runner P=2 (nccl)" -> "P=2"; "baseline P=2 (nccl)" -> "baseline P=2"."""
    return name.split()[1] if name.startswith("runner ") else " ".join(name.split()[:2])


def print_long(rows: list, names: list, spec: dict) -> None:
    p1 = p1_of("runner", names)
    vs_base = p1 if p1 and BASELINE in names else None
    others = [n for n in names if n != BASELINE and p1_of(n, names) not in (None, n)]  # against their P=1
    print(f"\nlong prompt alone, TTFT ms (max_tokens 1, prefill step {spec['prefill_step_size']}, "
          f"median of {spec['reps']})")
    head = ["tokens", *names] + (["P=1 / mlx-lm"] if vs_base else []) + [f"{short(n)} / P=1" for n in others]
    print_table(head, [[str(r["prompt_len"]), *(num(r[n], ".0f") for n in names)] +
                       ([num(ratio(r[p1], r[BASELINE]), ".2f")] if vs_base else []) +
                       [num(ratio(r[n], r[p1_of(n, names)]), ".2f") for n in others] for r in rows])
