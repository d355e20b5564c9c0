"""Start-up with --tensor-parallel-size T > 1 (shard/tensor.py, runtime/tensor.py).

T equals the number of ranks N: every rank loads 1/T of every layer (and the embedding and
head whole), rank 0 returns a TensorPipeline, the others replay its frames until STOP.
T < N (T dividing N, on a backend that splits a group: MPI): ranks [sT, (s+1)T) are pipeline
stage s, each holding 1/T of that stage's layers; the stages' first ranks form the ring.
"""

import os
from typing import Callable, Optional

from .. import TrinityError
from ..runtime.tensor import TensorFollower, TensorPipeline, TensorStageWorker
from ..shard.checkpoint import load_config
from ..shard.config import model_args
from ..shard.loader import fetch_stage_files, load_stage
from ..shard.memory import apply_memory_limit
from ..shard.plan import layer_ranges
from ..shard.sizes import with_kv_quantization
from ..shard.tensor import check_tensor_size, release_group
from ..transport.guarded import GuardedTransport
from ..transport.mx_p2p import MxPointToPoint
from .disk_tier import open_disk_tier
from .handshake import StartupRefused, handshake
from .loaded import Loaded, check_every_rank_loaded
from .settings import RingSettings, Settings
from .sizing import fixed_context


def check_tensor_args(ring: RingSettings, world: int, config: Optional[dict] = None) -> int:
    """The tensor size T, checked against the launch and (with `config`) the model."""
    size = ring.tensor_parallel_size
    if size < 1:
        raise TrinityError(f"--tensor-parallel-size must be at least 1, got {size}")
    if size == 1:
        return size
    if ring.stages > 1:
        raise TrinityError("--tensor-parallel-size splits every layer across ranks; --stages runs stages in one "
                           "process: use one or the other")
    if ring.split:
        raise TrinityError(f"--split {ring.split}: with --tensor-parallel-size {size} the layers are split evenly "
                           "between the groups of ranks")
    if world % size:
        if world == 1:
            raise TrinityError(f"--tensor-parallel-size {size} needs {size} ranks (e.g. mlx.launch -n {size}, or "
                               f"launch run --single-host {size}); this is one process")
        raise TrinityError(f"--tensor-parallel-size {size} must divide the number of ranks, {world}: each group of "
                           f"{size} ranks is a pipeline stage")
    if config is not None:
        check_tensor_size(model_args(config), size, config.get("quantization"))
    return size


def start_tensor_rank(settings: Settings, group, watchdog, on_ready: Optional[Callable[[], None]]) -> Optional[Loaded]:
    """start_rank (join.py) for T = group.size() > 1: rank 0's Loaded; the others serve until STOP."""

    model, config_dir, config = load_config(settings.model.checkpoint)
    sizing = settings.sizing
    config = with_kv_quantization(config, sizing.kv_bits, sizing.kv_group_size, sizing.quantized_kv_start)
    try:
        check_tensor_args(settings.ring, group.size(), config)
    except TrinityError as e:  # every rank finds the same, and exits naming it
        if watchdog is not None:
            watchdog.close()
        raise StartupRefused(str(e)) from None
    num_layers = model_args(config).num_hidden_layers
    world, rank = group.size(), group.rank()
    size = settings.ring.tensor_parallel_size
    stages = world // size
    tensor, leaders = split_groups(group, size, watchdog)
    start, end = layer_ranges(num_layers, stages, None)[rank // size]
    first = rank < size
    context = fixed_context(settings.sizing) or config.get("max_position_embeddings") or 4096
    try:
        ranges = [layer_ranges(num_layers, stages, None)[r // size] for r in range(world)]
        reports = handshake(group, config_dir, config, ranges, context, settings.sizing.memory_limit, tensor=size)
    except StartupRefused:
        if watchdog is not None:
            watchdog.close()
        raise
    limit = reports[rank]["memory_bytes"] if settings.sizing.memory_limit is not None else None
    apply_memory_limit(limit)
    stage, path, error = None, None, None
    try:
        path = fetch_stage_files(model, start, end, first, config_dir)
        stage = load_stage(path, start, end, first, config, group=tensor)
    except Exception as e:  # reported to every rank before anyone waits on a peer
        error = e
    check_every_rank_loaded(group, error, [r["host"] for r in reports], watchdog)
    wait_wake = watchdog and watchdog.wait_wake
    if rank % size:
        if on_ready is not None:
            on_ready()
        follower = TensorFollower(stage, tensor, wait_wake=wait_wake, world_rank=rank, memory_limit=limit,
                                  disk=open_disk_tier(settings, path, config, stage, (rank % size, size)))
        if watchdog is not None:
            watchdog.send_stats(follower.stats.report)
        follower.serve()
        release_group(stage)
        return None
    transport = None
    if leaders is not None:
        transport = MxPointToPoint(leaders)
        transport = transport if watchdog is None else GuardedTransport(transport, watchdog)
    if rank != 0:
        if on_ready is not None:
            on_ready()
        worker = TensorStageWorker(stage, rank // size, stages, tensor, rank, wait_wake=wait_wake, memory_limit=limit,
                                   disk=open_disk_tier(settings, path, config, stage, (0, size)))
        if watchdog is not None:
            watchdog.send_stats(worker.stats.report)
        worker.serve(transport)
        release_group(stage)
        return None
    pipeline = TensorPipeline(stage, tensor, transport, waker=watchdog and watchdog.wake,
                              peer_reports=(lambda: dict(watchdog.reports)) if watchdog is not None else dict,
                              memory_limit=limit, watchdog=watchdog,
                              disk=open_disk_tier(settings, path, config, stage, (0, size)))
    # Rank 0 sizes the KV caches (--max-batch's default, --max-context auto, the prefix cache's bytes)
    # from the rank table's layers and this config: one rank's share of the heads, so one rank's caches.
    share = dict(config, num_attention_heads=config["num_attention_heads"] // size,
                 num_key_value_heads=config["num_key_value_heads"] // size)
    return Loaded(pipeline, path, share, [r["memory_bytes"] for r in reports])


def split_groups(group, size: int, watchdog):
    """(this stage's tensor group, the stages' first ranks as the ring's group or None): with one
    stage, the whole group and no ring."""
    world, rank = group.size(), group.rank()
    if world == size:
        return group, None
    try:
        tensor = group.split(rank // size, rank)  # this stage's ranks
        leaders = group.split(0 if rank % size == 0 else 1, rank)  # the stages' first ranks: the ring
        return tensor, leaders
    except Exception as e:
        if watchdog is not None:
            watchdog.close()
        raise StartupRefused(f"--tensor-parallel-size {size} with {world} ranks makes {world // size} groups of "
                             f"{size} with mx.distributed.Group.split, which the {backend_name()} backend refuses "
                             f"({e}); use MPI, or --tensor-parallel-size {world} (every rank 1/{world} of every "
                             f"layer) or 1 (the pipeline)") from None


def backend_name() -> str:
    """The backend this process was started for, as its launcher's environment says."""
    if "NCCL_HOST_IP" in os.environ:
        return "NCCL"
    if any(v in os.environ for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")):
        return "MPI"
    if "MLX_IBV_DEVICES" in os.environ or "MLX_JACCL_COORDINATOR" in os.environ:
        return "JACCL"
    return "ring"
