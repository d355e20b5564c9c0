"""--allowed-hosts reaches every HTTP front end: rank 0's (run_trinity.py's
parser, or TRINITY_ALLOWED_HOSTS) and the launcher's router's, which leaves it in the ranks'
command too (rank 0 keeps --metrics)."""

from distributed.cli import serve_options
from distributed.command_line import parse_settings
from distributed.serving.options import ALLOWED_HOSTS_ENV
from launch.hostfile import local_hosts
from launch.router.command import plan_router

SERVE = ["--serve", "127.0.0.1:50051", "--http", "127.0.0.1:8000"]


def test_run_trinity_takes_the_flag_or_the_environment(monkeypatch):
    settings = parse_settings([*SERVE, "--allowed-hosts", "box.lan, ai.example.com"])
    assert serve_options(settings).allowed_hosts == ["box.lan", "ai.example.com"]
    monkeypatch.setenv(ALLOWED_HOSTS_ENV, "env.example")
    assert serve_options(parse_settings(SERVE)).allowed_hosts == ["env.example"]
    assert serve_options(settings).allowed_hosts == ["box.lan", "ai.example.com"]  # the flag wins
    monkeypatch.delenv(ALLOWED_HOSTS_ENV)
    assert serve_options(parse_settings(SERVE)).allowed_hosts == []


def test_the_router_takes_it_and_the_ranks_keep_it(monkeypatch):
    monkeypatch.delenv(ALLOWED_HOSTS_ENV, raising=False)
    cmd = ["run-trinity", *SERVE, "--metrics", "127.0.0.1:9100", "--allowed-hosts", "box.lan"]
    plan = plan_router(cmd, local_hosts(2))
    assert plan.options.allowed_hosts == ["box.lan"] and plan.options.http_address == "127.0.0.1:8000"
    assert plan.command[plan.command.index("--allowed-hosts") + 1] == "box.lan"
    assert plan_router(["run-trinity", *SERVE], local_hosts(2)).options.allowed_hosts == []
