"""python -m launch plan|run: output, exact commands, refusals (in-process, nothing started)."""

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from distributed.shard.config import read_config
from distributed.shard.plan import GIB, plan_layers
from distributed.startup.auto_split import PLAN_ENV
from launch.cli import main
from launch.mlx_launch_ring import exit_status, failed_ranks, mlx_launch

ROOT = Path(__file__).resolve().parents[2]


def cli(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def hostfile(tmp_path, hosts, name="hosts.json"):
    path = tmp_path / name
    path.write_text(json.dumps(hosts))
    return str(path)


def test_plan_json_from_a_checkpoint(capsys, hf_checkpoint):
    code, out, _ = cli(capsys, "plan", "--model", str(hf_checkpoint), "--memory-gb", "2,1", "--context", "64", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["fits"] is True and data["source"] == "tensors" and data["context"] == 64
    assert [h["memory_bytes"] for h in data["hosts"]] == [2 * GIB, GIB]
    assert data["hosts"][0]["layers"][0] == 0 and data["hosts"][-1]["layers"][1] == 8
    expected = plan_layers(read_config(hf_checkpoint), [2 * GIB, GIB], context=64)
    assert [h["layers"] for h in data["hosts"]] == [h.layers for h in expected.hosts]


def test_plan_preset_text_and_hostfile(capsys):
    code, out, _ = cli(capsys, "plan", "--preset", "trinity-mini", "--hostfile",
                       "thunderbolt-ring-2macs", "--quantize", "4")
    assert code == 0
    assert "studio.local" in out and "mini.local" in out and "context 32768 tokens" in out and "fits" in out


def test_plan_that_does_not_fit_exits_nonzero(capsys):
    code, out, err = cli(capsys, "plan", "--preset", "trinity-mini", "--memory-gb", "16,16,16", "--json")
    assert code == 1 and json.loads(out)["fits"] is False
    assert "does not fit" in err and "host host0 (rank 0) needs" in err and "missing" in err


def test_plan_needs_memory_for_remote_hosts(capsys, tmp_path):
    hosts = hostfile(tmp_path, [{"ssh": "a", "ips": ["10.0.0.1"], "memory_gb": 32}, {"ssh": "b", "ips": ["10.0.0.2"]}])
    code, _, err = cli(capsys, "plan", "--preset", "trinity-nano", "--hostfile", hosts)
    assert code == 2 and "host b (rank 1) has no memory_gb" in err


def test_run_hostfile_errors_are_clear(capsys, tmp_path):
    hosts = hostfile(tmp_path, [{"ssh": "a"}, {"ssh": "b"}])
    code, _, err = cli(capsys, "run", "--hostfile", hosts, "--dry-run", "--", "run_trinity.py")
    assert code == 2 and 'launch: error:' in err and 'has no "ips": the ring backend' in err
    code, _, err = cli(capsys, "run", "--hostfile", hosts, "--backend", "gloo", "--dry-run", "--", "run_trinity.py")
    assert code == 2 and "unknown backend 'gloo'" in err


def test_dry_run_prints_the_exact_command(capsys, hf_checkpoint):
    model = str(hf_checkpoint)
    code, out, err = cli(capsys, "run", "--single-host", "2", "--starting-port", "5000", "--via", "mlx.launch",
                         "--dry-run", "--", "run_trinity.py", "--model", model, "--prompt", "Hi there")
    assert code == 0
    split = plan_layers(read_config(hf_checkpoint), [GIB, GIB], context=4096).split
    rank_cmd = [sys.executable, "run_trinity.py", "--model", model, "--prompt", "Hi there",
                "--max-context", "4096", "--split", ",".join(map(str, split))]
    assert out.strip() == shlex.join([mlx_launch(), "-n", "2", "--starting-port", "5000", "--", *rank_cmd])
    assert "split " + ",".join(map(str, split)) in err  # the plan, on stderr

    # By default local ring ranks start directly (MLX_RANK, MLX_HOSTFILE), without mlx.launch.
    code, out, _ = cli(capsys, "run", "--single-host", "2", "--starting-port", "5000", "--dry-run", "--",
                       "run_trinity.py", "--model", model, "--prompt", "Hi there")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0] == '# MLX_HOSTFILE: a file holding [["127.0.0.1:5000"], ["127.0.0.1:5001"]]'
    for rank, line in enumerate(lines[1:]):
        cmd = shlex.split(line)
        assert cmd[:2] == ["env", f"MLX_RANK={rank}"] and cmd[2].startswith("TRINITY_CONTROL_ADDR=127.0.0.1:")
        assert cmd[-len(rank_cmd):] == rank_cmd
    assert len(lines) == 3
    code, _, err = cli(capsys, "run", "--single-host", "2", "--backend", "mpi", "--via", "direct", "--dry-run",
                       "--", "run_trinity.py")
    assert code == 2 and "--via direct needs the ring backend" in err


def test_dry_run_preset_hostfile_and_mpi(capsys, tmp_path, hf_checkpoint):
    hosts = hostfile(tmp_path, [{"ssh": "a", "memory_gb": 8}, {"ssh": "b", "memory_gb": 4, "speed": 2}])
    code, out, _ = cli(capsys, "run", "--hostfile", hosts, "--backend", "mpi", "--preset", "trinity-nano", "--dry-run",
                       "--", "run_trinity.py", "--model", str(hf_checkpoint), "--temp", "0")
    assert code == 0
    cmd = shlex.split(out)
    assert cmd[:5] == [mlx_launch(), "--hostfile", hosts, "--backend", "mpi"]
    assert cmd[cmd.index("--") + 1:][:4] == [sys.executable, "-m", "launch.guard", "--"]
    tail = " ".join(cmd[cmd.index("run_trinity.py"):])
    assert "--temp 0 " in tail and "--temp 0.15" not in tail  # the command's own flags win
    assert "--top-k 50 --top-p 0.75 --min-p 0.06" in tail
    assert "--max-context 4096" in tail  # the preset's 32768, capped at the model's max_position_embeddings
    assert "--split " in tail


def test_dry_run_unknown_memory_plans_at_startup(capsys, tmp_path, hf_checkpoint):
    hosts = hostfile(tmp_path, [{"ssh": "a", "ips": ["10.0.0.1"], "memory_gb": 8}, {"ssh": "b", "ips": ["10.0.0.2"]}])
    code, out, err = cli(capsys, "run", "--hostfile", hosts, "--context", "512", "--via", "mlx.launch", "--dry-run",
                         "--", "run_trinity.py", "--model", str(hf_checkpoint))
    assert code == 0 and "measure it and plan at start-up" in err
    cmd = shlex.split(out)
    assert cmd[-2:] == ["--split", "auto"] and "--max-context" in cmd
    env = cmd[cmd.index("--env") + 1]
    assert env.startswith(PLAN_ENV + "=")
    spec = json.loads(env.split("=", 1)[1])
    assert spec == {"hosts": [{"host": "a", "memory_bytes": 8 * GIB, "speed": 1.0},
                              {"host": "b", "memory_bytes": None, "speed": 1.0}], "margin": 0.1, "context": 512}


def test_dry_run_remote_hosts_start_over_ssh(capsys, tmp_path, monkeypatch):
    """Remote hosts of the ring backend: one ssh command per rank (--ssh, else $TRINITY_SSH),
    exporting mlx.launch's environment and rank 0's control address."""
    hosts = hostfile(tmp_path, {"hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}],
                                "envs": ["X=1 2"]})
    monkeypatch.setenv("TRINITY_SSH", "ssh -p 2222")
    code, out, _ = cli(capsys, "run", "--hostfile", hosts, "--starting-port", "5000", "--no-plan", "--dry-run",
                       "--", "echo", "hi")
    assert code == 0
    assert out.startswith('# ring [["10.0.0.1:5000"], ["10.0.0.2:5001"]]; control 10.0.0.1:')
    control = out.split("control ")[1].split()[0]
    for rank, host in enumerate("ab"):
        assert f"# rank {rank}: ssh -p 2222 -T -o BatchMode=yes -o LogLevel=ERROR {host} 'sh -c SCRIPT'" in out
    assert out.count(f"export TRINITY_CONTROL_ADDR={control}\n") == 2 and out.count("export X='1 2'\n") == 2
    assert "export MLX_RANK=0\n" in out and "export MLX_RANK=1\n" in out and "echo hi </dev/null &" in out
    code, out, _ = cli(capsys, "run", "--hostfile", hosts, "--ssh", "myssh -F cfg", "--no-plan", "--dry-run",
                       "--", "echo", "hi")
    assert code == 0 and "# rank 1: myssh -F cfg -T" in out
    code, out, _ = cli(capsys, "run", "--hostfile", hosts, "--via", "mlx.launch", "--no-plan", "--dry-run",
                       "--", "echo", "hi")
    assert code == 0 and shlex.split(out)[:3] == [mlx_launch(), "--hostfile", hosts]


def test_run_refuses_a_plan_that_does_not_fit(capsys, tmp_path, hf_checkpoint):
    hosts = hostfile(tmp_path, [{"ssh": "a", "ips": ["10.0.0.1"], "memory_gb": 0.001},
                                {"ssh": "b", "ips": ["10.0.0.2"], "memory_gb": 0.001}])
    code, out, err = cli(capsys, "run", "--hostfile", hosts, "--dry-run", "--", "run_trinity.py", "--model", str(hf_checkpoint))
    assert code == 1 and out == "" and "does not fit" in err and "missing" in err


def test_user_split_and_no_plan_are_left_alone(capsys):
    code, out, _ = cli(capsys, "run", "--single-host", "2", "--dry-run", "--", "run_trinity.py", "--split", "3,5")
    assert code == 0 and shlex.split(out)[-2:] == ["--split", "3,5"] and "--max-context" not in out
    code, out, _ = cli(capsys, "run", "--single-host", "2", "--no-plan", "--via", "mlx.launch", "--dry-run",
                       "--", "echo", "hi")
    assert code == 0 and shlex.split(out)[-3:] == ["--", "echo", "hi"]


def test_failed_ranks_from_launcher_output():
    ring = ("\x1b[33m[WARN] Node with rank 1 exited with code 3 \x1b[0m\n"
            "\x1b[33m[WARN] Node with rank 0 was killed \x1b[0m\n")
    assert failed_ranks(ring) == {1: 3} and exit_status(failed_ranks(ring), 0) == 3
    assert failed_ranks("[WARN] Node with rank 2 was killed") == {2: 1}
    assert failed_ranks("[WARN] Node with rank 0 exited with code -9") == {0: -9}
    assert exit_status({0: -9}, 0) == 137
    assert exit_status({0: -15, 1: 3}, 0) == 3  # the SIGTERM mlx.launch sent rank 0 is not the cause
    assert failed_ranks("launch: rank 1 exited with code 2\n") == {1: 2}
    mpi = "prterun detected that one or more processes exited with non-zero status,\n   Exit code:    4\n"
    assert failed_ranks(mpi) == {-1: 4}
    assert failed_ranks("all good\n[INFO] Node with rank 0 completed") == {} and exit_status({}, 0) == 0


def test_run_trinity_command_runs_as_a_module_of_the_ranks_interpreter(capsys):
    """The console script is on this environment's PATH only: remote hosts get `PYTHON -m run_trinity`."""
    code, out, _ = cli(capsys, "run", "--single-host", "2", "--no-plan", "--via", "mlx.launch", "--python",
                       "/opt/env/bin/python", "--dry-run", "--", "run-trinity", "--prompt", "Hi")
    assert code == 0
    assert shlex.split(out)[-5:] == ["/opt/env/bin/python", "-m", "run_trinity", "--prompt", "Hi"]


def test_bundled_names_and_a_missing_one(capsys):
    code, out, _ = cli(capsys, "plan", "--preset", "trinity-nano.json", "--hostfile", "localhost-2", "--json")
    assert code == 0 and [h["host"] for h in json.loads(out)["hosts"]] == ["127.0.0.1", "127.0.0.1"]
    code, _, err = cli(capsys, "plan", "--preset", "trinity-huge", "--memory-gb", "8")
    assert code == 2 and err.strip() == ("launch: error: preset trinity-huge does not exist, and no bundled preset "
                                         "has that name (bundled: trinity-large, trinity-mini, trinity-nano)")
    code, _, err = cli(capsys, "run", "--hostfile", "nowhere/hosts.json", "--dry-run", "--", "run-trinity")
    assert code == 2 and "hostfile nowhere/hosts.json does not exist" in err and "localhost-2" in err


def test_help_shows_defaults_and_names_docs_pages_that_exist(capsys):
    outs = []
    for verb in ([], ["plan"], ["run"]):
        with pytest.raises(SystemExit):
            main([*verb, "--help"])
        outs.append(" ".join(capsys.readouterr().out.split()))
    top, plan, run = outs
    assert "(default: 0.1)" in plan and "--restart N" in run and "(default: 0)" in run and "(default: auto)" in run
    assert "(default: None)" not in plan + run
    pages = re.findall(r'"([^"]+)"', top[top.index("more in the docs"):])
    assert pages and all((ROOT / "docs" / page).is_file() for page in pages), pages


def test_plan_reports_the_longest_context_each_batch_gets(capsys):
    """The context `--max-context auto` would give on these hosts: for 8 sequences on three
    96 GB Macs Trinity-Large's full-attention caches bind; for one, the model's own limit."""
    from distributed.shard.memory import longest_context

    code, out, _ = cli(capsys, "plan", "--preset", "trinity-large", "--memory-gb", "96,96,96", "--quantize", "4", "--json")
    plan = json.loads(out)
    rows = [{"layers": h["layers"], "parameter_bytes": h["weight_bytes"]} for h in plan["hosts"]]
    memory = [h["memory_bytes"] for h in plan["hosts"]]
    from launch.bundled import resolve

    config = json.loads(resolve("preset", "trinity-large").read_text())["config"]
    from distributed.shard.sizes import quantize_config

    config = quantize_config(config, 4)
    expected = {str(b): longest_context(config, rows, memory, b, 262144).context for b in (1, 8, 32)}
    assert code == 0 and plan["longest_context"] == expected
    assert expected["1"] == 262144 > expected["8"] > expected["32"] > 0
    code, out, _ = cli(capsys, "plan", "--preset", "trinity-large", "--memory-gb", "96,96,96", "--quantize", "4")
    assert f"{expected['8']} tokens for 8 sequences" in out


def test_plan_with_kv_bits_fits_longer_contexts(capsys):
    """--kv-bits: the full-attention caches at 8 and 4 bits hold more tokens in the same memory."""
    longest = {}
    for bits in ([], ["--kv-bits", "8"], ["--kv-bits", "4"]):
        code, out, _ = cli(capsys, "plan", "--preset", "trinity-large", "--memory-gb", "96,96,96", "--quantize", "4",
                           "--json", *bits)
        assert code == 0
        longest[tuple(bits)] = json.loads(out)["longest_context"]["32"]
    assert longest[()] < longest[("--kv-bits", "8")] < longest[("--kv-bits", "4")]


def test_plan_counts_the_draft_model_on_rank_0(capsys, tmp_path):
    """Trinity-Large over four 128 GB Macs with Trinity-Nano (4-bit) as its draft: rank 0
    holds the draft's weights and one speculating sequence's caches per rank at the plan's
    context beside its layers, and takes no more layers for it."""
    from distributed.shard.draft import draft_bytes
    from distributed.shard.sizes import quantize_config
    from trinity_configs import nano

    draft = quantize_config(nano(), 4)
    (tmp_path / "config.json").write_text(json.dumps(draft))
    base = ["plan", "--preset", "trinity-large", "--memory-gb", "128,128,128,128", "--quantize", "4", "--json"]
    code, out, _ = cli(capsys, *base)
    alone = json.loads(out)
    code_with, out, _ = cli(capsys, *base, "--draft-model", str(tmp_path))
    plan = json.loads(out)
    assert code == code_with == 0 and plan["fits"]
    rank0 = plan["hosts"][0]
    assert rank0["draft_bytes"] == draft_bytes(draft, plan["context"], 4) > 3 * 2**30
    assert [h["draft_bytes"] for h in plan["hosts"][1:]] == [0, 0, 0]
    assert rank0["layers"][1] <= alone["hosts"][0]["layers"][1]
    assert rank0["headroom_bytes"] == rank0["memory_bytes"] - rank0["weight_bytes"] - rank0["cache_bytes"] - rank0["draft_bytes"]


def test_the_ranks_command_is_read_as_the_ranks_read_it(capsys, hf_checkpoint):
    """run-trinity's own parser reads the ranks' command: a flag given twice counts by its last value,
    an abbreviation as its flag, and what run-trinity would refuse is refused before anything starts."""
    code, out, _ = cli(capsys, "run", "--single-host", "2", "--dry-run", "--", "run_trinity.py", "--split", "2,6",
                       "--spl", "3,5")
    assert code == 0 and "--max-context" not in out  # the user's split: nothing planned
    code, out, err = cli(capsys, "run", "--single-host", "2", "--via", "mlx.launch", "--dry-run", "--",
                         "run_trinity.py", "--model", "nowhere", "--model", str(hf_checkpoint), "--max-context=64")
    assert code == 0 and "context 64 tokens" in err and "split 4,4" in err  # planned from the last --model
    assert shlex.split(out)[-3:] == ["--max-context=64", "--split", "4,4"]
    code, _, err = cli(capsys, "run", "--single-host", "2", "--dry-run", "--", "run_trinity.py", "--max-context", "x")
    assert code == 2 and "launch: error: the ranks' command: argument --max-context: expected a token count or " \
                         "auto, got 'x'" in err
    code, _, err = cli(capsys, "run", "--single-host", "2", "--dry-run", "--", "run_trinity.py", "--se", "a:1")
    assert code == 2 and "ambiguous option: --se could match --seed, --serve" in err


def test_the_router_takes_the_last_serve_and_every_http_from_the_ranks():
    from distributed.command_line import read_command
    from launch.hostfile import local_hosts
    from launch.router.command import plan_router

    cmd = ["python", "-m", "run_trinity", "--serve", "127.0.0.1:1", "--htt=127.0.0.1:2", "--prompt-lookup",
           "--serve=127.0.0.1:3", "--max-queue", "5", "--http", "127.0.0.1:4"]
    plan = plan_router(cmd, local_hosts(2))
    assert (plan.options.grpc_address, plan.options.http_address, plan.options.max_queue) == ("127.0.0.1:3",
                                                                                              "127.0.0.1:4", 5)
    assert plan.command == ["python", "-m", "run_trinity", "--prompt-lookup", "--max-queue", "5",
                            "--serve", plan.upstream]
    assert read_command(plan.command).settings.serving.serve == plan.upstream
