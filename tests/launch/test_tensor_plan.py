"""launch/tensor_plan.py: which links a hostfile gives, where tensor groups go, what each host holds
under --tensor-parallel-size, and the advice `trinity-launch plan` prints."""

import json

import pytest

from distributed.shard.sizes import model_sizes, quantize_config
from launch import bundled, hostfile
from launch.tensor_plan import active_bytes, advise, group_link, link, place, tensor_plan


def preset(name: str, bits: int = 4) -> dict:
    return quantize_config(json.loads(bundled.resolve("preset", name).read_text())["config"], bits)


def hosts(name: str) -> hostfile.Hostfile:
    return hostfile.load(bundled.resolve("hostfile", name))


def jaccl(rdma_pairs, n=4, backend="jaccl") -> hostfile.Hostfile:
    """n Macs, RDMA only between the pairs given (a device name both ways), null elsewhere."""
    rdma = [[None] * n for _ in range(n)]
    for a, b in rdma_pairs:
        rdma[a][b] = rdma[b][a] = f"rdma_en{a}{b}"
    return hostfile.parse({"backend": backend, "hosts": [
        {"ssh": f"mac{i}.local", "ips": [f"10.0.0.{i + 1}"], "rdma": rdma[i], "memory_gb": 64} for i in range(n)]})


def test_links_from_the_hostfile():
    four = hosts("jaccl-4macs")
    assert link(four, 0, 3) == "rdma" and group_link(four, [0, 1, 2, 3]) == "rdma"
    assert link(hosts("thunderbolt-ring-2macs"), 0, 1) == "tcp"
    assert link(hosts("localhost-2"), 0, 1) == "local"
    partial = jaccl([(0, 2), (1, 3)])
    assert link(partial, 0, 2) == "rdma" and link(partial, 0, 1) == "tcp"
    assert group_link(partial, [0, 1, 2]) == "tcp"  # a group waits for its slowest link


def test_groups_go_where_rdma_joins_them():
    """4 hosts in 2 groups of 2: rank 0's group is the host RDMA joins it with, the other two
    form the second (not the hostfile's order, over TCP)."""
    config = preset("trinity-large")
    assert place(jaccl([(0, 2), (1, 3)]), config, 2) == [[0, 2], [1, 3]]
    assert place(jaccl([(0, 1), (2, 3)]), config, 2) == [[0, 1], [2, 3]]
    assert place(jaccl([(0, 3), (1, 2)]), config, 4) == [[0, 1, 2, 3]]  # one group: nothing to place


def test_each_host_holds_its_share():
    config = preset("trinity-mini")
    sizes, four = model_sizes(config), hosts("jaccl-4macs")
    plan = tensor_plan(sizes, four, [[0, 1, 2, 3]], 4096, 0.1)
    whole = sizes.weight_bytes(0, 32, False)
    assert [(h.host, h.start, h.end) for h in plan.hosts] == [(f"mac{i}.local", 0, 32) for i in range(1, 5)]
    for h in plan.hosts:  # a quarter of every layer, the embedding and head whole
        assert h.weight_bytes == pytest.approx(whole / 4 + sizes.embed_head, rel=1e-6)
        assert h.cache_bytes == sizes.cache_bytes(0, 32, 4096) // 4
    assert plan.fits
    stages = tensor_plan(sizes, four, [[0, 1], [2, 3]], 4096, 0.1)
    assert [(h.start, h.end, h.weights["embed_head"] > 0) for h in stages.hosts] == [
        (0, 16, True), (0, 16, True), (16, 32, False), (16, 32, False)]


def test_active_bytes_count_only_the_routed_top_k():
    config = preset("trinity-mini")
    b = active_bytes(config)
    assert 1.0e9 < b["layers"] < 2.0e9  # Trinity-Mini: 3B active, 4-bit
    assert b["head"] == pytest.approx(200192 * 2048 * (0.5 + 4 / 64), rel=1e-3)
    assert b["layers"] < 0.2 * sum(model_sizes(config).layer_weight_bytes(l) for l in range(32))


