"""Start-up with --tensor-parallel-size T > 1 (shard/tensor.py, runtime/tensor.py).

T equals the number of ranks: every rank loads 1/T of every layer (and the embedding and
head whole), rank 0 returns a TensorPipeline, the others replay its frames until STOP.
"""

from typing import Callable, Optional

from .. import TrinityError
from ..runtime.tensor import TensorFollower, TensorPipeline
from ..shard.checkpoint import load_config
from ..shard.config import model_args
from ..shard.loader import fetch_stage_files, load_stage
from ..shard.memory_limit import apply_memory_limit
from ..shard.tensor import check_tensor_size, release_group
from .handshake import StartupRefused, handshake
from .sizing import fixed_context


def check_tensor_args(args, world: int, config: Optional[dict] = None) -> int:
    """The tensor size T, checked against the launch and (with `config`) the model."""
    size = getattr(args, "tensor_parallel_size", 1)
    if size < 1:
        raise TrinityError(f"--tensor-parallel-size must be at least 1, got {size}")
    if size == 1:
        return size
    if args.stages > 1:
        raise TrinityError("--tensor-parallel-size splits every layer across ranks; --stages runs stages in one "
                           "process: use one or the other")
    if args.split:
        raise TrinityError(f"--split {args.split}: with --tensor-parallel-size {size} every rank holds every layer")
    if world != size:
        if world == 1:
            raise TrinityError(f"--tensor-parallel-size {size} needs {size} ranks (e.g. mlx.launch -n {size}, or "
                               f"launch run --single-host {size}); this is one process")
        raise TrinityError(f"--tensor-parallel-size {size} with {world} ranks: tensor parallelism within groups and "
                           f"a pipeline across them is not built (it needs mx.distributed.Group.split, which the MPI "
                           f"backend has and the ring backend refuses); give --tensor-parallel-size {world} (every "
                           f"rank 1/{world} of every layer) or 1 (the pipeline)")
    if config is not None:
        check_tensor_size(model_args(config), size, config.get("quantization"))
    return size


def build_tensor_pipeline(args, group, watchdog, on_ready: Optional[Callable[[], None]], startup_check, loaded):
    """build_pipeline (join.py) for T = group.size() > 1; `startup_check` and `loaded` (its Loaded) are join.py's."""

    model, config_dir, config = load_config(args.model)
    try:
        check_tensor_args(args, group.size(), config)
    except TrinityError as e:  # every rank finds the same, and exits naming it
        if watchdog is not None:
            watchdog.close()
        raise StartupRefused(str(e)) from None
    num_layers = model_args(config).num_hidden_layers
    ranges = [(0, num_layers)] * group.size()
    context = fixed_context(args) or config.get("max_position_embeddings") or 4096
    try:
        reports = handshake(group, config_dir, config, ranges, context, args.memory_limit, tensor=group.size())
    except StartupRefused:
        if watchdog is not None:
            watchdog.close()
        raise
    rank = group.rank()
    if args.memory_limit is not None:
        apply_memory_limit(reports[rank]["memory_bytes"])
    stage, path, error = None, None, None
    try:
        path = fetch_stage_files(model, 0, num_layers, True, config_dir)
        stage = load_stage(path, 0, num_layers, True, config, group=group)
    except Exception as e:  # reported to every rank before anyone waits on a peer
        error = e
    startup_check(group, error, [r["host"] for r in reports], watchdog)
    if rank != 0:
        if on_ready is not None:
            on_ready()
        follower = TensorFollower(stage, group, wait_wake=watchdog and watchdog.wait_wake)
        if watchdog is not None:
            watchdog.report = follower.stats.report
        follower.serve()
        release_group(stage)
        return None
    pipeline = TensorPipeline(stage, group)
    if watchdog is not None:
        pipeline.waker = watchdog.wake
        pipeline.peer_reports = lambda: dict(watchdog.reports)
    # Rank 0 sizes the KV caches (--max-batch's default, --max-context auto, the prefix cache's bytes)
    # from the rank table's layers and this config: one rank's share of the heads, so one rank's caches.
    size = group.size()
    share = dict(config, num_attention_heads=config["num_attention_heads"] // size,
                 num_key_value_heads=config["num_key_value_heads"] // size)
    return loaded(pipeline, path, share, [r["memory_bytes"] for r in reports])
