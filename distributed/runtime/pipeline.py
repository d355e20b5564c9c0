"""Rank 0's view of the ring.

Rank 0 embeds and runs the first layers, sends the hidden state on, and gets
the last rank's output back for the tail (final norm and lm_head). Sends do
not wait for replies: several frames can be in the ring at once (prefill
chunks one behind the other, decode micro-batches), and replies come back in
the order their frames were sent. With one rank there is no transport and
everything runs here.
"""

from collections import deque
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..shard.loader import parameter_bytes
from ..shard.stage import Stage, flatten
from ..transport import Header, Op, Reply, Transport
from ..transport.base import LocalRing, PendingFrame
from . import rank_info
from .caches import SlotCaches, keeping
from .memory_guard import MemoryGuard, allocation_failed
from .rank_stats import RankStats


class Pipeline:
    def __init__(self, stage: Stage, transport: Optional[Transport] = None,
                 waker: Optional[Callable[[int], None]] = None, peer_reports: Callable[[], Dict[int, dict]] = dict,
                 memory_limit: Optional[int] = None):
        assert stage.first, "rank 0 holds the first stage"
        self.stage = stage
        self.transport = transport
        self.caches = SlotCaches(stage)
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
        self.time_sends = True  # False in-process (--stages): the stages' layers are one lazy graph

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
        known), which the other ranks build ahead on (worker.py); with it the op goes even
        where nothing is dropped."""
        if n > 0:
            self.caches.apply(Op.TRIM, slot, n, ())
            self.guard.settle()
        if self.transport is not None and (n > 0 or next_length > 0):
            self._send(Header(Op.TRIM, slot=slot, arg=n, next_length=next_length))

    # Prefix-cache entries (the index: prefix_cache.py): every rank keeps its slice.

    def snapshot(self, slot: int, entry: int, row: int = 0) -> Tuple[int, int]:
        """Keep row `row` of `slot` as entry `entry`, on every rank. Returns rank 0's
        share: (tokens it covers, bytes)."""
        kept = self.caches.snapshot(slot, entry, row)
        self._tell_others(Op.SNAPSHOT, slot, values=[entry, row])
        return kept

    def restore(self, slot: int, entry: int, tokens: int) -> None:
        """Start `slot` from entry `entry`'s first `tokens` tokens, on every rank."""
        self._cache_op(Op.RESTORE, slot, values=[entry, tokens])

    def evict(self, entries: List[int]) -> None:
        """Forget entries, on every rank."""
        if entries:
            self._cache_op(Op.EVICT, 0, values=entries)

    def send(self, tokens: mx.array, reply: Reply, slot: int = 0, keep: int = 0, next_length: int = 0) -> None:
        """Start tokens (batch, length) through all stages; unless `reply` is
        NONE, recv() later returns the reply. `keep`: the positions before it that a
        trim may still take back (a verification frame drafted ahead: caches.keeping).
        `next_length`: the positions of the slot's next frame, where rank 0 expects one
        (the other ranks build it ahead: worker.py)."""
        refused = self.guard.verdict([(tokens.shape[0], tokens.shape[1], slot)], self._itemsize)
        if refused is not None:
            return self._refuse(Header(Op.FORWARD, reply, slot), refused)
        caches = self.caches.get(slot)
        with keeping(caches, keep):
            h = self.stage(self.stage.embed(tokens), caches)
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
        step's (Reply.LAST); the chunk's outputs are only kept in its caches. Several
        ranks only (the batcher mixes nothing with one: Batcher.mix)."""
        if chunk_slot in self.guard.doomed:  # the chunk's rows failed here: the step goes on alone
            return self.send(tokens, Reply.LAST, slot)
        parts = [(tokens.shape[0], 1, slot), (chunk.shape[0], chunk.shape[1], chunk_slot)]
        refused = self.guard.verdict(parts, self._itemsize)
        if refused is not None:
            header = Header(Op.FORWARD, Reply.LAST, slot, chunk_slot=chunk_slot, chunk_rows=chunk.shape[0])
            return self._refuse(header, refused)
        h, c = self.stage.mixed([(self.stage.embed(tokens), self.caches.get(slot)),
                                 (self.stage.embed(chunk), self.caches.get(chunk_slot))])
        self._hidden = (h.shape[-1], h.dtype)
        self.stats.forward_frames += 1
        self.stats.mixed_frames += 1
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


def in_process_pipeline(stages: List[Stage], memory_limit: Optional[int] = None) -> "Pipeline":
    """Single-host mode (--stages N): stage 0 here, the others behind an in-process ring.
    `memory_limit`: what MLX holds this process to, which every stage's guard checks."""
    from .worker import StageWorker

    workers = [StageWorker(stage, i + 1, len(stages), memory_limit=memory_limit) for i, stage in enumerate(stages[1:])]
    pipeline = Pipeline(stages[0], LocalRing([w.handle for w in workers]) if workers else None,
                        peer_reports=lambda: {w.rank: w.stats.report() for w in workers}, memory_limit=memory_limit)
    pipeline.time_sends = False
    return pipeline
