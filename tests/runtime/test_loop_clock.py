"""loop_clock.py: each second of the loop counts once, in its innermost part."""

from distributed.runtime.loop_clock import LoopClock, per_step


class Ticks:
    """A clock that moves only when told."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_part_inside_another_pauses_it():
    ticks = Ticks()
    clock = LoopClock(ticks)
    with clock.part("build"):
        ticks.t += 2
        with clock.part("wait"):
            ticks.t += 5
        ticks.t += 1
    ticks.t += 3  # in no part
    clock.steps = 4
    report = clock.report()
    assert report["seconds"]["build"] == 3 and report["seconds"]["wait"] == 5
    assert report["seconds"]["other"] == 3 and report["wall_s"] == 11
    assert sum(report["seconds"].values()) == report["wall_s"]


def test_a_part_that_raises_still_counts():
    ticks = Ticks()
    clock = LoopClock(ticks)
    try:
        with clock.part("accept"):
            ticks.t += 2
            raise ValueError("a row failed")
    except ValueError:
        pass
    with clock.part("prefix"):
        ticks.t += 1
    assert clock.report()["seconds"]["accept"] == 2 and clock.report()["seconds"]["prefix"] == 1


def test_per_step_between_two_reports():
    ticks = Ticks()
    clock = LoopClock(ticks)
    before = clock.report()
    for _ in range(10):
        with clock.part("build"):
            ticks.t += 0.002
        with clock.part("wait"):
            ticks.t += 0.008
        clock.steps += 1
    with clock.part("idle"):
        ticks.t += 1
    split = per_step(before, clock.report())
    ms = split["ms_per_step"]
    assert split["steps"] == 10
    assert abs(ms["build"] - 2) < 1e-6 and abs(ms["wait"] - 8) < 1e-6 and abs(ms["idle"] - 100) < 1e-6
    assert abs(ms["host"] - 2) < 1e-6 and abs(ms["busy"] - 10) < 1e-6
