"""benchmarks/lockstep_bound.py: what a whole-batch forward without grad holds as a BatchNorm call returns, on nets
whose figure is known by hand."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import lockstep_bound  # noqa: E402

BATCH, CHANNELS, SIDE = 8, 4, 6
ACTIVATION = BATCH * CHANNELS * SIDE * SIDE * 4  # one float32 activation of the batch, in bytes


class _Skip(nn.Module):
    """conv1's output is held across bn's call, for the addition after it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, CHANNELS, 3, padding=1)
        self.conv2 = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1)
        self.bn = nn.BatchNorm2d(CHANNELS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.conv1(x)
        return self.bn(self.conv2(skip)) + skip


def _bound(model: nn.Module) -> tuple[int, int]:
    return lockstep_bound.forward_bound(model.train(), torch.randn(BATCH, 1, SIDE, SIDE), lambda m, x: m(x).sum())


def test_the_bound_is_the_calls_input_and_output_and_not_what_was_freed_before_it():
    # conv1's output is freed once conv2 has read it, before the call returns: only conv2's output (the call's input)
    # and the call's output are held then. ReLU in place after the call changes neither.
    model = nn.Sequential(nn.Conv2d(1, CHANNELS, 3, padding=1), nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1),
                          nn.BatchNorm2d(CHANNELS), nn.ReLU(inplace=True))
    assert _bound(model) == (2 * ACTIVATION, 1)


def test_the_bound_counts_what_the_forwards_frames_hold_across_the_call():
    assert _bound(_Skip()) == (3 * ACTIVATION, 1)


def test_the_bound_is_the_largest_over_the_calls_and_a_view_counts_once():
    # At the first call: the conv's output and the call's. At the second: the first call's output, held through the
    # views that are the second call's input (one storage, counted once), and the second call's output; the conv's
    # output is gone. A _Skip after it holds the most: its skip, its call's input and output, and its own input, one
    # channel, which the Sequential's loop holds while the block runs.
    model = nn.Sequential(nn.Conv2d(1, CHANNELS, 3, padding=1), nn.BatchNorm2d(CHANNELS), nn.Flatten(),
                          nn.Unflatten(1, (CHANNELS, SIDE, SIDE)), nn.BatchNorm2d(CHANNELS))
    assert _bound(model) == (2 * ACTIVATION, 2)
    after = nn.Sequential(model, nn.Conv2d(CHANNELS, 1, 3, padding=1), _Skip())
    assert _bound(after) == (3 * ACTIVATION + ACTIVATION // CHANNELS, 3)


@pytest.mark.parametrize("argv, says", [
    (["--models", "resnet50,nosuch"], "--models: ['nosuch'] not among"),
    (["--ks", "16,5"], "--ks: [5] not among"),
    (["--ks", "four"], "--ks: expected a comma-separated list of int, got 'four'"),
    (["--peak-runs", "0"], "--peak-runs and --memory-threads must be >= 1, got 0 and 1"),
])
def test_a_flag_out_of_range_is_refused_naming_it_before_anything_runs(capsys, argv, says):
    with pytest.raises(SystemExit) as exit_:
        lockstep_bound.main(argv)
    assert exit_.value.code == 2
    out = capsys.readouterr()
    assert says in out.err and out.out == ""
