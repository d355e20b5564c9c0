"""run_trinity.py's start-up on every rank: join the ranks, then load this rank's stage.

join_ranks() runs mx.distributed.init with a watchdog (watchdog.py)
over the ranks. start_rank() settles the split (--split auto plans it from
every rank's memory), checks that the ranks agree (handshake.py), loads
the stage, and returns rank 0's Pipeline; other ranks serve as workers until
rank 0 stops the ring. Ranks that cannot start refuse together.
"""

import faulthandler
import os
from typing import Callable, List, Optional

import mlx.core as mx

from .. import TrinityError
from ..runtime.pipeline import Pipeline, StageWorker, in_process_pipeline
from ..shard.checkpoint import load_config
from ..shard.config import model_args
from ..shard.loader import fetch_stage_files, load_stage
from ..shard.memory import AUTO, apply_memory_limit, share_by_host, usable_memory_bytes
from ..shard.plan import layer_ranges, parse_split
from ..shard.sizes import with_kv_quantization
from ..transport.collective import MxCollective
from ..transport.guarded import GuardedTransport
from ..transport.mx_p2p import MxPointToPoint
from .disk_tier import open_disk_tier
from .handshake import StartupRefused, agree_control_address, handshake
from .loaded import Loaded, check_every_rank_loaded
from .preflight import allow_mpi_calls_from_any_thread, check_group, point_mlx_at_libmpi
from .settings import RingSettings, Settings
from .sizing import checked_context, fixed_context
from .watchdog import CONTROL_ENV, Control, Watchdog, parse_address


def planned_split(config: dict, group, max_context: Optional[int], memory_limit=None, draft_model=None) -> List[int]:
    """--split auto: every rank measures its memory, all exchange it, and each
    computes the same memory-proportional plan (from config.json alone, so
    ranks holding different weight files still agree)."""
    from .auto_split import startup_plan

    plan = startup_plan(config, group, context=max_context, memory_limit=memory_limit, draft_model=draft_model)
    if not plan.fits:
        raise StartupRefused("the model does not fit:\n" + plan.shortfall())
    return plan.split


def make_transport(group, kind: str, watchdog: Optional[Watchdog] = None):
    # MLX's NCCL backend has no send/recv; mlx.launch --backend nccl sets NCCL_HOST_IP.
    if kind == "collective" or (kind == "auto" and "NCCL_HOST_IP" in os.environ):
        transport = MxCollective(group)
    else:
        transport = MxPointToPoint(group)
    return transport if watchdog is None else GuardedTransport(transport, watchdog)


def start_watchdog(ring: RingSettings, control: Control, on_failure=None, grace: float = 0.0, **kw) -> Watchdog:
    """on_failure and grace count on rank 0 alone: what it does when another rank fails (its
    front ends say why), and the seconds its front ends get to send their errors before the exit."""
    if control.rank != 0:
        on_failure, grace = None, 0.0
    return Watchdog(control.rank, control.size, control.address, hosts=control.hosts,
                    peer_timeout=ring.peer_timeout, connect_timeout=ring.connect_timeout,
                    on_failure=on_failure, grace=grace, **kw).start()


def mx_distributed_init_did_not_return_within_connect_timeout():
    return mx.distributed.init()  # (named for faulthandler's report, should init hang)


def join_ranks(ring: RingSettings, control: Optional[Control], on_stop=None, on_failure=None, grace: float = 0.0):
    """mx.distributed.init with a watchdog over the ranks (none for one process).

    Where rank 0's control address is known before init (ring, NCCL, or
    TRINITY_CONTROL_ADDR), every rank connects to it first: init of the ring
    backend blocks for ever, holding the GIL, if a rank never comes, so rank 0
    must find that out (and exit naming it) before anyone calls init.
    Otherwise (MPI, whose launcher starts every rank) init comes first and the
    ranks agree on the address through a collective. on_stop: another rank asked
    for a stop; on_failure and grace: rank 0's (start_watchdog)."""
    allow_mpi_calls_from_any_thread()
    point_mlx_at_libmpi()
    if control is None:
        group = mx.distributed.init()
        check_group(group)  # several MPI processes, each alone: MLX found no libmpi
        if group.size() == 1:
            return group, None
        explicit = parse_address(os.environ[CONTROL_ENV]) if os.environ.get(CONTROL_ENV) else None
        listener, candidates, hosts = agree_control_address(group, explicit)
        control = Control(group.rank(), group.size(), candidates[0], hosts)
        watchdog = start_watchdog(ring, control, on_failure, grace, listener=listener, candidates=candidates,
                                  on_stop=on_stop)
        watchdog.wait_ready()
        return group, watchdog
    watchdog = start_watchdog(ring, control, on_failure, grace, on_stop=on_stop)
    watchdog.wait_ready()
    # Everyone is there, so init should return at once. Should a rank die in
    # between (or the ranks' hostfiles disagree), no Python thread runs during
    # init: faulthandler's timer (a C thread) ends the process with status 1,
    # its report naming the function below.
    faulthandler.dump_traceback_later(ring.connect_timeout, exit=True)
    try:
        with watchdog.paused():
            group = mx_distributed_init_did_not_return_within_connect_timeout()
    finally:
        faulthandler.cancel_dump_traceback_later()
    if (group.rank(), group.size()) != (control.rank, control.size):
        raise TrinityError(f"mx.distributed.init gave rank {group.rank()} of {group.size()}, but the environment "
                           f"says rank {control.rank} of {control.size}")
    return group, watchdog


