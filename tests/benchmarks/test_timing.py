"""benchmarks/_timing.py: the rounds bench_backward.py times its methods in."""
import argparse
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import _timing  # noqa: E402


@pytest.mark.parametrize(("first_s", "min_round_ms", "steps"), [
    (0.1, 0, 1), (0.1, 100, 1), (0.1, 250, 3), (0.03, 1000, 34), (2.0, 500, 1), (None, 500, 1)])
def test_a_round_takes_as_many_steps_as_plain_needs_to_fill_it(first_s, min_round_ms, steps):
    assert _timing.steps_per_round(first_s, min_round_ms) == steps


@pytest.mark.parametrize("min_round_ms", [0, 1000])
def test_every_method_takes_the_same_steps_in_each_round_each_from_fresh_gradients(min_round_ms):
    calls = {"plain": 0, "layerwise": 0}
    grads_at_start = []

    def method(name):
        def step(model, _batch=None, _micro=None, _case=None):
            grads_at_start.append(model.weight.grad)
            calls[name] += 1
            model(torch.ones(1, 2)).sum().backward()
            time.sleep(0.002)
        return lambda model: step(model)

    args = argparse.Namespace(rounds=3, passes_rounds=1, min_round_ms=min_round_ms, compile=None)
    times = _timing.time_methods({m: method(m) for m in calls}, torch.nn.Linear(2, 1), args, torch.device("cpu"),
                                 "test")
    repeats = (calls["plain"] - 1) // 3
    assert calls["plain"] == calls["layerwise"] == 1 + 3 * repeats  # one untimed first step, then the rounds
    assert (repeats == 1) == (min_round_ms == 0)
    assert all(g is None for g in grads_at_start)
    assert all(len(times.rounds[m]) == 3 and all(t > 0.002 for t in times.rounds[m]) for m in calls)
