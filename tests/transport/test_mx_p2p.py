"""The point-to-point transport over a real 2-rank ring backend: a reply received ahead
(recv_ahead) is a lazy input that rank 0 computes on before the reply exists."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import free_port_range

CHILD = textwrap.dedent("""
    import sys, time
    import mlx.core as mx
    from distributed.transport import Header, Op, Reply
    from distributed.transport.mx_p2p import MxPointToPoint

    t = MxPointToPoint(mx.distributed.init(backend="ring", strict=True))
    if t.rank == 1:
        for _ in range(2):
            header, h = t.recv()
            time.sleep(0.3)  # rank 0 builds on the reply meanwhile
            if header.arg == 0:
                t.send(Header.for_payload(Op.FORWARD, h + 1, reply=Reply.LAST), h + 1)
            else:  # in place of the hidden states, as a rank that ran out of memory replies
                no = mx.array([[[1], [64], [32], [48]]], dtype=mx.int32)
                t.send(Header.for_payload(Op.NO_MEMORY, no, reply=Reply.LAST), no)
        t.close()
        sys.exit(0)
    t.receives_ahead = True  # whatever this machine's cores (a 2-core one turns it off)
    h = mx.arange(6, dtype=mx.bfloat16).reshape(1, 1, 6)
    out = []
    for arg in (0, 1):
        t.send(Header.for_payload(Op.FORWARD, h, reply=Reply.LAST, arg=arg), h)
        ahead = t.recv_ahead((1, 1, 6), mx.bfloat16)
        doubled = ahead.payload * 2  # built before the reply has come
        mx.async_eval(doubled)
        header = t.header_of(ahead)
        if header.op == Op.FORWARD:
            out.append(doubled.astype(mx.float32).reshape(-1).tolist())
        else:
            out.append([header.op] + ahead.payload_as(header).reshape(-1).tolist())
    t.close()
    print(out)
""")


def test_a_reply_received_ahead_is_computed_on_before_it_comes(tmp_path):
    base = free_port_range(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, MLX_HOSTFILE=str(hostfile), PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, MLX_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (1, 0)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[1][0].strip() == str([[2.0, 4.0, 6.0, 8.0, 10.0, 12.0], [24, 1, 64, 32, 48]])
