"""Waiting for the ring's next frame in poll() (ring_wait.py), on real sockets."""

import json
import socket
import threading
import time

from distributed.transport.ring_wait import IncomingWait, accepted_sockets, own_ring_ports


def test_own_ports_come_from_mlx_launchs_hostfile(tmp_path, monkeypatch):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.0.0.1:5000"], ["10.0.0.2:5001", "10.0.1.2:5002"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    monkeypatch.setenv("MLX_RANK", "1")
    assert own_ring_ports() == [5001, 5002]
    monkeypatch.setenv("MLX_RANK", "7")
    assert own_ring_ports() == []  # not in the file: no waiting, as for another backend
    monkeypatch.delenv("MLX_HOSTFILE")
    assert own_ring_ports() == []


def test_the_accepted_link_is_found_and_waited_on():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        peer = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        with peer, accepted:
            # Only the accepted connection: not the listener, not our own outgoing side.
            assert accepted_sockets([port]) == [accepted.fileno()]
            wait = IncomingWait(accepted_sockets([port]))
            timer = threading.Timer(0.2, peer.sendall, [b"frame"])
            tic = time.monotonic()
            timer.start()
            wait.wait()  # returns once the bytes are there
            assert time.monotonic() - tic >= 0.15
            assert accepted.recv(16) == b"frame"
