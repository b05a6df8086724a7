"""What a step leaves of the process, and of the objects outside the model: the process-wide flags a loss_fn enters
and leaves, the gradients of leaves the losses reach, another thread's random numbers, the memory of failed steps,
Ctrl-C while loss_fn waits, and steps that wait for each other."""
from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import set_checkpoint_early_stop

import accumnorm
from helpers import ce_loss, compare, rel_err, whole_batch
from models import data


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                         nn.Tanh(), nn.Linear(8, 10)).double()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def _deterministic():
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@contextlib.contextmanager
def _ignoring_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _sdpa_math_only():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.MATH])


# (name, the context loss_fn enters around the model, what it changes: read inside and after the step)
_FLAG_CONTEXTS = {
    "detect_anomaly": (torch.autograd.detect_anomaly, torch.is_anomaly_enabled),
    "detect_anomaly(check_nan=False)": (lambda: torch.autograd.detect_anomaly(check_nan=False),
                                        lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())),
    "mkldnn.flags": (lambda: torch.backends.mkldnn.flags(enabled=False), lambda: torch.backends.mkldnn.enabled),
    "cudnn.flags": (lambda: torch.backends.cudnn.flags(enabled=False, benchmark=True, deterministic=True),
                    lambda: (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
                             torch.backends.cudnn.deterministic)),
    "default dtype": (lambda: _default_dtype(torch.float16), torch.get_default_dtype),
    "set_checkpoint_early_stop": (lambda: set_checkpoint_early_stop(False),
                                  lambda: torch.utils.checkpoint._enable_checkpoint_early_stop),
    "deterministic algorithms": (_deterministic, torch.are_deterministic_algorithms_enabled),
    "sdpa_kernel": (_sdpa_math_only, torch.backends.cuda.flash_sdp_enabled),
    "warnings.catch_warnings": (_ignoring_warnings, lambda: warnings.filters[0][0]),
}


@pytest.mark.parametrize("name", list(_FLAG_CONTEXTS))
def test_a_process_flag_entered_in_loss_fn_is_each_micro_batchs_own_and_as_it_was_after(schedule, name):
    """A process-wide flag that loss_fn enters and leaves around the model: each micro-batch sees its own after its
    BatchNorm calls, the step is exact, and after it the flag is as it was; also after a failed step."""
    enter, read = _FLAG_CONTEXTS[name]
    ref = _tiny()
    ours = copy.deepcopy(ref)
    batch = data((6,), 8, torch.float64)
    seen = []

    def loss_fn(m, b, fail=False):
        with enter():
            out = m(b[0])
            seen.append(read())
            if fail and len(seen) == 3:
                raise RuntimeError("late failure")
        return F.cross_entropy(out, b[1])

    with enter():
        inside = read()
    before = read()
    assert inside != before  # the context does change the flag
    loss = accumnorm.backward(ours, batch, loss_fn, micro_batch_size=2, schedule=schedule)
    assert read() == before
    assert seen and all(s == inside for s in seen)
    assert rel_err(loss, whole_batch(ref, batch, loss_fn)) < 1e-12
    compare(ref, ours, 1e-9)
    seen.clear()
    with pytest.raises(RuntimeError, match="late failure"):
        accumnorm.backward(ours, batch, lambda m, b: loss_fn(m, b, fail=True), micro_batch_size=2,
                           schedule=schedule)
    assert read() == before
    assert all(s == inside for s in seen)
