"""What a rank other than 0 runs: receive a frame, run its stage, pass it on."""

import logging
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple

import mlx.core as mx

from ..shard.loader import parameter_bytes
from ..shard.stage import Stage, flatten, unflatten
from ..transport import Header, Op, Reply, Transport
from ..transport.base import PendingFrame
from . import rank_info
from .caches import CACHE_OPS, SlotCaches, hold, keeping, put_back
from .memory_guard import MemoryGuard, allocation_failed, step_alone
from .rank_stats import RankStats

Frame = Tuple[Header, Optional[mx.array]]
log = logging.getLogger(__name__)


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
                 memory_limit: Optional[int] = None):
        self.stage = stage
        self.rank, self.is_last = rank, rank == size - 1
        self.wait_wake = wait_wake  # parks this rank off the transport (the watchdog's); None: no parking
        self.caches = SlotCaches(stage)
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
        if header.op in (Op.STOP, Op.PARK, Op.CLEAR):
            return header, None  # round trips: the last rank passes them back to rank 0
        raise ValueError(f"rank {self.rank} received unknown op {header.op}")

    def _forward(self, header: Header, h: mx.array) -> Optional[Frame]:
        self.stats.forward_frames += 1
        return self._forward_mixed(header, h) if header.mixed else self._forward_plain(header, h)

    def _forward_plain(self, header: Header, h: mx.array) -> Optional[Frame]:
        refused = self.guard.verdict([(header.batch, header.length, header.slot)], h.dtype.size)
        if refused is not None:
            return self.guard.failed(header, refused)
        caches = self.caches.get(header.slot)
        with keeping(caches, header.arg):  # a verification frame drafted ahead (speculation.Verifier)
            h = self.stage(h, caches)
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
        outs = self.stage.mixed([(parts[0], self.caches.get(header.slot)),
                                 (parts[1], self.caches.get(header.chunk_slot))])
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