def test_advice_follows_the_links():
    large = preset("trinity-large")
    rdma = advise(large, hosts("jaccl-4macs"))
    assert rdma.choice.tensor == 4 and rdma.choice.tok_s > 1.5 * rdma.options[0].tok_s
    assert "--tensor-parallel-size 4" in rdma.why
    # 2 x 2 needs Group.split, which JACCL lacks: shown, not chosen.
    two = next(o for o in rdma.options if o.tensor == 2)
    assert "Group.split" in two.refused
    tcp = advise(large, hosts("thunderbolt-ring-2macs"))
    assert tcp.choice.tensor == 1 and tcp.options[1].tok_s < tcp.options[0].tok_s
    local = advise(large, hosts("localhost-2"))  # one memory bus: nothing to gain
    assert local.choice.tensor == 1
    nano = advise(preset("trinity-nano"), hosts("jaccl-4macs"))
    assert "num_key_value_heads) = 2" in next(o for o in nano.options if o.tensor == 4).refused


def test_bandwidth_from_the_hostfile():
    hf = hostfile.parse([{"ssh": "a", "ips": ["10.0.0.1"], "bandwidth_gb_s": 819},
                         {"ssh": "b", "ips": ["10.0.0.2"], "bandwidth_gb_s": 273}])
    assert [h.bandwidth_gb_s for h in hf.hosts] == [819, 273]
    assert advise(preset("trinity-mini"), hf).bandwidth_gb_s == 273  # the slowest host sets the pace
    assert hostfile.to_json(hf)["hosts"][0]["bandwidth_gb_s"] == 819
    with pytest.raises(hostfile.HostfileError, match="bandwidth_gb_s must be a positive number"):
        hostfile.parse([{"ssh": "a", "ips": ["10.0.0.1"], "bandwidth_gb_s": 0}])


def plan_cli(capsys, *argv):
    from launch.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_launch_plan_advises_and_plans_a_tensor_group(capsys):
    """`trinity-launch plan` prints the advice; with --tensor-parallel-size, each host's share."""
    code, out, _ = plan_cli(capsys, "--preset", "trinity-large", "--quantize", "4", "--hostfile", "jaccl-4macs",
                            "--context", "8192")
    assert code == 1  # the pipeline over 48 + 48 + 24 + 24 GiB: Large does not fit, the advice still prints
    assert "choose: --tensor-parallel-size 4: about 1.8" in out
    code, out, _ = plan_cli(capsys, "--preset", "trinity-mini", "--quantize", "4", "--hostfile", "jaccl-4macs",
                            "--tensor-parallel-size", "4", "--json")
    data = json.loads(out)
    assert code == 0 and data["fits"] and data["tensor_parallel_size"] == 4
    assert [h["layers"] for h in data["hosts"]] == [[0, 32]] * 4
    assert data["advice"]["choice"] in (2, 4) and data["advice"]["options"][0]["tensor_parallel_size"] == 1
    code, _, err = plan_cli(capsys, "--preset", "trinity-nano", "--hostfile", "jaccl-4macs", "--tensor-parallel-size", "4")
    assert code != 0 and "num_key_value_heads) = 2" in err
    code, _, err = plan_cli(capsys, "--preset", "trinity-mini", "--memory-gb", "64,64,64", "--tensor-parallel-size", "2")
    assert code != 0 and "--tensor-parallel-size 2 must divide the number of hosts, 3" in err


