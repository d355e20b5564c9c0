"""How tensors and control frames move between ranks.

Every hop is a fixed-size int32 header followed, when the header says so, by
a payload whose shape and dtype the header announces. Stage code sees only
`Transport.send` / `Transport.recv` and never knows the backend.
"""

from .base import Header, Op, Reply, Transport  # noqa: F401
