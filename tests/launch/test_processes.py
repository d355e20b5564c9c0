"""launch/processes.py: the ports the launcher hands out."""

import random
import socket

from launch.processes import free_ports


def test_free_ports_are_consecutive_free_and_never_handed_out_twice():
    """The ring's ports, the control port and the router's upstream are picked by separate
    calls before anything binds them: a later call must not return an earlier one's port."""
    random.seed(0)
    seen = set()
    for _ in range(300):
        ports = free_ports(3)
        assert ports == list(range(ports[0], ports[0] + 3))
        assert not seen.intersection(ports)
        seen.update(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # still free now


def test_free_ports_avoid_the_ports_named():
    avoid = set(range(20000, 30000))
    for _ in range(100):
        (port,) = free_ports(1, avoid=avoid)
        assert port not in avoid
