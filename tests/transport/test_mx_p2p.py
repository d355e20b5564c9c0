"""The point-to-point transport over a real 2-rank ring backend: a reply received ahead
(recv_ahead) is a lazy input that rank 0 computes on before the reply exists, and waits
for without spinning."""

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
        built = []
        while len(built) < 3:
            header, h = t.recv()
            if header.reply == Reply.NONE:  # what rank 0 built on the reply before it came
                built.append(h.astype(mx.float32).reshape(-1).tolist())
                continue
            time.sleep(1.0)  # rank 0 builds on the reply meanwhile, and waits for it
            if header.arg != 1:
                t.send(Header.for_payload(Op.FORWARD, h + 1, reply=Reply.LAST), h + 1)
            else:  # in place of the hidden states, as a rank that ran out of memory replies
                no = mx.array([[[1], [64], [32], [48]]], dtype=mx.int32)
                t.send(Header.for_payload(Op.NO_MEMORY, no, reply=Reply.LAST), no)
            built.append(header.arg)
        t.close()
        print(built)
        sys.exit(0)
    t.receives_ahead = True  # whatever the backend (MPI receives ahead only with cores to spare)
    h = mx.arange(6, dtype=mx.bfloat16).reshape(1, 1, 6)
    out, waits = [], []
    for arg in (0, 1):
        t.send(Header.for_payload(Op.FORWARD, h, reply=Reply.LAST, arg=arg), h)
        ahead = t.recv_ahead((1, 1, 6), mx.bfloat16)
        doubled = ahead.payload * 2  # built before the reply has come
        cpu = time.process_time()
        if arg == 0:  # sent on: the send waits for the reply, then evaluates
            t.send(Header.for_payload(Op.FORWARD, doubled, reply=Reply.NONE), doubled)
        header = t.header_of(ahead)
        waits.append(time.process_time() - cpu)
        if header.op == Op.FORWARD:
            out.append(doubled.astype(mx.float32).reshape(-1).tolist())
        else:
            out.append([header.op] + ahead.payload_as(header).reshape(-1).tolist())
    t.close()
    print(out)
    print(waits)
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
    replies, cpu = outs[1][0].split("\n")[:2]
    assert replies == str([[2.0, 4.0, 6.0, 8.0, 10.0, 12.0], [24, 1, 64, 32, 48]])
    # Rank 1 got the frame rank 0 built on the reply before it came, computed once it had.
    assert outs[0][0].strip() == str([0, [2.0, 4.0, 6.0, 8.0, 10.0, 12.0], 1])
    # Each reply came a second after its frame; rank 0 waited for it without spinning a core
    # (the ring backend's own receive spins: a second of CPU time, or its share of one).
    assert all(seconds < 0.25 for seconds in eval(cpu)), cpu
