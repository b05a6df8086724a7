"""benchmarks/_plot.py: the JSON dump of bench_backward.py's figures gives back the rows it was written from, and the
frontier pictures are drawn from them (a small made-up result set, nothing measured); bench_backward.py's command
line for them."""
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import _plot  # noqa: E402
from _memory import Memory  # noqa: E402
from _table import Row, Times  # noqa: E402

MiB = 2**20
SCHEDULES = ["layerwise", "recompute", "passes", "family:c=2", "family:c=4", "auto:memory_budget=1.5x"]


def fake_rows() -> list[Row]:
    """Two models at two K: every schedule measured on one, passes skipped and a family point failed on the other."""
    rows = []
    for name, calls in (("study", 4), ("resnet50", 53)):
        for k in (16, 32):
            memory = {"plain": Memory(20 * MiB, 5 * MiB, 0, (20 * MiB, 21 * MiB, 19 * MiB)),
                      "whole": Memory(140 * MiB, 83 * MiB, 0, (140 * MiB,) * 3)}
            rounds: dict = {"plain": [0.5], "lockstep": [0.45], "checkpointed": "n/a"}
            for i, s in enumerate(SCHEDULES):
                memory[s] = Memory((60 - 10 * i) * MiB, MiB, 2 * MiB, ((60 - 10 * i) * MiB,) * 3)
                rounds[s] = [0.5 * (1 + 0.3 * i)]
            memory["auto:memory_budget=1.5x"] = memory["auto:memory_budget=1.5x"]._replace(ran="family(c=2)")
            if calls > 20:
                memory["passes"] = rounds["passes"] = "skipped (53 > 20 BN)"
                memory["family:c=4"] = rounds["family:c=4"] = "failed"
            rows.append(Row(name, calls, k, memory, {1: Times(rounds, {"plain": 0.6}), 2: Times(rounds, {})}))
    return rows


def test_the_json_dump_gives_back_every_figure(tmp_path):
    rows = fake_rows()
    path = tmp_path / "results.json"
    _plot.dump(str(path), "a header", SCHEDULES, rows)
    header, schedules, loaded = _plot.load(str(path))
    assert header == "a header" and schedules == SCHEDULES
    assert [r.to_json() for r in loaded] == [r.to_json() for r in rows]
    assert loaded[0].memory["plain"] == rows[0].memory["plain"]  # a Memory again, each run's peak with it
    assert loaded[-1].timing[2].ratio("layerwise") == rows[-1].timing[2].ratio("layerwise") == 1.0
    assert loaded[-1].timing[1].ratio("passes") == "skipped (53 > 20 BN)"


def test_a_point_is_time_and_peak_over_plains_or_why_there_is_none():
    study, resnet = fake_rows()[0], fake_rows()[2]
    time, peak = _plot.point(study, "recompute")
    assert math.isclose(time, 1.3) and peak == 50 / 20
    assert _plot.point(resnet, "passes") == "skipped (53 > 20 BN)"
    assert _plot.point(resnet, "family:c=4") == "failed"
    assert _plot.point(Row("x", 1, 4, study.memory, {}), "recompute") == "not timed"


def test_dumps_of_memory_and_time_measured_apart_are_joined_row_by_row(tmp_path):
    """A run with --rounds 0 (memory) and one with --no-memory (time) of the same models and K: one row each, its
    memory from the first and its time from the second; a row in one dump alone stays as it is."""
    measured = fake_rows()
    memory_only = [Row(r.name, r.calls, r.k, r.memory, {}) for r in measured]
    time_only = [Row(r.name, r.calls, r.k, {"passes": "skipped (53 > 20 BN)"} if r.calls > 20 else {}, r.timing)
                 for r in measured[:3]]
    _plot.dump(str(tmp_path / "memory.json"), "memory", SCHEDULES[:3], memory_only)
    _plot.dump(str(tmp_path / "time.json"), "time", ["passes", "family:c=2"], time_only)
    schedules, rows = _plot.load_joined([str(tmp_path / "time.json"), str(tmp_path / "memory.json")])
    assert schedules == ["passes", "family:c=2", "layerwise", "recompute"]
    assert [(r.name, r.k) for r in rows] == [(r.name, r.k) for r in measured]
    assert [r.to_json() for r in rows[:3]] == [r.to_json() for r in measured[:3]]  # each figure where it was measured
    assert rows[3].timing == {} and rows[3].memory["plain"] == measured[3].memory["plain"]  # in the memory run alone


def test_an_untimed_auto_is_placed_at_the_time_of_the_schedule_it_ran():
    """A run that measured memory apart from time cannot time "auto" at a budget relative to plain's peak: its point
    is the time of the schedule it ran, timed under that schedule's name in the same row, at its own peak."""
    study = fake_rows()[0]
    timing = study.timing[1]
    del timing.rounds["auto:memory_budget=1.5x"]
    time, peak = _plot.point(study, "auto:memory_budget=1.5x")
    assert time == timing.ratio("family:c=2") and peak == 10 / 20
    study.memory["auto:memory_budget=1.5x"] = study.memory["auto:memory_budget=1.5x"]._replace(ran="")
    assert _plot.point(study, "auto:memory_budget=1.5x") == "-"  # ran nothing known: no point
    assert _plot.method_of("segments(keep_every=2)") == "segments:keep_every=2"
    assert _plot.method_of("passes") == "passes"


def test_a_picture_is_written_for_each_k_from_a_dump(tmp_path):
    pytest.importorskip("matplotlib")
    dump = tmp_path / "results.json"
    _plot.dump(str(dump), "a header", SCHEDULES, fake_rows())
    _plot.main([str(dump), str(tmp_path / "pictures")])
    written = sorted(p.name for p in (tmp_path / "pictures").iterdir())
    assert written == ["frontier-K16.png", "frontier-K16.svg", "frontier-K32.png", "frontier-K32.svg"]
    assert (tmp_path / "pictures" / "frontier-K16.png").read_bytes().startswith(b"\x89PNG")
    svg = (tmp_path / "pictures" / "frontier-K32.svg").read_text()
    assert "c=2" in svg and "skipped (53 &gt; 20 BN)" in svg  # a family point's label; why a point is missing
    assert "ran family(c=2)" in svg and "memory_budget" not in svg  # "auto"'s label: what it ran, not its budget


def test_without_matplotlib_the_run_is_refused_before_it_starts(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit, match="--plot needs matplotlib"):
        _plot.require_matplotlib(lambda message: sys.exit(message))


def test_an_axis_has_round_ratios_for_ticks_as_fine_as_fit():
    assert _plot._ticks(0.9, 3.2) == [1, 1.25, 1.5, 2, 2.5, 3]
    assert _plot._ticks(0.6, 9) == [0.7, 1, 1.5, 2, 3, 5, 7]
    assert _plot._ticks(0.5, 90) == [0.5, 1, 2, 5, 10, 20, 50]
