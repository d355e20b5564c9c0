"""launch/links.py: what the planner takes from a doctor's measurement, and the cache per hostfile
(the measurements themselves: tests/launch/test_doctor.py)."""

from launch import hostfile, links

# Medians twice the fastest figures: what the hosts' load added while the doctor measured.
MEASURED = {"ranks": 4, "hidden": 2048, "all_reduce_ms": 12.0, "all_reduce_min_ms": 6.0,
            "pairs": [{"from": a, "to": (a + 1) % 4, "rtt_ms": 4.0 * (a + 1), "rtt_min_ms": 2.0 * (a + 1),
                       "mbit_s": 1e3} for a in range(4)],
            "groups": [{"ranks": [0, 1], "all_reduce_ms": 0.8, "all_reduce_min_ms": 0.4},
                       {"ranks": [2, 3], "all_reduce_ms": 16.0, "all_reduce_min_ms": 8.0}]}


def test_hops_and_all_reduce_steps_come_from_the_fastest_trips_measured():
    m = links.MeasuredLinks(MEASURED, "test")
    assert m.hop_s(1, 2) == m.hop_s(2, 1) == 2e-3  # half of the fastest 4 ms
    assert m.hop_s(0, 2) == 4e-3  # not consecutive: the slowest hop measured
    assert m.step_s([0, 1, 2, 3]) == 6e-3 / 6  # every rank: 2 (N - 1) steps
    assert m.step_s([1, 0]) == 0.4e-3 / 2 and m.step_s([2, 3]) == 8e-3 / 2  # a group measured (MPI)
    assert m.step_s([1, 2]) == 2e-3  # no group measured: its slowest hop


def test_a_record_without_the_fastest_figures_uses_its_medians():
    def medians_only(d):
        return {k: v for k, v in d.items() if not k.endswith("min_ms")}

    old = dict(medians_only(MEASURED), pairs=[medians_only(p) for p in MEASURED["pairs"]],
               groups=[medians_only(g) for g in MEASURED["groups"]])
    m = links.MeasuredLinks(old, "test")
    assert m.hop_s(1, 2) == 4e-3 and m.step_s([0, 1, 2, 3]) == 12e-3 / 6 and m.step_s([2, 3]) == 16e-3 / 2


def test_kept_per_hostfile(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    hosts = [{"ssh": f"mac{i}", "ips": [f"10.0.0.{i + 1}"]} for i in range(4)]
    hf = hostfile.parse(hosts)
    path = links.save(hf, MEASURED)
    assert path.parent == tmp_path / "trinity-pipeline" / "links"
    kept = links.cached(hf)
    assert kept.measured == MEASURED and kept.source.startswith("measured by `trinity-launch doctor` on ")
    assert links.cached(hostfile.parse(hosts, backend="mpi")) is None  # another backend: other links
    assert links.cached(hostfile.parse([dict(h, ips=["10.1.0.9"]) if h["ssh"] == "mac3" else h for h in hosts])) is None
