"""Each rank's part in the ring: rank 0's view of it (Pipeline), what every other rank runs
(StageWorker: receive a frame, run its stage, pass it on), and what each counts about its own
work (RankStats).

Rank 0 embeds and runs the first layers, sends the hidden state on, and gets
the last rank's output back for the tail (final norm and lm_head). Sends do
not wait for replies: several frames can be in the ring at once (prefill
chunks one behind the other, decode micro-batches), and replies come back in
the order their frames were sent. With one rank there is no transport and
everything runs here.

What a rank counts about its own work, for rank 0's metrics (RankStats): forward frames
(and how many carried a prefill chunk beside a decode step), the time of its own forward
computation, the bytes its KV caches hold, and MLX's memory figures (active, buffer cache,
peak) with the frames refused for lack of memory (memory_guard.py). Other ranks evaluate each frame apart from its send (which may wait for the next
rank) and do nothing else meanwhile: their time is their whole computation. Rank
0 adds no wait: its frames run while its host streams tokens (the batcher's
lookahead), so it counts from when it sends work of its own (dispatched()) until
it sees all of it done (its wait before each reply, which would wait for that work
anyway: computing(drains=True)). That is exact while rank 0 waits for its
computation; while its host work outlasts it, it counts until the host looks (an
upper bound). Waits for work not in flight count as they are (the head and
sampling, one rank's prompt chunks; with --stages N every stage's layers are
computed within rank 0's waits).

Plain numbers, written by the thread that runs the ring and read by another (a
scrape on rank 0; on other ranks the watchdog's heartbeat, which carries them to
rank 0), so the ring never waits for metrics.
"""

import logging
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..shard.loader import parameter_bytes
from ..shard.stage import Stage, flatten, unflatten
from ..transport import Header, Op, Reply, Transport
from ..transport.base import LocalRing, PendingFrame
from . import rank_info
from .caches import CACHE_OPS, SlotCaches, hold, keeping, put_back
from .disk_cache import DiskCache
from .loop_clock import LoopClock
from .memory_guard import MemoryGuard, allocation_failed, step_alone

Frame = Tuple[Header, Optional[mx.array]]
log = logging.getLogger(__name__)


class RankStats:
    """What a rank counts about its own work (see above)."""

    def __init__(self, caches: SlotCaches, guard: Optional[MemoryGuard] = None):
        self.caches, self.guard = caches, guard
        self.clock = LoopClock()  # rank 0: its scheduler loop's parts, `wait` timed here
        self.forward_seconds = 0.0
        self.forward_frames = 0
        self.mixed_frames = 0  # of those, decode steps that carried a prefill chunk (Stage.mixed)
        self._since: Optional[float] = None  # rank 0: since when work of its own is in flight

    def dispatched(self) -> None:
        """Rank 0 started work of its own without waiting for it."""
        if self._since is None:
            self._since = time.perf_counter()

    @contextmanager
    def computing(self, drains: bool = False):
        """Time a wait for this rank's own computation; `drains`: all of it in flight."""
        start = time.perf_counter()
        try:
            with self.clock.part("wait"):
                yield
        finally:
            end = time.perf_counter()
            if self._since is None:
                self.forward_seconds += end - start
            elif drains:
                self.forward_seconds += end - self._since
                self._since = None

    def report(self) -> dict:
        """A snapshot, safe to take from another thread (the slots may change meanwhile)."""
        slots = list(self.caches.slots.values())
        entries = list(self.caches.entries.values())
        return {
            "forward_seconds": self.forward_seconds,
            "forward_frames": self.forward_frames,
            "mixed_frames": self.mixed_frames,
            "kv_cache_bytes": sum(c.nbytes for caches in slots for c in caches),
            "prefix_cache_bytes": sum(e.nbytes for e in entries),
            "active_memory_bytes": mx.get_active_memory(),
            "cache_memory_bytes": mx.get_cache_memory(),
            "peak_memory_bytes": mx.get_peak_memory(),
            "memory_refused_frames": self.guard.refused if self.guard is not None else 0,
        }


