"""How much memory a step may take, what each exact schedule needs, and which one "auto" runs: `memory_budget=`.

On a GPU, running out of memory is an exception the step can recover from; on a CPU, it is the kernel killing the
process. So "auto" chooses before the memory is used, from measured figures: a step's need is the bytes of tensors
its forward keeps for the backward (a `Meter` of autograd's saved tensors, one storage counted once, parameters,
views of them and the batch's storage not at all), per sample, as this model's last step with micro-batches of this
size and shape measured them, times the step's samples (never fewer than it measured: a need has parts of one
micro-batch's size, which do not shrink with the batch), plus the gradients it makes. A lockstep also holds, at
each met BatchNorm call, every micro-batch's piece of the call's input and output at once, which its forwards need
not keep: the meter counts them for that moment (`Meter.beside`), and a figure is the most it counted at once.
Layerwise runs when its need fits the budget, recompute when its does, then segments at each of its settings,
passes otherwise: its meter counts what one micro-batch's full pass keeps (`Meter.next_pass`), and a budget below
that, with nothing else to try, is refused. A step with no figure yet runs metered: the meter stops it
(`OverBudget`) as soon as what it keeps would pass the budget, before it does, and the step starts over in the next
schedule. The figure of a stopped step is only a floor (`stopped_figures`): a later step whose budget it fits runs
that schedule metered. Recompute's figure is what its forward keeps (the regions' inputs, what runs outside them,
the kept convolution outputs) and, reserved before its backward starts, the recomputation of its largest region for
every micro-batch at once, which that backward holds. Its regions and kept outputs are chosen from the last step's
measurements, so that each of its steps runs metered. Segments' figure counts the regions' arguments it keeps
(`Meter.count`) and, reserved before its backward, one micro-batch's recomputation of a region, the arguments it
recomputes and the whole batch's gradients at the region's exit and entrance (`Meter.reserve_bytes`). Both also
count the Python objects of the record they keep for every region call of every micro-batch (`Meter.count_objects`,
`memory.objects`): on a deep net of small tensors, more than the tensors.

The budget, by default: on CUDA the device's free memory, on the CPU the available memory (the kernel's
MemAvailable), each less a tenth; `memory_budget` sets it in bytes.
"""
from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.parameter import is_lazy

from ..safety import untraced
from .objects import object_bytes
from .store import Store, keep, python_tensor, unkeep

__all__ = ["Choice", "Figure", "Meter", "OverBudget", "check_budget", "check_budget_fits_passes", "default_budget",
           "figures", "format_bytes", "gradient_bytes", "last_schedule", "model_device", "record_choice",
           "schedule_label", "signature", "stopped_figures", "trained_module"]

_MARGIN = 0.9  # of the free memory, the share a default budget takes


class OverBudget(BaseException):
    """A metered step's saved tensors would pass the budget (a BaseException: a user's `except Exception` must not
    swallow it)."""


@dataclass(frozen=True)
class Choice:
    """The schedule an exact step ran, and why: `accumnorm.last_schedule(model)`.

    `need`: the bytes estimated (or measured, if larger) for the schedule that was judged last, `budget`: the
    budget it was judged against; None where no budget decided (an explicit schedule). `settings`: the schedule's
    settings it ran at, as `accumnorm.backward`'s keyword arguments (``{"keep_every": 2}``; empty for none).
    """

    schedule: str
    reason: str
    need: int | None = None
    budget: int | None = None
    settings: dict[str, Any] = field(default_factory=dict, hash=False)  # a Choice stays hashable

    @property
    def label(self) -> str:
        """The schedule with its settings, as "auto"'s reasons name it: ``segments(keep_every=2)``."""
        return schedule_label(self.schedule, self.settings)


def schedule_label(schedule: str, settings: dict[str, Any]) -> str:
    """A schedule's name with its settings, ``segments(keep_every=2)``; the name alone without any."""
    text = ", ".join(f"{k}={v!r}" for k, v in settings.items())
    return f"{schedule}({text})" if text else schedule


def check_budget(memory_budget: Any) -> None:
    if memory_budget is None:
        return
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int):
        raise TypeError(f"memory_budget must be a number of bytes (an int) or None, got "
                        f"{type(memory_budget).__name__} {memory_budget!r}")
    if memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget}")


def format_bytes(n: float) -> str:
    """A size in the largest binary unit it reaches: `512 bytes`, `48.8 KiB`, `373 MiB`, `1.5 GiB`."""
    if n < 1024:
        return f"{n:.0f} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}" if n < 100 else f"{n:.0f} {unit}"


