"""Re-planning without a lost host (launch/replan.py), in one process: the hostfile less a
host, the command laid out for the rest, and the Replanner's verdicts. Hosts that do not
answer are real ones of a kind: a listener on a loopback address whose accept queue is
full drops the probe's SYN, as a powered-off host would. The real thing, three hosts as
network namespaces with one cut off, is tests/launch/test_replan_netns.py."""

import json
import socket
import time

import pytest

from distributed.command_line import read_command
from distributed.shard import checkpoint
from distributed.startup.auto_split import PLAN_ENV
from launch import cli, hostfile
from launch.host_set import HostSet
from launch.mlx_launch_ring import MlxLaunchRing
from launch.router.command import serve_on_first_host
from launch.replan import DoesNotFit, Planner, Replanner, drop_hosts, make_plan, probe
from launch.runner import Starter
from launch.ssh_ring import SshRing

CONTEXT = 2048
COMMAND = ["python", "-m", "run_trinity", "--model", "M", "--max-context", str(CONTEXT)]


def three(memory_gb=(4, 4, 4), backend="ring", rdma=False):
    hosts = [{"ssh": name, "ips": [f"127.0.0.{i + 1}"]} for i, name in enumerate("ABC")]
    for h, gb in zip(hosts, memory_gb):
        if gb is not None:
            h["memory_gb"] = gb
    if rdma:
        for i, h in enumerate(hosts):
            h["rdma"] = [None if j == i else f"rdma_en{i}{j}" for j in range(3)]
    return hostfile.parse({"backend": backend, "hosts": hosts})


@pytest.fixture(scope="module")
def sizes(hf_checkpoint):
    model, path, config = checkpoint.load_config(str(hf_checkpoint))
    return config, checkpoint.tensor_sizes(model, path)