class Pipeline:
    def __init__(self, stage: Stage, transport: Optional[Transport] = None,
                 waker: Optional[Callable[[int], None]] = None, peer_reports: Callable[[], Dict[int, dict]] = dict,
                 memory_limit: Optional[int] = None, disk: Optional[DiskCache] = None, time_sends: bool = True):
        assert stage.first, "rank 0 holds the first stage"
        self.stage = stage
        self.transport = transport
        self.caches = SlotCaches(stage, disk)
        self._local: deque = deque()  # one rank: replies not yet taken by recv()
        # Parking the other ranks while idle (see park()): the watchdog's wake, or None.
        self.waker = waker
        self._parked = 0  # number of the PARK frame the ring is parked at; 0: awake
        self._parks = 0
        # --memory-limit, frame by frame (memory_guard.py); a refused frame's reply comes
        # back as NO_MEMORY (with one rank, from _local). Rank 0 must check its own frames:
        # MLX's CPU allocator does not raise when malloc fails, the process dies (SIGSEGV).
        self.guard = MemoryGuard(stage, self.caches, 0, memory_limit)
        self.stats = RankStats(self.caches, self.guard)
        # The other ranks' RankStats reports by rank, as last heard (the watchdog's, or in-process workers').
        self.peer_reports = peer_reports
        # The last hidden state sent, whose computation may still run (timed before the next reply).
        self._computing: Optional[mx.array] = None
        self._hidden: Optional[tuple] = None  # (width, dtype) of the hidden states last sent
        # Rank 0's computation timed before each reply (RankStats); False in-process (--stages):
        # the stages' layers are one lazy graph, and in a tensor group.
        self.time_sends = time_sends

    @property
    def num_ranks(self) -> int:
        return 1 if self.transport is None else self.transport.size

    def _send(self, header: Header, payload: Optional[mx.array] = None) -> None:
        if self._parked:
            self.waker(self._parked)
            self._parked = 0
        self.transport.send(header, payload)

    def _refuse(self, header: Header, payload: mx.array) -> None:
        """The frame `header` is not run here (memory_guard.py): its NO_MEMORY frame goes
        round the ring in its place, or with one rank becomes its reply at once."""
        header, payload = self.guard.failed(header, payload)
        if self.transport is not None:
            self._send(header, payload)
        elif header.reply != Reply.NONE:
            self._local.append((header, payload))

    def _sent(self, header: Header, payload: mx.array) -> bool:
        """Send a FORWARD frame built here. Where MLX cannot allocate its computation (Apple
        GPUs and CUDA raise as the graph is encoded, before the send runs: the transport
        sends nothing before its payload exists), its NO_MEMORY frame goes in its place."""
        try:
            self._send(header, payload)
            return True
        except Exception as e:
            self._refuse_failed(header, e)
            return False

    def _refuse_failed(self, header: Header, e: Exception) -> None:
        """MLX raised `e` evaluating the frame `header` here: refused, if it could not allocate."""
        if not allocation_failed(e):
            raise e
        self._refuse(Header(Op.FORWARD, header.reply, header.slot, chunk_slot=header.chunk_slot,
                            chunk_rows=header.chunk_rows), self.guard.mlx_figures())

    def refuse_reply(self, slot: int, e: Exception) -> None:
        """One rank: evaluating the reply just taken (take_local_reply) raised `e`; where MLX
        could not allocate, the frame's reply is NO_MEMORY (for recv())."""
        self._refuse_failed(Header(Op.FORWARD, Reply.LAST, slot), e)

    def park(self) -> None:
        """The ring goes idle: the other ranks block on the control channel until
        the next frame (a receive on some backends spins a core). Call only with
        no reply outstanding."""
        if self.transport is None or self.waker is None or self._parked:
            return
        self._parks += 1
        self.transport.send(Header(Op.PARK, arg=self._parks))
        header, _ = self.transport.recv()  # back round: every rank has passed it on
        assert header.op == Op.PARK, f"expected the PARK frame back, got op {header.op}"
        self._parked = self._parks

    def _cache_op(self, op: Op, slot: int, arg: int = 0, values: Sequence[int] = ()) -> None:
        """Apply a cache op here and on every other rank (after the frames already sent)."""
        self.caches.apply(op, slot, arg, values)
        self.guard.settle()
        self._tell_others(op, slot, arg, values)

    def _tell_others(self, op: Op, slot: int, arg: int = 0, values: Sequence[int] = ()) -> None:
        if self.transport is not None:
            payload = mx.array(values, dtype=mx.int32).reshape(1, -1, 1) if values else None
            header = Header.for_payload(op, payload, slot=slot, arg=arg) if values else Header(op, slot=slot, arg=arg)
            self._send(header, payload)

    def release(self, slot: int = 0) -> None:
        """Free `slot`'s caches on every rank (its request finished or was cancelled)."""
        self._cache_op(Op.RESET, slot)

    def join(self, batch_slot: int, source_slot: int, rows: List[int]) -> None:
        """Move rows `rows` of `source_slot` to the end of `batch_slot`'s batch, on every rank."""
        self._cache_op(Op.JOIN, batch_slot, source_slot, rows)

    def filter(self, batch_slot: int, keep: List[int]) -> None:
        """Keep only rows `keep` of `batch_slot`'s batch, on every rank."""
        self._cache_op(Op.FILTER, batch_slot, values=keep)

    def merge(self, batch_slot: int, sources: List[int]) -> None:
        """Merge the sequences in slots `sources` into one batch in `batch_slot`, on every rank."""
        self._cache_op(Op.MERGE, batch_slot, values=sources)

    def prepare(self, slot: int, lengths: List[int], right_padding: List[int]) -> None:
        """Before right-padded prompt rows go into `slot`'s batch, on every rank."""
        self._cache_op(Op.PREPARE, slot, values=list(lengths) + list(right_padding))

    def finalize(self, slot: int) -> None:
        """After the last padded prompt rows of `slot`'s batch, on every rank."""
        self._cache_op(Op.FINALIZE, slot)

    def trim(self, slot: int, n: int, next_length: int = 0) -> None:
        """Drop the newest n positions of `slot` (one sequence), on every rank: the drafts
        a verification frame carried that the target rejected (speculation.py).
        `next_length`: the positions of the slot's next frame as rank 0 expects it (0: not
        known), which the other ranks build ahead on (StageWorker.build_ahead); with it the op goes even
        where nothing is dropped."""
        if n > 0:
            self.caches.apply(Op.TRIM, slot, n, ())
            self.guard.settle()
        if self.transport is not None and (n > 0 or next_length > 0):
            self._send(Header(Op.TRIM, slot=slot, arg=n, next_length=next_length))

    # Prefix-cache entries (the index: prefix_cache.py): every rank keeps its slice.

    def snapshot(self, slot: int, pairs: List[Tuple[int, int]]) -> List[Tuple[int, int, int, int]]:
        """Keep each (entry, row) pair's row of `slot` as entry `entry`, on every rank, in one op.
        Returns rank 0's share of each (SlotCaches.snapshot)."""
        kept = self.caches.snapshot(slot, pairs)
        self._tell_others(Op.SNAPSHOT, slot, values=[v for pair in pairs for v in pair])
        return kept

    def restore(self, slot: int, entry: int, tokens: int) -> None:
        """Start `slot` from entry `entry`'s first `tokens` tokens, on every rank."""
        self._cache_op(Op.RESTORE, slot, values=[entry, tokens])

    def record(self, slot: int, entry: int = -1, tokens: int = 0) -> None:
        """Keep a log of what `slot`'s prompt brings to the sliding layers, from entry `entry`'s
        first `tokens` (-1: from nothing), on every rank (caches.Log)."""
        self._cache_op(Op.RECORD, slot, values=[entry, tokens])

    def persist(self, entry: int, tokens: List[int]) -> None:
        """Write entry `entry` (of `tokens`) to every rank's disk tier (caches.SlotCaches.persist)."""
        self._cache_op(Op.PERSIST, 0, values=[entry] + list(tokens))

    def load(self, entry: int, tokens: List[int], cut: int) -> bool:
        """Entry `entry` from every rank's disk tier: the first `cut` tokens of the entry of
        `tokens` (caches.SlotCaches.load); whether every rank has it now (if not, some may:
        evict it). Call only with no reply outstanding."""
        ok = self._load_here(entry, tokens, cut)
        if self.transport is not None:
            payload = mx.array([entry, int(ok)] + list(tokens), dtype=mx.int32).reshape(1, -1, 1)
            self._send(Header.for_payload(Op.LOAD, payload, arg=cut), payload)
            header, back = self.transport.recv()
            ok = header.op == Op.LOAD and bool(back.reshape(-1)[1].item())
        return ok

    def _load_here(self, entry: int, tokens: List[int], cut: int) -> bool:
        return self.caches.load(entry, tokens, cut)

    def evict(self, entries: List[int]) -> None:
        """Forget entries, on every rank."""
        if entries:
            self._cache_op(Op.EVICT, 0, values=entries)

    def send(self, tokens: mx.array, reply: Reply, slot: int = 0, keep: int = 0, next_length: int = 0) -> None:
        """Start tokens (batch, length) through all stages; unless `reply` is
        NONE, recv() later returns the reply. `keep`: the positions before it that a
        trim may still take back (a verification frame drafted ahead: caches.keeping).
        `next_length`: the positions of the slot's next frame, where rank 0 expects one
        (the other ranks build it ahead: StageWorker.build_ahead)."""
        refused = self.guard.verdict([(tokens.shape[0], tokens.shape[1], slot)], self._itemsize)
        if refused is not None:
            return self._refuse(Header(Op.FORWARD, reply, slot), refused)
        caches = self.caches.get(slot)
        with keeping(caches, keep), self.caches.tapped(slot, tokens.shape[1]) as staged:
            h = self.stage(self.stage.embed(tokens), staged)
        self.stats.forward_frames += 1
        self._hidden = (h.shape[-1], h.dtype)  # what the last rank's replies hold
        if self.transport is not None:
            header = Header.for_payload(Op.FORWARD, h, reply=reply, slot=slot, arg=keep, next_length=next_length)
            if not self._sent(header, h):
                return
            if self.time_sends:
                self._computing = h
                self.stats.dispatched()
        elif reply in (Reply.NONE, Reply.ACK):
            try:
                with self.stats.computing():
                    self.caches.evaluate(slot)
            except Exception as e:
                return self._refuse_failed(Header(Op.FORWARD, reply, slot), e)
            if reply == Reply.ACK:
                self._local.append((Header(Op.FORWARD, Reply.ACK, slot), None))
        else:
            self._local.append((Header(Op.FORWARD, reply, slot), h[:, -1:, :] if reply == Reply.LAST else h))

    def send_mixed(self, tokens: mx.array, slot: int, chunk: mx.array, chunk_slot: int) -> None:
        """Start a decode step, tokens (rows, 1) of `slot`, and a prefill chunk, (rows,
        columns) of `chunk_slot`, through all stages as one frame (Stage.mixed: the
        chunk's tokens share the step's pass over the expert weights). The reply is the
        step's (Reply.LAST); the chunk's outputs are only kept in its caches (with one rank,
        the step's reply depends on every layer's chunk caches: taking it computes them)."""
        if chunk_slot in self.guard.doomed:  # the chunk's rows failed here: the step goes on alone
            return self.send(tokens, Reply.LAST, slot)
        parts = [(tokens.shape[0], 1, slot), (chunk.shape[0], chunk.shape[1], chunk_slot)]
        refused = self.guard.verdict(parts, self._itemsize)
        if refused is not None:
            header = Header(Op.FORWARD, Reply.LAST, slot, chunk_slot=chunk_slot, chunk_rows=chunk.shape[0])
            return self._refuse(header, refused)
        with self.caches.tapped(chunk_slot, chunk.shape[1]) as chunk_caches:
            h, c = self.stage.mixed([(self.stage.embed(tokens), self.caches.get(slot)),
                                     (self.stage.embed(chunk), chunk_caches)])
        self._hidden = (h.shape[-1], h.dtype)
        self.stats.forward_frames += 1
        self.stats.mixed_frames += 1
        if self.transport is None:
            self._local.append((Header(Op.FORWARD, Reply.LAST, slot), h[:, -1:, :]))
            return
        payload = flatten([h, c])
        rows, length = chunk.shape
        if not self._sent(Header.for_payload(Op.FORWARD, payload, reply=Reply.LAST, slot=slot, chunk_slot=chunk_slot,
                                             chunk_rows=rows, chunk_length=length), payload):
            return
        if self.time_sends:
            self._computing = payload
            self.stats.dispatched()

    @property
    def _itemsize(self) -> int:
        return self.stage.norm.weight.dtype.size  # the hidden states' (weights may be quantized)

    def recv(self) -> Tuple[Header, Optional[mx.array]]:
        """The reply to the oldest frame sent that asked for one: final hidden
        states (Reply.LAST / ALL), no payload (Reply.ACK), or a NO_MEMORY header
        (memory_guard.py) whose payload says which rank could not run the frame."""
        if self.transport is None:
            return self._local.popleft()
        if self._computing is not None:
            # The reply waits for it anyway (it comes first on the stream, after everything
            # rank 0 sent before it): here that wait is rank 0's own.
            with self.stats.computing(drains=True):
                mx.eval(self._computing)
            self._computing = None
        with self.stats.clock.part("wait"):
            return self.transport.recv()

    def recv_ahead(self, rows: int) -> Optional[PendingFrame]:
        """The reply to the oldest frame, a decode step of `rows` rows (Reply.LAST), as a lazy
        input before it has come, where the transport can (Transport.recv_ahead): the next
        step is then built on it while the other ranks compute, not after. Check it with
        reply_header(). None: take it with recv()."""
        if self.transport is None or self._hidden is None:
            return None
        pending = self.transport.recv_ahead((rows, 1, self._hidden[0]), self._hidden[1])
        if pending is not None:
            self._computing = None  # rank 0's own computation now runs on behind the reply
        return pending

    def reply_header(self, pending: PendingFrame) -> Header:
        """Waits for a reply received ahead; its header."""
        with self.stats.clock.part("wait"):
            return self.transport.header_of(pending)

    def clear(self) -> None:
        """Drop every slot's caches on every rank, after reading and dropping every reply
        still owed, however many: a CLEAR frame goes round and every frame before it is
        read until it is back (Batcher.reset; a step that raised may have sent a frame it
        never recorded). Prefix-cache entries stay."""
        self._computing = None  # it may be what failed
        self._local.clear()
        self.caches.clear()
        self.guard.settle()
        if self.transport is not None:
            self._send(Header(Op.CLEAR))
            while self.transport.recv()[0].op != Op.CLEAR:
                pass

    def take_local_reply(self) -> Optional[mx.array]:
        """One rank: the (lazy) reply to the frame just sent, taken now instead of by
        recv(); frames sent earlier keep their place. None with a ring, or when the frame
        was refused (its NO_MEMORY reply stays for recv())."""
        if self.transport is not None or self._local[-1][0].op == Op.NO_MEMORY:
            return None
        return self._local.pop()[1]

    def forward(self, tokens: mx.array, reply: Reply, slot: int = 0) -> Optional[mx.array]:
        """send() and wait for its reply: the final hidden states (None for NONE / ACK)."""
        self.send(tokens, reply, slot)
        if reply == Reply.NONE:
            return None
        _, h = self.recv()
        return h

    def logits(self, tokens: mx.array, reply: Reply = Reply.LAST, slot: int = 0) -> mx.array:
        return self.stage.head(self.forward(tokens, reply, slot))

    def rank_info(self) -> List[dict]:
        """One row per rank: host, layers, embed/head, peak memory, parameter bytes.
        Call only with no reply outstanding."""
        s = self.stage
        table = rank_info.encode_row(0, s.start, s.end, True, parameter_bytes(s))
        if self.transport is not None:
            self._send(Header.for_payload(Op.INFO, table), table)
            _, table = self.transport.recv()
        return rank_info.decode_rows(table)

    def rank_reports(self) -> Dict[int, dict]:
        """Each rank's RankStats report: this one's now, the others' as last heard
        (safe from any thread; a rank not heard from yet is missing)."""
        return {**self.peer_reports(), 0: self.stats.report()}

    def close(self) -> None:
        """Stop the other ranks; returns once the STOP frame has gone round."""
        if self.transport is not None:
            self._send(Header(Op.STOP))
            self.transport.recv()
            self.transport.close()
            self.transport = None
        self.caches.close()