def start_rank(settings: Settings, group, watchdog: Optional[Watchdog] = None,
               on_ready: Optional[Callable[[], None]] = None) -> Optional[Loaded]:
    """This rank's part once joined: load its stage(s); rank 0 returns what it holds, every other
    rank serves the ring until rank 0 stops it, then returns None. `on_ready()`: on other ranks,
    called once every rank has loaded, before serving the ring."""
    world, ring, sizing = group.size(), settings.ring, settings.sizing
    if ring.tensor_parallel_size != 1:
        from .tensor_start import check_tensor_args, start_tensor_rank

        if check_tensor_args(ring, world) > 1:
            return start_tensor_rank(settings, group, watchdog, on_ready)
    if world > 1 and ring.stages > 1:
        raise TrinityError("--stages runs several stages in one process; do not combine it with a multi-rank launch")
    model, config_dir, config = load_config(settings.model.checkpoint)  # None: the embedded tiny model
    config = with_kv_quantization(config, sizing.kv_bits, sizing.kv_group_size, sizing.quantized_kv_start)
    num_layers = model_args(config).num_hidden_layers
    if ring.split == "auto":
        try:
            split = planned_split(config, group, fixed_context(sizing), sizing.memory_limit,
                                  settings.speculation.draft_model)
        except StartupRefused:
            if watchdog is not None:
                watchdog.close()  # every rank made the same plan, and exits with it
            raise
    else:
        split = parse_split(ring.split) if ring.split else None
    ranges = layer_ranges(num_layers, max(world, ring.stages), split)

    if world == 1:
        memory = share_by_host([usable_memory_bytes()] * len(ranges), ["here"] * len(ranges))
        if sizing.memory_limit not in (None, AUTO):  # one process holds every stage: they divide its bytes
            memory = [sizing.memory_limit // len(ranges)] * len(ranges)
        limit = sum(memory) if sizing.memory_limit is not None else None
        apply_memory_limit(limit)
        path = fetch_stage_files(model, 0, num_layers, True, config_dir)
        stages = [load_stage(path, s, e, i == 0, config) for i, (s, e) in enumerate(ranges)]
        disks = [open_disk_tier(settings, path, config, stage) for stage in stages]
        return Loaded(in_process_pipeline(stages, limit, disks), path, config, memory)

    rank = group.rank()
    start, end = ranges[rank]
    context = checked_context(sizing, config)
    try:
        reports = handshake(group, config_dir, config, ranges, context, sizing.memory_limit)
    except StartupRefused:
        if watchdog is not None:
            watchdog.close()  # every rank found the same problems, and exits naming them
        raise
    limit = reports[rank]["memory_bytes"] if sizing.memory_limit is not None else None
    apply_memory_limit(limit)
    stage, path, error = None, None, None
    try:
        path = fetch_stage_files(model, start, end, rank == 0, config_dir)
        stage = load_stage(path, start, end, rank == 0, config)
    except Exception as e:  # reported to every rank before anyone waits on a peer
        error = e
    check_every_rank_loaded(group, error, [r["host"] for r in reports], watchdog)
    transport = make_transport(group, ring.transport, watchdog)
    if rank != 0:
        if on_ready is not None:
            on_ready()
        worker = StageWorker(stage, rank, world, wait_wake=watchdog and watchdog.wait_wake, memory_limit=limit,
                             disk=open_disk_tier(settings, path, config, stage))
        if watchdog is not None:
            watchdog.send_stats(worker.stats.report)  # rank 0's metrics hear it with each heartbeat
        worker.serve(transport)
        return None
    # Parked ranks are woken, and their reports heard, through the watchdog's channel.
    pipeline = Pipeline(stage, transport, waker=watchdog and watchdog.wake,
                        peer_reports=(lambda: dict(watchdog.reports)) if watchdog is not None else dict,
                        memory_limit=limit, disk=open_disk_tier(settings, path, config, stage))
    return Loaded(pipeline, path, config, [r["memory_bytes"] for r in reports])
