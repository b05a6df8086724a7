"""torch's process-wide flags, which a forward may enter and leave like its per-thread modes.

Anomaly mode, the default dtype, deterministic algorithms, the float32 precisions, the mkldnn, cudnn, nnpack
and attention-kernel switches, `set_checkpoint_early_stop`, and Python's warning filters are process-wide:
a `with torch.autograd.detect_anomaly():` or `with torch.backends.mkldnn.flags(enabled=False):` in
`loss_fn` sets one on entry and puts back on exit what it found. The layerwise schedule interleaves the
micro-batches' forwards, so their exits would come out of order and leave the flags of whichever exited
last. `GETTERS` read them all (`threadstate.Modes` reads them with the thread's modes), `set_flags()` sets
those that differ: the coroutines swap them at each turn as they swap the thread's state (`threadstate`), and
each micro-batch runs in its own.

Only flags that torch reads back as they were set are taken (the legacy TF32 getters refuse to answer once
the new precision API has been used: the precisions are read through that API).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.autograd.graph
import torch.backends.mha
import torch.utils.checkpoint

__all__ = ["GETTERS", "set_flags"]

_C = torch._C


_checkpoint, _mha, _graph = torch.utils.checkpoint, torch.backends.mha, torch.autograd.graph


def _python_flags() -> tuple[Any, ...]:
    """The flags torch and Python keep as module attributes: checkpoint's early stop, the attention fast path,
    `allow_mutation_on_saved_tensors`, and the warning filters and display as `warnings.catch_warnings` swaps
    them. Each object comes with its id: a filter list entered by catch_warnings is a copy, equal in contents to
    the one it replaces."""
    filters, show, impl = warnings.filters, warnings.showwarning, warnings._showwarnmsg_impl
    return (_checkpoint._enable_checkpoint_early_stop, _mha._is_fastpath_enabled,
            _graph._allow_mutation_on_saved_tensors_enabled, id(filters), id(show), id(impl), filters, show, impl)


def _set_python_flags(value: tuple[Any, ...]) -> None:
    (_checkpoint._enable_checkpoint_early_stop, _mha._is_fastpath_enabled,
     _graph._allow_mutation_on_saved_tensors_enabled) = value[:3]
    warnings.filters, warnings.showwarning, warnings._showwarnmsg_impl = value[6:]
    warnings._filters_mutated()


def _precision(backend: str, op: str = "all") -> tuple[Callable[[], str], Callable[[str], None]]:
    """A backend's float32 precision for its operations `op`: "all", which `torch.backends.*.flags` enter, or
    "matmul", which `torch.set_float32_matmul_precision` sets."""
    return (partial(_C._get_fp32_precision_getter, backend, op),
            partial(_C._set_fp32_precision_setter, backend, op))


def _matmul_precision() -> str | None:
    """`torch.get_float32_matmul_precision()`, kept apart from the backends' own: None where torch refuses to say,
    once the legacy and the new API have both been used."""
    try:
        return _C._get_float32_matmul_precision()
    except RuntimeError:
        return None


def _set_matmul_precision(value: str | None) -> None:
    if value is not None:  # it also sets each backend's "matmul" precision, which are set after it (`_PAIRS`' order)
        _C._set_float32_matmul_precision(value)


def _available() -> list[tuple[Callable[[], Any], Callable[[Any], None]]]:
    """(getter, setter) of each flag this torch has and reads back."""
    pairs: list[tuple[Callable[[], Any], Callable[[Any], None]]] = [
        (lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
         lambda value: torch.set_anomaly_enabled(*value)),
        (torch.get_default_dtype, torch.set_default_dtype),
        (lambda: (_C._get_deterministic_algorithms(), _C._get_deterministic_algorithms_warn_only()),
         lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1])),
        (_python_flags, _set_python_flags),
    ]
    simple = ["mkldnn_enabled", "mkldnn_deterministic", "cudnn_enabled", "cudnn_benchmark", "cudnn_deterministic",
              "nnpack_enabled", "deterministic_fill_uninitialized_memory", "warnAlways",
              "math_sdp_allow_fp16_bf16_reduction", "cpu_allow_fp16_reduced_precision_reduction"]
    pairs += [(getattr(_C, f"_get_{name}"), getattr(_C, f"_set_{name}")) for name in simple
              if hasattr(_C, f"_get_{name}") and hasattr(_C, f"_set_{name}")]
    kernels = ["flash", "mem_efficient", "math", "cudnn", "overrideable", "fa3"]
    pairs += [(getattr(_C, f"_get_{name}_sdp_enabled"), getattr(_C, f"_set_sdp_use_{name}")) for name in kernels
              if hasattr(_C, f"_get_{name}_sdp_enabled") and hasattr(_C, f"_set_sdp_use_{name}")]
    if hasattr(_C, "_get_fp32_precision_getter"):
        pairs += [(_matmul_precision, _set_matmul_precision)]
        pairs += [_precision(backend) for backend in ("generic", "cuda", "mkldnn")]
        pairs += [_precision(backend, "matmul") for backend in ("cuda", "mkldnn")]
    usable = []
    for get, set_ in pairs:
        try:
            get()
        except (AttributeError, RuntimeError, TypeError, ValueError):  # not in this build
            continue
        usable.append((get, set_))
    return usable


_PAIRS = _available()
GETTERS = tuple(get for get, _ in _PAIRS)  # each flag's getter: `Modes.current` reads them with the thread's modes
_SETTERS = tuple(set_ for _, set_ in _PAIRS)


def set_flags(value: tuple[Any, ...], current: tuple[Any, ...]) -> None:
    """Make `value` the process's flags; `current` is what they are now."""
    for want, now, set_ in zip(value, current, _SETTERS):
        if want != now:
            set_(want)