@dataclass
class Ahead:
    """A decode step built before its frame came (StageWorker.build_ahead): the frame as a
    lazy input, the step it was built as, the caches as they were, and the frame to pass on."""

    pending: PendingFrame
    step: Header
    held: List[dict]
    out: Frame


class StageWorker:
    def __init__(self, stage: Stage, rank: int, size: int, wait_wake: Optional[Callable[[int], None]] = None,
                 memory_limit: Optional[int] = None, disk: Optional[DiskCache] = None):
        self.stage = stage
        self.rank, self.is_last = rank, rank == size - 1
        self.wait_wake = wait_wake  # parks this rank off the transport (the watchdog's); None: no parking
        self.caches = SlotCaches(stage, disk)
        self.guard = MemoryGuard(stage, self.caches, rank, memory_limit)  # --memory-limit, frame by frame
        self.stats = RankStats(self.caches, self.guard)  # rank 0 hears it with the watchdog's heartbeats
        self.parameter_bytes = parameter_bytes(stage)
        self._last_forward = Header(Op.FORWARD)  # the last FORWARD frame (build_ahead)

    def handle(self, header: Header, payload: Optional[mx.array]) -> Optional[Frame]:
        """Process one frame; return the frame to pass on, or None to send nothing."""
        if header.op == Op.FORWARD:
            return self._forward(header, payload)
        if header.op in CACHE_OPS:
            values = [] if payload is None else payload.reshape(-1).tolist()
            self.caches.apply(header.op, header.slot, header.arg, values)
            self.guard.settle()
            # The ring keeps frames in order, so rank 0 needs no acknowledgement.
            return None if self.is_last else (header, payload)
        if header.op == Op.LOAD:  # back to rank 0 from the last rank, each rank's answer in it
            values = payload.reshape(-1).tolist()
            ok = self._load_here(values[0], values[2:], header.arg) and values[1]
            out = mx.array([values[0], int(ok)] + values[2:], dtype=mx.int32).reshape(1, -1, 1)
            return Header.for_payload(Op.LOAD, out, arg=header.arg), out
        if header.op == Op.INFO:
            row = rank_info.encode_row(
                self.rank, self.stage.start, self.stage.end, False, self.parameter_bytes
            )
            table = mx.concatenate([payload, row], axis=1)
            return Header.for_payload(Op.INFO, table), table
        if header.op == Op.NO_MEMORY:  # a frame a rank before could not run: on to rank 0, as its reply
            return None if self.is_last and header.reply == Reply.NONE else (header, payload)
        if header.op == Op.CLEAR:
            self.caches.clear()
            self.guard.settle()
        if header.op == Op.STOP:
            self.caches.close()  # what its disk tier has queued is written first
        if header.op in (Op.STOP, Op.PARK, Op.CLEAR):
            return header, None  # round trips: the last rank passes them back to rank 0
        raise ValueError(f"rank {self.rank} received unknown op {header.op}")

    def _load_here(self, entry: int, tokens: List[int], cut: int) -> bool:
        return self.caches.load(entry, tokens, cut)

    def _forward(self, header: Header, h: mx.array) -> Optional[Frame]:
        self.stats.forward_frames += 1
        return self._forward_mixed(header, h) if header.mixed else self._forward_plain(header, h)

    def _forward_plain(self, header: Header, h: mx.array) -> Optional[Frame]:
        refused = self.guard.verdict([(header.batch, header.length, header.slot)], h.dtype.size)
        if refused is not None:
            return self.guard.failed(header, refused)
        caches = self.caches.get(header.slot)
        # keeping: a verification frame drafted ahead (speculation.Verifier); tapped: a prompt recorded
        with keeping(caches, header.arg), self.caches.tapped(header.slot, header.length) as staged:
            h = self.stage(h, staged)
        if self.is_last:
            if header.reply in (Reply.NONE, Reply.ACK):
                self.caches.evaluate(header.slot)
                return None if header.reply == Reply.NONE else (Header(Op.FORWARD, Reply.ACK, header.slot), None)
            if header.reply == Reply.LAST:
                h = h[:, -1:, :]
        return Header.for_payload(Op.FORWARD, h, reply=header.reply, slot=header.slot, arg=header.arg,
                                  next_length=header.next_length), h

    def _forward_mixed(self, header: Header, h: mx.array) -> Optional[Frame]:
        """A decode step and a prefill chunk in one frame (Pipeline.send_mixed)."""
        self.stats.mixed_frames += 1
        chunk = (header.chunk_rows, header.chunk_length, header.width)
        step = (header.length - chunk[0] * chunk[1], 1, header.width)
        parts = unflatten(h, [step, chunk])
        if header.chunk_slot in self.guard.doomed:  # the chunk's rows failed here: the step goes on alone
            return self._forward_plain(step_alone(header, parts[0]), parts[0])
        refused = self.guard.verdict([(step[0], 1, header.slot), (chunk[0], chunk[1], header.chunk_slot)],
                                     h.dtype.size)
        if refused is not None:
            return self.guard.failed(header, refused)
        with self.caches.tapped(header.chunk_slot, chunk[1]) as chunk_caches:
            outs = self.stage.mixed([(parts[0], self.caches.get(header.slot)), (parts[1], chunk_caches)])
        if self.is_last:
            # The step's reply. Evaluating it evaluates the chunk's caches too: each layer's
            # MLP / MoE ran over both parts, so the chunk's attention is upstream of it.
            return Header.for_payload(Op.FORWARD, outs[0], reply=header.reply, slot=header.slot), outs[0]
        payload = flatten(outs)
        return Header.for_payload(Op.FORWARD, payload, reply=header.reply, slot=header.slot,
                                  chunk_slot=header.chunk_slot, chunk_rows=header.chunk_rows,
                                  chunk_length=header.chunk_length), payload

    def build_ahead(self, transport: Transport, frame: Header) -> Optional[Ahead]:
        """After a decode step (one position per row), the next frame is most likely the same
        slot's next step; after a step or TRIM that says what the slot's next frame is
        (speculation.Verifier: a verification frame of that many positions, or a step), that frame: receive it
        lazily and build its graph now, while the other ranks compute, instead of after it
        has come. The caches' updates are undone if it is not."""
        step = self._expected(frame)
        if step is None:
            return None
        shape = step.payload_shape()
        if self.guard.verdict([(step.batch, step.length, step.slot)], step.payload_dtype().size) is not None:
            return None  # the frame is checked now: between frames this rank's memory stays as it is
        pending = transport.recv_ahead(shape, step.payload_dtype())
        if pending is None:
            return None
        caches = self.caches.get(step.slot)
        held = hold(caches)
        h = self.stage(pending.payload, caches)
        return Ahead(pending, step, held, (Header.for_payload(Op.FORWARD, h, reply=step.reply, slot=step.slot), h))

    def _expected(self, frame: Header) -> Optional[Header]:
        """The frame expected after `frame`, as its header would read (None: not known)."""
        if frame.op == Op.FORWARD:
            self._last_forward = frame
        if frame.op in (Op.FORWARD, Op.TRIM) and frame.next_length > 0 and self._last_forward.slot == frame.slot:
            n = frame.next_length
            expected = Header(Op.FORWARD, Reply.LAST if n == 1 else Reply.ALL, frame.slot, 1, n,
                              self._last_forward.width, self._last_forward.dtype)
        elif frame.op == Op.FORWARD and frame.length == 1 and not frame.mixed and frame.arg == 0:
            expected = frame  # the same slot's next step
        else:
            return None
        if expected.slot in self.caches.slots and (expected.reply in (Reply.LAST, Reply.ALL) or not self.is_last):
            return expected
        return None

    def take_ahead(self, transport: Transport, ahead: Ahead) -> Tuple[Header, Optional[mx.array], Optional[Frame]]:
        """The frame received ahead, and what to pass on if it was the step built for it (else
        None: its caches are as they were, and it is handled as it comes)."""
        # The step is evaluated with the header, in one wait: were the frame another, its
        # result is dropped (one position's computation, on the frame's bytes read as a step).
        with self.stats.computing():
            header = transport.header_of(ahead.pending, ahead.out[1])
        step = ahead.step
        if (header.op, header.reply, header.slot, header.batch, header.length, header.width, header.dtype,
                header.arg, header.mixed) == (Op.FORWARD, step.reply, step.slot, step.batch, step.length, step.width,
                                              step.dtype, 0, False):
            self.stats.forward_frames += 1
            return header, ahead.pending.payload, (replace(ahead.out[0], next_length=header.next_length), ahead.out[1])
        put_back(self.caches.get(step.slot), ahead.held)
        return header, transport.payload_of(ahead.pending, header), None

    def serve(self, transport: Transport) -> None:
        """Loop until rank 0 sends STOP."""
        ahead = None
        while True:
            if ahead is None:
                (header, payload), out = transport.recv(), None
            else:
                header, payload, out = self.take_ahead(transport, ahead)
            if header.op == Op.FORWARD:
                # Evaluated here, not in the send (which may wait for the next rank): the time is
                # this rank's computation alone.
                with self.stats.computing():
                    try:
                        if out is None:
                            out = self.handle(header, payload)
                        if out is not None and out[1] is not None:
                            mx.eval(out[1])
                    except Exception as e:  # this frame fails, not the ring (memory_guard.FRAME_ERROR)
                        if not allocation_failed(e):
                            log.error("rank %d could not run a frame of slot %d", self.rank, header.slot, exc_info=e)
                        out = self.guard.mlx_failed(header, e)
            else:
                out = self.handle(header, payload)
            if out is not None:
                transport.send(*out)
            ahead = self.build_ahead(transport, header)
            if header.op == Op.STOP:
                transport.close()
                return
            if header.op == Op.PARK:
                # Idle ring: block on the control channel, not in a receive that may spin.
                transport.settle()
                if self.wait_wake is not None:
                    self.wait_wake(header.arg)



def in_process_pipeline(stages: List[Stage], memory_limit: Optional[int] = None,
                        disks: Optional[List[DiskCache]] = None) -> "Pipeline":
    """Single-host mode (--stages N): stage 0 here, the others behind an in-process ring.
    `memory_limit`: what MLX holds this process to, which every stage's guard checks; `disks`:
    each stage's disk tier of prefix-cache entries."""
    disks = disks or [None] * len(stages)
    workers = [StageWorker(stage, i + 1, len(stages), memory_limit=memory_limit, disk=disk)
               for i, (stage, disk) in enumerate(zip(stages[1:], disks[1:]))]
    return Pipeline(stages[0], LocalRing([w.handle for w in workers]) if workers else None,
                    peer_reports=lambda: {w.rank: w.stats.report() for w in workers}, memory_limit=memory_limit,
                    disk=disks[0], time_sends=False)