def check_budget_fits_passes(model: nn.Module, budget: int, micro_batch: Any, samples: int,
                             measured: bool = True) -> None:
    """Refuse, before anything runs, a budget below the step's gradients, which no schedule can lower; and with
    `measured` (an "auto" step of its own, not under a process group, whose ranks must refuse alike), one below what
    passes' meter counted of an earlier step of this shape and size: what passes keeps (at least that, where the
    meter stopped it). Without such a figure the step runs, and passes' meter refuses it if even passes would pass
    the budget."""
    grads = gradient_bytes(model)
    if budget < grads:
        raise ValueError(f"memory_budget is {budget} bytes, but the step's gradients alone take {grads} bytes, which "
                         "no schedule and no micro_batch_size can lower: give a larger budget")
    key = (signature(micro_batch), "passes")
    own = figures(model).get(key) if measured else None
    if own is None or own.samples != samples:  # with a whole-batch loss, passes holds every micro-batch's outputs
        return
    if budget < grads + own.kept:
        about = "at least" if key in stopped_figures(model) else "about"
        raise ValueError(f"memory_budget is {budget} bytes, but even the passes schedule, which keeps least, needs "
                         f"{about} {grads + own.kept} bytes (the step's gradients, {grads}, and {about} {own.kept} "
                         "that its pass of one micro-batch keeps, measured at an earlier step); give a larger "
                         "budget, or a smaller micro_batch_size")


def model_device(model: nn.Module) -> torch.device:
    """Where the model is: its first parameter's device (the CPU for a model without parameters)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def default_budget(device: torch.device) -> int | None:
    """A tenth less than the free memory where the model is: None where it cannot be read (no limit)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * _MARGIN)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * _MARGIN)
    except OSError:
        pass
    return None


def gradient_bytes(model: nn.Module) -> int:
    """The bytes of the gradients a step makes (fresh ones: the caller's are set aside until it commits); a lazy
    parameter, whose size its first forward decides, counts nothing yet."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and not is_lazy(p))


def signature(micro_batch: Any) -> tuple:
    """What a figure per sample depends on besides the model: the micro-batch's size (segments' recomputation, a met
    call's pieces, are one micro-batch's), and each tensor's shape past dim 0, and dtype."""
    leaves = micro_batch.values() if isinstance(micro_batch, dict) else (
        micro_batch if isinstance(micro_batch, (list, tuple)) else [micro_batch])
    rows = next((len(t) for t in leaves if isinstance(t, Tensor) and t.dim() > 0), None)
    return rows, tuple((tuple(t.shape[1:]), t.dtype) if isinstance(t, Tensor) else type(t) for t in leaves)


@dataclass(frozen=True)
class Figure:
    """What a schedule kept at a metered step of `samples` samples: `kept` bytes."""

    kept: int
    samples: int

    def need(self, samples: int) -> int:
        """The bytes a step of `samples` would keep, at most: in proportion above the samples measured (the parts of
        one micro-batch's size stay as they were, so this is more), and as measured below them (a need never grows
        with fewer micro-batches)."""
        return self.kept if samples <= self.samples else -(-self.kept * samples // self.samples)


def _storage(t: Tensor) -> tuple[Any, int]:
    """The memory `t` holds, as a key (each storage once) and its bytes. A tensor whose ops run in Python
    (`store.python_tensor`) is counted by itself, at the bytes of its shape and dtype."""
    if python_tensor(t):
        return ("tensor", id(t)), t.nbytes
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


# model -> {(signature, schedule): Figure}: the figures of its last metered steps
_FIGURES: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Figure]] = weakref.WeakKeyDictionary()
_CHOICES: weakref.WeakKeyDictionary[nn.Module, Choice] = weakref.WeakKeyDictionary()
_STOPPED: weakref.WeakKeyDictionary[nn.Module, set[tuple]] = weakref.WeakKeyDictionary()


def figures(model: nn.Module) -> dict[tuple, Figure]:
    if model not in _FIGURES:
        _FIGURES[model] = {}
    return _FIGURES[model]


def stopped_figures(model: nn.Module) -> set[tuple]:
    """The keys of `figures(model)` that a meter stopped: what the schedule keeps is at least that, and may be more."""
    if model not in _STOPPED:
        _STOPPED[model] = set()
    return _STOPPED[model]


