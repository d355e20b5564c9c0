"""`python -m launch run` really starting ranks, and the start-up memory exchange."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from conftest import free_port_range
from distributed.shard.config import read_config
from distributed.shard.memory import gather_memory, share_by_host, usable_memory_bytes
from distributed.shard.plan import GIB, plan_layers
from distributed.shard.tiny_checkpoint import tiny_config
from distributed.startup.auto_split import PLAN_ENV, plan_spec, startup_plan
from launch.hostfile import local_hosts

ROOT = Path(__file__).resolve().parents[2]


def launch(args, env=None, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "launch", "run", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_single_host_2_end_to_end(hf_checkpoint):
    proc = launch(["--single-host", "2", "--starting-port", str(free_port_range(2)), "--",
                   "run_trinity.py", "--model", str(hf_checkpoint), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert len(result["token_ids"]) == 2
    expected = plan_layers(read_config(hf_checkpoint), [GIB, GIB], context=4096)
    assert [r["layers"] for r in result["ranks"]] == [h.layers for h in expected.hosts]
    assert [r["rank"] for r in result["ranks"]] == [0, 1]  # two real ranks answered
    assert "split " + ",".join(map(str, expected.split)) in proc.stderr


RANK_SCRIPT = """
import json, os, sys
import mlx.core as mx
from distributed.shard.memory import gather_memory
group = mx.distributed.init()
memories = gather_memory(group, nbytes=(group.rank() + 1) * 2**33 + 5, host=os.environ["FAKE_HOST"])
with open(os.path.join(sys.argv[1], f"rank{group.rank()}.json"), "w") as f:
    json.dump({"size": group.size(), "memories": memories, "measured": gather_memory(group)}, f)
sys.exit(3 if group.rank() == 1 else 0)
"""


def test_memory_exchange_and_a_failing_rank(tmp_path):
    """Two ranks exchange memory figures (beyond 32 bits); rank 1 then exits 3, which
    mlx.launch alone would report as success."""
    script = tmp_path / "rank_memory.py"
    script.write_text(RANK_SCRIPT)
    proc = launch(["--single-host", "2", "--no-plan", "--starting-port", str(free_port_range(2)), "--",
                   str(script), str(tmp_path)], env={"FAKE_HOST": "same-machine"})
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "rank 1 exited with code 3" in proc.stderr and "launch: rank 1 failed with exit status 3" in proc.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1] and ranks[0]["size"] == 2
    # One host: both ranks share the smaller figure (16 GiB + 5 bytes), half each.
    assert ranks[0]["memories"] == [(2**33 + 5) // 2] * 2
    measured = ranks[0]["measured"]
    assert measured[0] == measured[1] and 0.25 * usable_memory_bytes() < measured[0] < 0.75 * usable_memory_bytes()


def test_startup_plan_in_one_process(monkeypatch):
    """Hostfile memory wins over the measured figure; speeds, names, margin and context come along."""
    hosts = local_hosts(1).hosts
    hosts[0].memory_bytes, hosts[0].speed = 3 * GIB, 2.0
    monkeypatch.setenv(PLAN_ENV, plan_spec(hosts, 0.2, 64))
    plan = startup_plan(tiny_config(), mx.distributed.init())
    assert plan.context == 64 and plan.margin == 0.2 and plan.split == [8]
    assert (plan.hosts[0].memory_bytes, plan.hosts[0].speed, plan.hosts[0].host) == (3 * GIB, 2.0, "127.0.0.1")
    monkeypatch.delenv(PLAN_ENV)
    measured = startup_plan(tiny_config(), mx.distributed.init(), context=128)
    assert measured.context == 128 and measured.hosts[0].memory_bytes > 0 and measured.hosts[0].host == "rank0"


def test_memory_helpers_in_one_process():
    assert usable_memory_bytes() > 0
    assert share_by_host([8, 6, 4], ["a", "a", "b"]) == [3, 3, 4]
    group = mx.distributed.init()  # a single rank
    assert gather_memory(group, nbytes=5 * GIB + 7, host="h") == [5 * GIB + 7]


def test_rank_0_reads_our_stdin(hf_checkpoint):
    """run_trinity.py --chat under launch run: rank 0 has the launcher's stdin; its end ends the chat."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "launch", "run", "--single-host", "2", "--starting-port",
                           str(free_port_range(2)), "--", "run_trinity.py", "--model", str(hf_checkpoint), "--chat",
                           "--max-tokens", "3"], input="hello\n", capture_output=True, text=True, timeout=240,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(">>> ") == 2 and "prompt tokens (0 cached), 3 generated" in proc.stderr, proc.stderr