def test_launch_run_passes_the_size_through_without_a_split(capsys, hf_checkpoint):
    """`launch run` plans no --split for a tensor-parallel command (the ranks split evenly), and
    a host set the size does not divide (a re-plan after a lost host) runs a size that divides it."""
    from distributed.command_line import read_command
    from launch.replan import DoesNotFit, Planner, drop_hosts
    from distributed.shard import checkpoint

    model, path, config = checkpoint.load_config(str(hf_checkpoint))
    sizes = checkpoint.tensor_sizes(model, path)
    command = ["python", "-m", "run_trinity", "--model", str(hf_checkpoint), "--tensor-parallel-size", "2"]
    two = hostfile.parse([{"ssh": h, "ips": [f"127.0.0.{i + 1}"], "memory_gb": 4} for i, h in enumerate("AB")])
    layout = Planner(command, config, sizes, 2048).lay_out(two)
    assert layout.command == command and layout.plan.fits
    assert [(h.start, h.end) for h in layout.plan.hosts] == [(0, 8), (0, 8)]
    one = Planner(command, config, sizes, 2048).lay_out(drop_hosts(two, {1}))
    settings = read_command(one.command).settings
    assert settings.ring.tensor_parallel_size == 1 and settings.ring.split == "8"
    tiny = hostfile.parse([{"ssh": h, "ips": [f"127.0.0.{i + 1}"], "memory_gb": 0.001} for i, h in enumerate("AB")])
    with pytest.raises(DoesNotFit):
        Planner(command, config, sizes, 2048).lay_out(tiny)


@pytest.mark.slow
def test_launch_run_restarts_a_tensor_parallel_ring(hf_checkpoint, tmp_path):
    """`launch run --single-host 2 --restart 1 -- run-trinity --tensor-parallel-size 2 --serve`:
    the ranks start with the size and no --split; rank 1 killed mid-stream, the restarted ring
    finishes the stream (the launcher's router replays it) with the undisturbed run's tokens."""
    import os
    import signal
    import urllib.request

    from grpc_stream import Stream
    from reference import PROMPT
    from router_launcher import Launcher, assert_same, serving

    launcher = Launcher(hf_checkpoint, tmp_path / "launch.log", 2, "--restart", "1",
                        serve_args=("--tensor-parallel-size", "2"))
    with serving(launcher):
        undisturbed = Stream(launcher.stub, token_ids=PROMPT, max_tokens=120, temperature=0.0)
        undisturbed.result()
        stream = Stream(launcher.stub, token_ids=PROMPT, max_tokens=120, temperature=0.0)
        stream.wait_tokens(12)
        before = launcher.ranks()
        os.kill(before[1], signal.SIGKILL)
        assert_same(stream, undisturbed)
        after = launcher.ranks()
        assert after[1] != before[1] and len(after) == 2
        assert "launch: router: replayed a request after" in launcher.output()
        assert "--split" not in launcher.output()
        with urllib.request.urlopen(f"http://{launcher.http}/v1/status", timeout=30) as r:  # the router's
            shares = [row["tensor"] for row in json.loads(r.read())["ranks"]]
        assert [(t["rank"], t["size"], t["heads"], t["kv_heads"], t["experts"]) for t in shares] == [
            (0, 2, [0, 2], [0, 1], 8), (1, 2, [2, 4], [1, 2], 8)]


def test_launch_run_notes_a_size_the_links_do_not_favour(capsys, hf_checkpoint, tmp_path):
    """Over TCP the speed model finds T = 2 slower than the pipeline: `launch run` says so (and runs it)."""
    from launch.cli import main

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": f"{h}.local", "ips": [f"10.0.0.{i + 1}"], "memory_gb": 1}
                                 for i, h in enumerate("ab")]))
    with pytest.raises(SystemExit) as e:
        main(["run", "--hostfile", str(hosts), "--dry-run", "--", "run-trinity", "--model", str(hf_checkpoint),
              "--tensor-parallel-size", "2", "--prompt", "hi"])
    out = capsys.readouterr()
    assert e.value.code == 0 and "--tensor-parallel-size 2" in out.out and "--split" not in out.out
    assert "launch: note: for one chat over these links the speed model advises the pipeline" in out.err
