"""Pipeline-parallel runner for Arcee Trinity (AFMoE) models on MLX.

Layout: `shard/` is what a rank holds, `transport/` is how tensors move between
ranks, `pipeline` drives one forward pass around the ring from rank 0,
`generate` turns forward passes into tokens, `cli` is run_trinity.py.
"""


class TrinityError(Exception):
    """A user-facing error: bad input, a missing file, an unsupported model.

    The command line prints its message (which names the cause) and exits non-zero.
    """