def trained_module(model: nn.Module) -> nn.Module:
    """The module a step trains: `model` without its DDP and `torch.compile` wrappers, so that what is kept of a
    model's steps (`last_schedule`, recompute's measurements) is the same for the model and each wrapper of it."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule":
            model = model._orig_mod
        else:
            return model


def record_choice(model: nn.Module, choice: Choice) -> None:
    _CHOICES[trained_module(model)] = choice


def last_schedule(model: nn.Module) -> Choice | None:
    """The exact schedule `accumnorm.backward` last ran on `model`, and why (None before any exact step). A step on a
    DDP or `torch.compile` wrapper of `model` counts as a step on `model`, and the other way round.

    Example::

        accumnorm.backward(model, batch, loss_fn, micro_batch_size=4)
        accumnorm.last_schedule(model)   # Choice(schedule='layerwise', reason='it fits the memory budget', ...)
    """
    return _CHOICES.get(trained_module(model))


class Meter:
    """Saved-tensor hooks that count the bytes autograd keeps (a storage once, parameters not at all) and raise
    `OverBudget` once they pass `limit`; they pass each tensor on to `store`'s hooks, if any. `reserve` counts what
    the step will hold beside them in its backward, for each of its `samples`. The storages of `existing` (the
    step's batch, of which each micro-batch is a view) were there before the step: the budget is what it adds, so
    they are never counted."""

    def __init__(self, limit: float | None, store: Store | None, samples: int, existing: list[Tensor] = ()) -> None:
        self.limit, self.store, self.samples = limit, store, samples
        self.bytes = 0
        self.peak = 0  # the most counted at one moment: what is kept, and what that moment held beside it (`beside`)
        self._seen: set[int] = {_storage(t)[0] for t in existing}
        self._held: tuple[int, set[int]] = (0, set(self._seen))  # what passes holds across its passes: bytes, storages

    def next_pass(self) -> None:
        """The passes schedule's next pass of one micro-batch: what the last one kept went with its backward (or its
        stop), what every pass holds stays (`hold`); the figure is the most one pass kept."""
        self.peak = max(self.peak, self.bytes)
        self.bytes, self._seen = self._held[0], set(self._held[1])

    def hold(self, tensors: list[Tensor]) -> None:
        """Count `tensors` as held by every pass from now on (passes' outputs of every micro-batch, for a whole-batch
        loss); raise `OverBudget` past the budget."""
        self.next_pass()
        for t in tensors:
            self._add(t)
        self._held = (self.bytes, set(self._seen))

    @property
    def need(self) -> int:
        """The step's figure: the most it held at once of what the meter counts."""
        return max(self.bytes, self.peak)

    def reserve(self, per_sample: float) -> None:
        """Count `per_sample` bytes for each of the step's samples (a region's recomputation in the backward, for every
        micro-batch at once), before the backward makes them; raise `OverBudget` if the budget has no room for them."""
        self.reserve_bytes(int(per_sample * self.samples))

    def reserve_bytes(self, n: int) -> None:
        """Count `n` bytes the backward will hold beside the saved tensors (`reserve`)."""
        self.bytes += n
        self._check()

    def count(self, t: Tensor) -> None:
        """Count a tensor the step keeps for its backward by other means than autograd's saved tensors (each storage
        once; parameters, leaves that require grad and views of either not at all: a Linear's matmul saves its
        weight transposed); raise `OverBudget` past the budget."""
        base = t if t._base is None else t._base
        if not (isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)):
            self._add(t)

    def _add(self, t: Tensor) -> None:
        """Count `t`'s storage, once; raise `OverBudget` past the budget."""
        key, nbytes = _storage(t)
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += nbytes
            self._check()

    def count_objects(self, root: Any, records: tuple[type, ...]) -> None:
        """Count the Python objects of records the step keeps for its backward (`objects`: `root` and what it holds,
        opening `records`' attributes); raise `OverBudget` past the budget. An object that two calls reach is counted
        by each: more than is held, never less."""
        self.bytes += object_bytes(root, records)
        self._check()

    def beside(self, tensors: list[Tensor]) -> None:
        """Count, for this moment only, `tensors` the step holds beside what it keeps (a met call's input and output
        for the whole batch, which a lockstep holds at once while its forwards keep neither); each storage once, none
        already counted. Raise `OverBudget` if the budget has no room for them."""
        storages = dict(map(_storage, tensors))
        now = self.bytes + sum(n for key, n in storages.items() if key not in self._seen)
        self.peak = max(self.peak, now)
        if self.limit is not None and now > self.limit:
            raise OverBudget

    def _check(self) -> None:
        if self.limit is not None and self.bytes > self.limit:
            raise OverBudget

    def hooks(self) -> AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(untraced.wrap(self.pack), untraced.wrap(self.unpack))

    def pack(self, t: Tensor) -> Any:
        self.count(t)
        return self.store.pack(t) if self.store is not None else keep(t)

    def unpack(self, packed: Any) -> Tensor:
        return unkeep(packed) if self.store is None else self.store.unpack(packed)
