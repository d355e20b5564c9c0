"""The router's channel to rank 0 (launch/router/upstream.py), against real gRPC health servers:
retarget() closes the old channel while the health watcher may be about to call on it."""

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from conftest import free_port_range
from launch.router.upstream import Retargeted, Upstream


@pytest.fixture
def rank0s():
    """Two health servers, SERVING: rank 0 before a re-plan moved it, and after."""
    servers, addresses = [], []
    base = free_port_range(2)
    for port in (base, base + 1):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    yield addresses
    for server in servers:
        server.stop(None)


def test_a_check_on_the_channel_retarget_closed_is_asked_again(rank0s):
    """The watcher reads its stub, then calls it; a retarget() in between closes that channel and
    gRPC refuses the call with a ValueError, which killed the watcher thread: no epoch began again
    and a request replayed after a restart waited for ever (a fresh clone's CI hung so)."""
    upstream = Upstream(rank0s[0])
    try:
        stale = upstream._health  # what the watcher holds as retarget() runs
        assert upstream.ask(stale) is True
        upstream.retarget(rank0s[1])
        with pytest.raises(Retargeted):
            upstream.ask(stale)
        assert upstream.ask(upstream._health) is True  # the new rank 0, asked at once
        upstream.start()  # and the watcher, through retargets, sees rank 0 serve
        for _ in range(20):
            upstream.retarget(rank0s[_ % 2])
        assert upstream.wait_serving(lambda: False) >= 1 and upstream._thread.is_alive()
    finally:
        upstream.shut()
