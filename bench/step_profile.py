"""Where rank 0's time goes per decode step (bench_steps.py --profile): wall time in the
Batcher's parts, from wrappers installed around them for one run.

  send    building a frame's graph (Pipeline.send: embedding and this rank's layers), for
          frames that give tokens; prompt chunks apart (send_prefill)
  pick    building the head and sampling graph (Batcher._pick)
  async_eval  starting the device on a frame (one rank; may block while the device queue is full)
  eval    waiting for the device (mx.eval in Batcher._receive)
  accept  reading tokens, detokenizing, streaming events (Sequence.accept, Batcher._finish)
  other   the rest of Scheduler's loop

timeline(): every frame sent, in order: [ms since the start, "chunk" or "tokens", rows, columns,
ms in Pipeline.send] (with one rank a chunk is computed inside send; bench_steps.py --timeline).
"""

import time
from collections import defaultdict


class _TimedMx:
    """mlx.core for batching.py, with eval timed."""

    def __init__(self, mx, totals):
        self._mx, self._totals = mx, totals

    def eval(self, *args):
        tic = time.perf_counter()
        self._mx.eval(*args)
        self._totals["eval"] += time.perf_counter() - tic

    def async_eval(self, *args):
        tic = time.perf_counter()
        self._mx.async_eval(*args)
        self._totals["async_eval"] += time.perf_counter() - tic

    def __getattr__(self, name):
        return getattr(self._mx, name)


def _timed(owner, name, key, totals, count=None, frames=None):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        tic = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            # Pipeline.send(tokens, reply, slot): prompt chunks (Reply.ACK, evaluated at once
            # with one rank) apart from frames that give tokens.
            k = key + "_prefill" if key == "send" and int(args[2]) == 3 else key
            totals[k] += time.perf_counter() - tic
            if count and k == key:
                totals[count] += 1
            if frames is not None:  # Pipeline.send(self, tokens, reply, slot)
                frames.append((tic, "chunk" if k != key else "tokens", *args[1].shape, time.perf_counter() - tic))

    setattr(owner, name, wrapper)
    return original


class StepProfile:
    def __enter__(self):
        from distributed.runtime import batching
        from distributed.runtime.pipeline import Pipeline
        from distributed.runtime.sequence import Sequence

        self.totals = defaultdict(float)
        self.frames = []
        self._undo = [(batching, "mx", batching.mx)]
        batching.mx = _TimedMx(batching.mx, self.totals)
        for owner, name, key, count in [(Pipeline, "send", "send", "frames"), (batching.Batcher, "_pick", "pick", None),
                                        (Sequence, "accept", "accept", "tokens"),
                                        (batching.Batcher, "_finish", "accept", None)]:
            frames = self.frames if owner is Pipeline else None
            self._undo.append((owner, name, _timed(owner, name, key, self.totals, count, frames)))
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.totals["wall"] = time.perf_counter() - self.start
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)

    def per_frame_ms(self) -> dict:
        """Per frame that gives tokens (decode steps, first tokens included)."""
        t = self.totals
        frames = max(1, t["frames"])
        parts = {k: 1000 * t[k] / frames for k in ("send", "send_prefill", "pick", "async_eval", "eval", "accept")}
        parts["other"] = 1000 * t["wall"] / frames - sum(parts.values())
        return {"frames": int(t["frames"]), "tokens": int(t["tokens"]), **{k: round(v, 2) for k, v in parts.items()}}

    def timeline(self) -> list:
        return [[round(1000 * (t - self.start), 1), kind, rows, cols, round(1000 * dt, 1)]
                for t, kind, rows, cols, dt in self.frames]
