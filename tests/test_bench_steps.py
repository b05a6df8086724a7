"""benchmarks/_steps.py's checkpointed floor, which bench_backward.py times beside recompute: plain accumulation with
the regions recompute would choose each in torch's checkpoint, so that it costs recomputation and nothing else."""
import copy
import sys
from pathlib import Path

import torch
from torch.testing import assert_close

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import _steps  # noqa: E402
from _models import MODELS  # noqa: E402


def _saved_bytes(step, model, batch) -> int:
    """The bytes autograd saves in the step at the outermost level (a checkpointed region saves its inputs there)."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(model, batch, 4, MODELS["study"])
    return saved[0]


def test_the_checkpointed_floor_is_plain_accumulation_with_its_regions_recomputed():
    model, batch = _steps.prepare("study", 16, 8, torch.device("cpu"))
    plain, checkpointed = copy.deepcopy(model), copy.deepcopy(model)
    plain_saved = _saved_bytes(_steps.plain_step, plain, batch)
    checkpointed_saved = _saved_bytes(_steps.checkpointed_step, checkpointed, batch)
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert_close(b.grad, a.grad)
    assert checkpointed_saved < plain_saved / 2  # the regions kept their inputs, not what they compute


def test_the_table_times_the_checkpointed_floor_beside_recompute_only():
    assert _steps.timed_methods(["layerwise", "recompute", "passes"]) == [
        "plain", "layerwise", "recompute", "checkpointed", "passes"]
    assert _steps.timed_methods(["layerwise", "passes"]) == ["plain", "layerwise", "passes"]
