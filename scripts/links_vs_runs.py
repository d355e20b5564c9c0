"""The planner's predicted decode tok/s with measured links against the runs' measured tok/s,
on two network-namespace "hosts" (tests/netns_hosts.py) joined by a shaped link
(tests/delay_line.py: this kernel has no tc netem), each rank pinned to its own core.

    python scripts/links_vs_runs.py [--delays 0.1,1,5] [--tokens 32] [--reps 2] [--out FILE]

Needs root (namespaces). For each one-way delay: `trinity-launch doctor` measures the link
(kept per hostfile), `trinity-launch plan --json` predicts the pipeline (P=2) and tensor
(T=2) from those links, and `trinity-launch run` decodes with each (greedy, --tokens tokens,
bench's float32 decode checkpoint: hidden 512, 16 layers, 32 experts). The hostfile's
bandwidth_gb_s is calibrated once so that the speed model's one-host prediction equals a
measured run on one host (pinned alike): the model is for memory-bound Macs, this CPU is
compute-bound, so only what the links add is the model's own claim here.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

PINNED_SSH = """case "$host" in *a) core=0;; *) core=1;; esac
exec ip netns exec "$host" taskset -c "$core" sh -c "$*"
"""


def launch(cache: Path, *args, timeout=900, check=True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(cache))
    done = subprocess.run([sys.executable, "-m", "launch", *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
    if done.returncode and check:
        sys.exit(f"launch {' '.join(args[:3])}: {done.stderr[-3000:]}")
    return done


def decode(cache, hostfile, ssh, model, tokens, *extra):
    """Decode tok/s of one greedy generation, or the launcher's last line when it failed."""
    done = launch(cache, "run", "--hostfile", str(hostfile), "--ssh", str(ssh), "--", "run-trinity", "--model",
                  str(model), "--prompt-ids", ",".join(str(i) for i in range(1, 17)), "--max-tokens", str(tokens),
                  "--temp", "0", "--json", "--peer-timeout", "60", *extra, check=False)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1], "loadavg": os.getloadavg()}
    return {"tok_s": json.loads(done.stdout.strip().splitlines()[-1])["generation_tokens_per_sec"],
            "loadavg": os.getloadavg()}


def one_host(hosts, model, tokens) -> float:
    """One process in host A, pinned to core 0: the calibration run."""
    cmd = ["ip", "netns", "exec", hosts.names[0], "taskset", "-c", "0", sys.executable, "-m", "run_trinity", "--model",
           str(model), "--prompt-ids", ",".join(str(i) for i in range(1, 17)), "--max-tokens", str(tokens), "--temp", "0",
           "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["generation_tokens_per_sec"]


def calibrated_bandwidth(config: dict, tok_s: float) -> float:
    """bandwidth_gb_s with which the speed model predicts `tok_s` on one host."""
    from launch.tensor_plan import EFFICIENCY, PER_LAYER_S, active_bytes

    b = active_bytes(config)
    memory_s = 1 / tok_s - config["num_hidden_layers"] * PER_LAYER_S
    return (b["layers"] + b["head"]) / (EFFICIENCY * memory_s) / 1e9


def main() -> None:
    from bench.harness import FULL, checkpoint
    from delay_line import delay_line
    from netns_hosts import SSH_HOST, namespace_hosts

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--delays", default="0.1,1,5")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default="links_vs_runs.json")
    args = p.parse_args()
    model = checkpoint(FULL)
    config = json.loads((model / "config.json").read_text())
    work = Path(f"/tmp/links-vs-runs-{os.getpid()}")
    work.mkdir()
    out = {"model": str(model), "tokens": args.tokens, "loadavg_before": os.getloadavg(), "delays": {}}
    with namespace_hosts(work, "ab") as hosts, delay_line(hosts, hosts.names) as line:
        ssh = work / "ssh-pinned"
        ssh.write_text(SSH_HOST + PINNED_SSH)
        ssh.chmod(0o755)
        alone = [one_host(hosts, model, args.tokens) for _ in range(args.reps)]
        print(f"one host: {alone} tok/s", flush=True)
        bandwidth = calibrated_bandwidth(config, statistics.median(alone))
        out.update(one_host_tok_s=alone, bandwidth_gb_s=bandwidth)
        hostfile = work / "hosts.json"
        hostfile.write_text(json.dumps([{"ssh": n, "ips": [line.ips[n]], "memory_gb": 8, "bandwidth_gb_s": bandwidth}
                                        for n in hosts.names]))
        for delay in (float(d) for d in args.delays.split(",")):
            line.set(delay_ms=delay)
            tic = time.perf_counter()
            report = json.loads(launch(work, "doctor", "--hostfile", str(hostfile), "--ssh", str(ssh), "--model",
                                       str(model), "--json").stdout)
            doctor_s = time.perf_counter() - tic
            advice = json.loads(launch(work, "plan", "--model", str(model), "--hostfile", str(hostfile),
                                       "--json").stdout)["advice"]
            predicted = {o["tensor_parallel_size"]: o["tok_s"] for o in advice["options"]}
            runs = {1: [], 2: []}
            for _ in range(args.reps):  # interleaved
                runs[1].append(decode(work, hostfile, ssh, model, args.tokens))
                runs[2].append(decode(work, hostfile, ssh, model, args.tokens, "--tensor-parallel-size", "2"))
            print(f"delay {delay} ms each way: link {report['links']['pairs'][0]['rtt_ms']:.2f} ms round trip "
                  f"(fastest {report['links']['pairs'][0]['rtt_min_ms']:.2f}), all-reduce "
                  f"{report['links']['all_reduce_ms']:.2f} ms; advice {advice['choice']}", flush=True)
            for name, tensor in (("pipeline", 1), ("tensor 2", 2)):
                ok = [r["tok_s"] for r in runs[tensor] if "tok_s" in r]
                print(f"  {name}: predicted {predicted[tensor]:.1f} tok/s, measured median "
                      f"{statistics.median(ok) if ok else float('nan'):.1f} of {json.dumps(runs[tensor])}", flush=True)
            row = {"doctor_s": doctor_s, "links": report["links"], "tcp": report["tcp"], "advice": advice["choice"],
                   "links_source": advice["links"],
                   "pipeline": {"predicted": predicted[1], "measured": runs[1]},
                   "tensor 2": {"predicted": predicted[2], "measured": runs[2]}}
            out["delays"][str(delay)] = row
        line.set(delay_ms=0)
    out["loadavg_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"one host {alone} tok/s -> bandwidth_gb_s {bandwidth:.3f}; wrote {args.out}")


if __name__ == "__main__":
    main()
