"""benchmarks/_methods.py, the methods bench_backward.py runs by name: a schedule with its settings
("family:c=4") is a method of its own, its settings passed to accumnorm.backward, asked whether this accumnorm takes
it, timed beside its floor where one takes its settings; and the command line that lists them."""
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import _methods  # noqa: E402
from _methods import NOT_AVAILABLE, Spec, parse_schedules, parse_spec  # noqa: E402


def test_a_name_is_a_schedule_and_its_settings_read_as_python_literals_or_text():
    assert parse_spec("recompute") == Spec("recompute")
    assert parse_spec("family:c=4") == Spec("family", (("c", 4),))
    assert parse_spec(" family : c = 0.5 : store = cpu : fast=True ") == Spec(
        "family", (("c", 0.5), ("store", "cpu"), ("fast", True)))
    assert str(parse_spec(" family : c = 4 ")) == "family:c=4"  # the canonical name: a column's, a point's


@pytest.mark.parametrize("name, why", [("", "a word"), ("2x", "a word"), ("family:c", "key=value"),
                                       ("family:c=", "key=value"), ("family:=4", "key=value"),
                                       ("family:c=1:c=2", "c set twice")])
def test_a_malformed_name_is_refused_saying_what_is_wrong(name, why):
    with pytest.raises(ValueError, match=why):
        parse_spec(name)


def test_settings_go_to_accumnorm_backward_as_keyword_arguments(monkeypatch):
    calls = []
    monkeypatch.setattr(_methods.accumnorm, "backward", lambda *args, **kwargs: calls.append(kwargs))
    case = _methods._Probe
    _methods.method("family:c=4:store=cpu")(torch.nn.Linear(2, 2), torch.zeros(4, 2), 2, case)
    _methods.method("compiled family:c=4")(torch.nn.Linear(2, 2), torch.zeros(4, 2), 2, case)
    assert [{k: v for k, v in c.items() if k not in ("micro_batch_size",)} for c in calls] == [
        {"schedule": "family", "c": 4, "store": "cpu"}, {"schedule": "family", "c": 4}]


@pytest.mark.usefixtures("one_thread")
def test_accumnorm_is_asked_whether_it_takes_a_schedule_with_its_settings():
    assert _methods.refusal("recompute") is None
    assert _methods.refusal("layerwise:store=cpu") is None  # a setting this accumnorm has
    assert _methods.refusal("no_such_schedule:c=2") == NOT_AVAILABLE
    assert _methods.refusal("layerwise:no_such_setting=2") == NOT_AVAILABLE
    assert _methods.refusal("layerwise:store=nowhere").startswith("refused: store must be")


@pytest.mark.usefixtures("one_thread")
def test_the_schedules_this_accumnorm_does_not_take_are_set_apart_with_why():
    shown, refused = parse_schedules("layerwise,family:c=2,recompute,family:c=4")
    assert shown == ["layerwise", "recompute"]
    assert refused == {"family:c=2": NOT_AVAILABLE, "family:c=4": NOT_AVAILABLE}


@pytest.mark.parametrize("text", ["layerwise,plain", "lockstep", "checkpointed:c=2", "layerwise,layerwise"])
def test_a_benchmark_method_or_a_repeated_schedule_is_no_schedule_to_list(text):
    with pytest.raises(ValueError, match="method of the benchmark's own|given twice"):
        parse_schedules(text)


def test_a_floor_is_timed_beside_the_schedules_whose_settings_it_takes(monkeypatch):
    assert _methods.timed_methods(["layerwise", "recompute:c=4", "family:c=2"]) == [
        "plain", "layerwise", "lockstep", "recompute:c=4", "family:c=2"]  # the floors take no settings
    floor = _methods.Floor("family_floor", lambda c: f"floor step at c={c}", frozenset({"c"}))
    monkeypatch.setitem(_methods.FLOORS, "family", floor)
    monkeypatch.setitem(_methods._BY_FLOOR_NAME, floor.name, floor)
    assert _methods.timed_methods(["family:c=2", "family:c=4"]) == [
        "plain", "family:c=2", "family_floor:c=2", "family:c=4", "family_floor:c=4"]
    assert _methods.method("family_floor:c=4") == "floor step at c=4"


def test_the_schedule_a_method_runs():
    assert [_methods.schedule_of(m) for m in ("passes", "passes:x=1", "compiled passes", "compiled plain")] == [
        "passes", "passes", "passes", "plain"]


@pytest.mark.usefixtures("one_thread")
def test_a_budget_relative_to_plains_peak_is_resolved_in_bytes_and_asked_of_accumnorm_so():
    assert _methods.relative_budget("auto:memory_budget=1.5x") == 1.5
    assert _methods.relative_budget("auto:memory_budget=2x") == 2.0
    assert _methods.relative_budget("auto:memory_budget=1000") is None
    assert _methods.relative_budget("segments") is None
    assert _methods.resolved("auto:memory_budget=1.5x", 1000) == "auto:memory_budget=1500"
    assert _methods.resolved("recompute", 1000) == "recompute"
    assert _methods.refusal("auto:memory_budget=1.5x") is None
    assert _methods.refusal("auto:memory_budget=x1.5").startswith("refused: memory_budget must be")
    assert "auto:memory_budget=1.5x" not in _methods.methods(["auto:memory_budget=1.5x"])  # its budget is per K
