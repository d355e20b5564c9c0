"""Where rank 0's scheduler loop spends its time, part by part: the host's share of a step.

All of a step's host work runs on the one scheduler thread: admitting requests, building frames (on
rank 0 the model's graph for its layers, then the send), launching the device's work, the graph that
samples the tokens, waiting (for rank 0's own computation, or for the ring's reply) until a step's
tokens can be read, accepting them (stop strings, detokenizing, events to the front ends) and the
prefix cache's stores. Each is timed with perf_counter; a part entered inside another pauses it, so
every second counts once. The rest of the loop's time is `other`, and the time it sleeps with nothing
to do is `idle`. Read from any thread (plain floats); /v1/status and the metrics show it, and
`python -m bench load` prints it per step.
"""

import time
from contextlib import contextmanager
from typing import Callable, Dict, List

PARTS = ("admit", "build", "launch", "sample", "wait", "accept", "prefix", "idle")


class LoopClock:
    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.now = now
        self.seconds: Dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.steps = 0  # decode-step replies taken (a verification pass counts as one)
        self.started = now()
        self._open: List[list] = []  # [part, since] of the parts entered, innermost last

    @contextmanager
    def part(self, name: str):
        now = self.now()
        if self._open:  # the enclosing part pauses
            outer = self._open[-1]
            self.seconds[outer[0]] += now - outer[1]
        self._open.append([name, now])
        try:
            yield
        finally:
            now = self.now()
            self.seconds[name] += now - self._open.pop()[1]
            if self._open:
                self._open[-1][1] = now

    def report(self) -> dict:
        """Seconds by part since start (`other`: the loop's time in none), and the steps taken."""
        wall = self.now() - self.started
        seconds = dict(self.seconds)
        seconds["other"] = max(0.0, wall - sum(seconds.values()))
        return {"seconds": {k: round(v, 6) for k, v in seconds.items()}, "steps": self.steps, "wall_s": round(wall, 6)}


def per_step(before: dict, after: dict) -> dict:
    """Milliseconds per step of each part between two reports (a benchmark's run), with `host`: every
    part but waiting and idling, and `busy`: all but idling."""
    steps = max(1, after["steps"] - before["steps"])
    ms = {k: 1e3 * (after["seconds"][k] - before["seconds"].get(k, 0.0)) / steps for k in after["seconds"]}
    ms["host"] = sum(v for k, v in ms.items() if k not in ("wait", "idle"))
    ms["busy"] = ms["host"] + ms["wait"]
    return {"steps": after["steps"] - before["steps"], "ms_per_step": {k: round(v, 3) for k, v in ms.items()}}