@pytest.fixture
def silent():
    """silent(ip) -> a port on ip that never answers: its listener's accept queue is full."""
    sockets = []

    def make(ip: str) -> int:
        listener = socket.socket()
        listener.bind((ip, 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        sockets.append(listener)
        for _ in range(3):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex((ip, port))
            sockets.append(c)
        time.sleep(0.1)
        return port

    yield make
    for s in sockets:
        s.close()


def test_drop_hosts_renumbers_and_drops_rdma_columns():
    rest = drop_hosts(three(backend="jaccl", rdma=True), {1})
    assert rest.names == ["A", "C"] and [h.rank for h in rest.hosts] == [0, 1]
    assert [h.rdma for h in rest.hosts] == [[None, "rdma_en02"], ["rdma_en20", None]]
    assert rest.path is None and rest.backend == "jaccl"
    hostfile.check(rest, "re-planned")  # still a valid jaccl hostfile: one RDMA entry per host, null for itself


def test_planner_splits_the_rest_as_the_planner_does(sizes):
    config, tensor_sizes = sizes
    planner = Planner(COMMAND, config, tensor_sizes, CONTEXT)
    full, rest = three(), drop_hosts(three(), {1})
    assert read_command(planner.lay_out(full).command).settings.ring.split.count(",") == 2
    layout = planner.lay_out(rest)
    expected = make_plan(config, tensor_sizes, rest, CONTEXT, planner.margin)
    assert layout.command == [*COMMAND, "--split", ",".join(map(str, expected.split))]
    assert layout.envs == [] and sum(layout.plan.split) == config["num_hidden_layers"]
    assert layout.describe(rest) == (f"A layers 0-{expected.split[0] - 1}, "
                                     f"C layers {expected.split[0]}-{config['num_hidden_layers'] - 1}")


def test_planner_with_unknown_memory_lets_the_ranks_plan_the_rest(sizes):
    config, _ = sizes
    layout = Planner(COMMAND, config, None, CONTEXT, 0.2).lay_out(drop_hosts(three((4, 4, None)), {0}))
    assert layout.command == [*COMMAND, "--split", "auto"] and layout.plan is None
    (env,) = layout.envs
    name, spec = env.split("=", 1)
    assert name == PLAN_ENV
    assert json.loads(spec) == {"hosts": [{"host": "B", "memory_bytes": 4 << 30, "speed": 1.0},
                                          {"host": "C", "memory_bytes": None, "speed": 1.0}],
                                "margin": 0.2, "context": CONTEXT}
    assert layout.describe(drop_hosts(three(), {0})) == "B, C (the ranks plan the split at start-up)"


def test_planner_refuses_what_does_not_fit_and_a_user_split_of_another_length(sizes):
    config, tensor_sizes = sizes
    gb = make_plan(config, tensor_sizes, three(), CONTEXT, 0.1).hosts[2].total_bytes / (1 << 30) * 1.2
    planner = Planner(COMMAND, config, tensor_sizes, CONTEXT)
    with pytest.raises(DoesNotFit) as info:
        planner.lay_out(drop_hosts(three((gb, gb, gb)), {2}))
    assert "missing" in str(info.value) and not info.value.plan.fits
    with pytest.raises(Exception, match=r"--split 3,2,3 was given for 3 hosts, not 2"):
        Planner([*COMMAND, "--split", "3,2,3"]).lay_out(drop_hosts(three(), {1}))
    assert Planner(COMMAND).lay_out(drop_hosts(three(), {1})).command == COMMAND  # --no-plan: as it is


def replanner(hf, planner, silent_ports, host_set=None, move_rank0=None):
    """A Replanner whose probe goes to silent_ports[ip] (never answers) for those hosts, and
    to a closed (refusing) port for the others."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    starter = Starter(True, ssh=["ssh"])
    return Replanner(hf, planner, starter, restarts=3, host_set=host_set,
                     probe=lambda ip: probe(ip, silent_ports.get(ip, closed), timeout=0.5), move_rank0=move_rank0)


def test_a_silent_host_is_planned_out_and_the_ring_restarts_without_it(sizes, silent, capsys):
    config, tensor_sizes = sizes
    host_set, seen = HostSet(["A", "B", "C"]), []
    host_set.on_replanned(seen.append)
    port = silent("127.0.0.2")
    r = replanner(three(), Planner(COMMAND, config, tensor_sizes, CONTEXT), {"127.0.0.2": port}, host_set)
    make_ring = r(None)
    assert make_ring is not None
    ring = make_ring()
    assert isinstance(ring, SshRing) and [h.ssh for h in ring.hosts] == ["A", "C"] and ring.size == 2
    split = read_command(ring.command).settings.ring.split.split(",")
    assert len(split) == 2 and sum(map(int, split)) == config["num_hidden_layers"]
    assert any(e.startswith("TRINITY_RESTARTS=") for e in ring.envs)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"launch: host B (rank 1, 127.0.0.2) is gone after 3 restarts (no answer at "
                           f"127.0.0.2:{port} within 0.5 s): re-planned over 2 hosts: A layers 0-"), line
    assert seen == [["A", "C"]]
    assert host_set.snapshot() == {"hosts": ["A", "C"], "unavailable": None, "lost": [
        {"host": "B", "rank": 1, "ip": "127.0.0.2", "reason": f"no answer at 127.0.0.2:{port} within 0.5 s"}]}
    assert r.hostfile.names == ["A", "C"]  # what the next re-plan starts from
    assert r.give_up_reason is None


def test_when_the_rest_cannot_hold_the_model_clients_are_told_why(sizes, silent, capsys):
    config, tensor_sizes = sizes
    gb = make_plan(config, tensor_sizes, three(), CONTEXT, 0.1).hosts[2].total_bytes / (1 << 30) * 1.2
    host_set, reasons = HostSet(["A", "B", "C"]), []
    host_set.on_give_up(reasons.append)
    r = replanner(three((gb, gb, gb)), Planner(COMMAND, config, tensor_sizes, CONTEXT),
                  {"127.0.0.2": silent("127.0.0.2")}, host_set)
    assert r(None) is None
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("launch: error: host B (rank 1, 127.0.0.2) is gone after 3 restarts (no answer at ")
    assert "): the model does not fit on the other 2 hosts: " in line and "missing" in line, line
    assert reasons == ["host B (rank 1) is gone and the model does not fit on the rest"]
    assert host_set.unavailable == reasons[0] and host_set.hosts == ["A", "B", "C"]
    assert r.give_up_reason == reasons[0]  # what the Supervisor tells the router


def test_rank_0_serving_host_gone_and_every_host_answering_give_up(sizes, silent, capsys):
    config, tensor_sizes = sizes
    serve = Planner([*COMMAND, "--serve", "0.0.0.0:50051"], config, tensor_sizes, CONTEXT)
    host_set = HostSet(["A", "B", "C"])
    gone = {"127.0.0.1": silent("127.0.0.1")}
    assert replanner(three(), serve, gone, host_set)(None) is None
    assert "rank 0 served --serve 0.0.0.0:50051 there, which cannot move to another host" in capsys.readouterr().err
    assert host_set.unavailable == "host A (rank 0) is gone, and it served this endpoint"
    # Without a serving flag, the next host becomes rank 0.
    ring = replanner(three(), Planner(COMMAND, config, tensor_sizes, CONTEXT), gone)(None)()
    assert [h.ssh for h in ring.hosts] == ["B", "C"]
    capsys.readouterr()
    assert replanner(three(), Planner(COMMAND, config, tensor_sizes, CONTEXT), {})(None) is None
    assert "every host answers (probed 127.0.0.1, 127.0.0.2, 127.0.0.3)" in capsys.readouterr().err


def test_behind_the_router_rank_0_moves_to_the_next_host(sizes, silent, capsys):
    config, tensor_sizes = sizes
    internal = [*COMMAND, "--serve", "127.0.0.1:40001"]  # rank 0's, for the router (launch/router/command.py)
    gone = {"127.0.0.1": silent("127.0.0.1")}
    moved = []

    def move_rank0(rest, command):  # as the router does, less its channel
        command, upstream = serve_on_first_host(command, rest)
        moved.append(upstream)
        return command

    ring = replanner(three(), Planner(internal, config, tensor_sizes, CONTEXT), gone, move_rank0=move_rank0)(None)()
    assert [h.ssh for h in ring.hosts] == ["B", "C"]
    (upstream,) = moved
    assert upstream.startswith("127.0.0.2:") and read_command(ring.command).settings.serving.serve == upstream
    assert ring.command.count("--serve") == 1
    assert "re-planned over 2 hosts: B layers 0-" in capsys.readouterr().err
    # rank 0's own --metrics lived on the lost host: that cannot move.
    metrics = Planner([*internal, "--metrics", "0.0.0.0:9100"], config, tensor_sizes, CONTEXT)
    assert replanner(three(), metrics, gone, move_rank0=move_rank0)(None) is None
    assert "rank 0 served --metrics 0.0.0.0:9100 there" in capsys.readouterr().err and len(moved) == 1


def test_mlx_launch_gets_a_hostfile_of_the_rest_and_the_restart_count(sizes):
    config, tensor_sizes = sizes
    rest = drop_hosts(three(backend="jaccl", rdma=True), {1})
    starter = Starter(False)
    try:
        make_ring = starter(rest, Planner(COMMAND, config, tensor_sizes, CONTEXT).lay_out(rest))
        ring, again = make_ring(), make_ring()
        assert isinstance(ring, MlxLaunchRing)
        # Remote ranks see only mlx.launch's --env values: each attempt's restart count goes there.
        envs = lambda r: [r.cmd[i + 1] for i, a in enumerate(r.cmd) if a == "--env"]  # noqa: E731
        assert "TRINITY_RESTARTS=0" in envs(ring) and "TRINITY_RESTARTS=1" in envs(again)
        assert (ring.env["TRINITY_RESTARTS"], again.env["TRINITY_RESTARTS"]) == ("0", "1")
        path = ring.cmd[ring.cmd.index("--hostfile") + 1]
        written = hostfile.load(path)
        assert written.names == ["A", "C"] and written.backend == "jaccl"
        assert [h.memory_bytes for h in written.hosts] == [h.memory_bytes for h in rest.hosts]
        rank_command = ring.cmd[max(i for i, a in enumerate(ring.cmd) if a == "--") + 1:]  # after mlx.launch's --
        assert read_command(rank_command).settings.ring.split.count(",") == 1
    finally:
        starter.close()
    assert not starter.files


def test_replan_flag_defaults_to_on_with_restarts():
    parse = lambda *a: cli.parse_args(["run", "--single-host", "2", *a, "--", "run-trinity"]).replan  # noqa: E731
    assert (parse(), parse("--replan"), parse("--restart", "2", "--no-replan")) == (None, True, False)
