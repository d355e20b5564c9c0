"""Hostfile checks (mlx.launch's formats plus memory_gb and speed), and the shipped configs."""

import json
from pathlib import Path

import pytest
from mlx._distributed_utils.common import Hostfile as MlxHostfile

from launch import hostfile
from launch.hostfile import GIB, HostfileError
from trinity_configs import mini, nano

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "launch" / "configs"


def write(tmp_path, data, name="hosts.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def mac(name, ip, **extra):
    return {"ssh": name, "ips": [ip], **extra}


def test_both_formats_and_our_extra_keys(tmp_path):
    listed = hostfile.load(write(tmp_path, [mac("a", "10.0.0.1", memory_gb=64, speed=2), mac("b", "10.0.0.2")]))
    assert listed.backend == "ring" and listed.names == ["a", "b"]
    assert listed.hosts[0].memory_bytes == 64 * GIB and listed.hosts[0].speed == 2.0
    assert listed.hosts[1].memory_bytes is None and listed.hosts[1].speed == 1.0
    obj = hostfile.load(write(tmp_path, {"backend": "mpi", "envs": ["A=1"], "hosts": [{"ssh": "a", "memory_gb": 10.5}]}))
    assert obj.backend == "mpi" and obj.envs == ["A=1"] and obj.hosts[0].memory_bytes == int(10.5 * GIB)
    assert hostfile.load(write(tmp_path, [{"ssh": "a"}]), backend="mpi").backend == "mpi"  # command line wins


@pytest.mark.parametrize("data, message", [
    ("[{", "is not valid JSON"),
    ('"hosts"', "expected a JSON list of hosts"),
    ({"backend": "ring"}, 'needs a "hosts" list'),
    ({"hosts": {"ssh": "a"}}, '"hosts" must be a list'),
    ([], "no hosts"),
    (["a"], "host 0 must be an object"),
    ([{"ips": ["10.0.0.1"]}], 'host 0 has no "ssh"'),
    ([mac("a", "10.0.0.1"), {"ssh": "b"}], 'host 1 \\(b\\) has no "ips": the ring backend connects'),
    ({"backend": "ring", "hosts": [{"ssh": "a", "ips": []}]}, 'has no "ips"'),
    ([{"ssh": "a", "ips": ["mac-a.local"]}], "'mac-a.local' in \"ips\" is not an IP address"),
    ([{"ssh": "a", "ips": "10.0.0.1"}], '"ips" must be a list'),
    ([{"ssh": "a", "ips": ["10.0.0.1", "10.0.0.1"]}], "lists the same address twice"),
    ([mac("a", "10.0.0.1"), mac("a", "10.0.0.2")], "host 'a' is listed twice \\(ranks 0 and 1\\)"),
    ([mac("a", "10.0.0.1"), mac("b", "10.0.0.1")], "IP 10.0.0.1 is listed for both a \\(rank 0\\) and b \\(rank 1\\)"),
    ({"backend": "tcp", "hosts": [mac("a", "10.0.0.1")]}, "unknown backend 'tcp' \\(mlx.launch knows ring, mpi"),
    ([mac("a", "10.0.0.1", memory_gb=-4)], "memory_gb must be a positive number, got -4"),
    ([mac("a", "10.0.0.1", memory_gb="64GB")], "memory_gb must be a positive number, got '64GB'"),
    ([mac("a", "10.0.0.1", speed=0)], "speed must be a positive number"),
    ({"backend": "nccl", "hosts": [{"ssh": "a"}, mac("b", "10.0.0.2")]}, "needs rank 0 \\(a\\) to have an IP"),
    ({"backend": "jaccl", "hosts": [mac("a", "10.0.0.1", rdma=[None]), mac("b", "10.0.0.2", rdma=["x", None])]},
     "host 0 \\(a\\) lists 1 RDMA devices"),
    ({"backend": "jaccl", "hosts": [mac("a", "10.0.0.1", rdma=["x", "y"]), mac("b", "10.0.0.2", rdma=["x", None])]},
     "its own RDMA entry \\(position 0\\) must be null"),
    ({"envs": ["no equals sign here"], "hosts": [mac("a", "10.0.0.1")]}, '"envs" entries must be NAME=VALUE'),
])
def test_hostfile_errors(tmp_path, data, message):
    with pytest.raises(HostfileError, match=message):
        hostfile.load(write(tmp_path, data))


def test_missing_file_and_unknown_backend_flag(tmp_path):
    with pytest.raises(HostfileError, match="does not exist"):
        hostfile.load(tmp_path / "nope.json")
    with pytest.raises(HostfileError, match="unknown backend 'gloo'"):
        hostfile.load(write(tmp_path, [mac("a", "10.0.0.1")]), backend="gloo")


def test_repeats_allowed_where_they_mean_something(tmp_path, capsys):
    local = hostfile.load(write(tmp_path, [mac("127.0.0.1", "127.0.0.1")] * 3))
    assert [h.rank for h in local.hosts] == [0, 1, 2] and all(h.is_local for h in local.hosts)
    slots = hostfile.load(write(tmp_path, {"backend": "mpi", "hosts": [{"ssh": "a"}, {"ssh": "a"}]}))
    assert slots.names == ["a", "a"]
    hostfile.load(write(tmp_path, [mac("a", "10.0.0.1", memory_GB=64)]))
    assert "ignoring unknown key(s) memory_GB" in capsys.readouterr().err


def test_single_host():
    hf = hostfile.local_hosts(3)
    assert hf.names == ["127.0.0.1"] * 3 and hf.backend == "ring"
    with pytest.raises(HostfileError, match="at least 1 rank"):
        hostfile.local_hosts(0)


def test_shipped_hostfiles_parse_here_and_in_mlx_launch():
    files = sorted((CONFIGS / "hosts").glob("*.json"))
    assert {f.stem for f in files} >= {"thunderbolt-ring-2macs", "ethernet-4macs", "localhost-2", "localhost-4", "mpi-2macs"}
    for f in files:
        ours = hostfile.load(f)
        theirs = MlxHostfile.from_file(f)  # mlx.launch's own parser ignores memory_gb and speed
        assert [h.ssh_hostname for h in theirs.hosts] == ours.names
        assert (theirs.backend or "ring") == ours.backend


def test_presets_match_the_configs_the_tests_assume():
    for name, make in (("trinity-mini", mini), ("trinity-nano", nano)):
        preset = json.loads((CONFIGS / "presets" / f"{name}.json").read_text())
        expected = make()
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                    "num_shared_experts", "num_dense_layers", "vocab_size", "sliding_window", "layer_types",
                    "tie_word_embeddings", "torch_dtype"):
            assert preset["config"][key] == expected[key], (name, key)
        assert preset["sampling"] == {"temperature": 0.15, "top_k": 50, "top_p": 0.75, "min_p": 0.06}
        assert preset["context"] <= preset["config"]["max_position_embeddings"]
