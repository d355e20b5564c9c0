"""How tensors and control frames move between ranks.

Every hop is a fixed-size int32 header followed, when the header says so, by
a payload whose shape and dtype the header announces. Stage code sees only
`Transport.send` / `Transport.recv` and never knows the backend.

`base` holds the header, its fixed-size frame, the interface and the in-process ring
(--stages); `mx_p2p` moves frames with mx.distributed's send/recv (`ring_wait`: a ring rank
waits in poll()), `collective` with all_gather rounds (NCCL); `guarded` turns a dead peer into
the watchdog's verdict; `broadcast` sends a frame to a tensor group's ranks.
"""

from .base import Header, Op, Reply, Transport  # noqa: F401
