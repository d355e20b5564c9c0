"""Pipeline-parallel runner for Arcee Trinity (AFMoE) models on MLX.

Layers, each importing only the ones below it:

    cli.py       run_trinity.py: a rank's main, wiring the layers below together
    serving/     rank 0's gRPC and OpenAI HTTP front ends, the gRPC client
    startup/     joining the ring, handshake, watchdog, how a rank process ends
    runtime/     the ring runtime: pipeline, scheduler, batching, caches
    shard/       what a rank holds: config, layer plan, stage, weights, sizes
    transport/   how frames move between ranks

serving/ and startup/ are side by side and never import each other; launch/
(planning, starting and supervising rings) sits above all of it.
"""


class TrinityError(Exception):
    """A user-facing error: bad input, a missing file, an unsupported model.

    The command line prints its message (which names the cause) and exits non-zero.
    """
