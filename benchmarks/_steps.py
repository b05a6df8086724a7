"""One optimizer step's gradient, made each way bench_backward.py compares, and the models prepared for it.

A method is `step(model, batch, micro, case)`: it accumulates into `.grad` the gradient of `case`'s loss over
`batch`, `micro` samples at a time. Here: plain accumulation, the usual loop, the whole batch at once, and three
floors: beside layerwise, its lockstep with nothing else (`lockstep_step`); beside recompute, plain accumulation
with recompute's regions checkpointed (`checkpointed_step`); beside segments, the same with all of its regions
(`segments_floor`). _methods.py names them, with `accumnorm.backward`'s
exact schedules and their settings.

With --compile, the same steps run on torch.compile'd copies of the model (`compiled_model`): plain accumulation
("compiled plain", BatchNorm fused in the graph), each exact schedule ("compiled layerwise", ...), and the compiled
floor: plain accumulation with a graph break at each BatchNorm call, as dynamo makes at each of accumnorm's
batch-statistics calls during a step, and nothing else of accumnorm's.
"""
from __future__ import annotations

import contextlib
import copy
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import greenlet
import torch
import torch.nn as nn
import torch.nn.functional as F
from _models import MODELS, Batch, Case
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

Method = Callable[[nn.Module, Batch, int, Case], None]

def split(batch: Batch, micro: int) -> list[Batch]:
    """The micro-batches of a tensor or a tuple/list of tensors, micro samples each (the last may be smaller)."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(micro))
    return [type(batch)(parts) for parts in zip(*(t.split(micro) for t in batch))]


def samples(batch: Batch) -> int:
    return len(batch if isinstance(batch, torch.Tensor) else batch[0])


def to(batch: Batch, device: torch.device) -> Batch:
    return batch.to(device) if isinstance(batch, torch.Tensor) else type(batch)(t.to(device) for t in batch)


def plain_step(model: nn.Module, batch: Batch, micro: int, case: Case) -> None:
    """Plain accumulation: the models' own BatchNorm, loss * b / B, backward, once per micro-batch."""
    for part in split(batch, micro):
        (case.loss(model, part) * samples(part) / samples(batch)).backward()


def whole_step(model: nn.Module, batch: Batch, micro: int, case: Case) -> None:
    """The whole batch at once, in torch: what accumulation stands in for."""
    plain_step(model, batch, samples(batch), case)


def checkpointed_step(model: nn.Module, batch: Batch, micro: int, case: Case) -> None:
    """Plain accumulation with the regions the recompute schedule would choose for this model each run in torch's
    `checkpoint(use_reentrant=False)`, and nothing else of accumnorm's: what checkpointing those regions costs by
    itself, the floor under recompute's time. No convolution keeps its output, as recompute's may; and the regions
    are torch's checkpoints, where recompute's are frames of its own (`checkpointing.recomputation`)."""
    _checkpointed(model, batch, micro, case, weigh=True)


def segments_floor(keep_every: int | None = None) -> Method:
    """The floor under segments' time at `keep_every` (None: the schedule's default): plain accumulation with every
    region the segments schedule uses (`choose_regions(weigh=False)`, the small ones too) each in torch's checkpoint,
    and nothing else of accumnorm's. Segments recomputes each region one micro-batch at a time, in passes around
    its BatchNorm calls (`checkpointing.region_passes`); a schedule that keeps only the regions' arguments
    recomputes each region once at least, which is what this costs. At keep_every 1 only: above it,
    segments recomputes a region's dropped arguments from the region before, which torch's checkpoint, recomputing
    a region from its own inputs, cannot express; a step at another setting raises `NoFloor`."""
    from accumnorm._engine.schedules.segments import Segments  # the schedule's default, not a public API

    setting = Segments().keep_every if keep_every is None else keep_every

    def step(model: nn.Module, batch: Batch, micro: int, case: Case) -> None:
        if setting != 1:
            raise NoFloor(f"segments at keep_every={setting} recomputes a region's arguments from the region before, "
                          "which torch's checkpoint cannot: its floor is timed at keep_every=1 only")
        _checkpointed(model, batch, micro, case, weigh=False)
    return step


def _checkpointed(model: nn.Module, batch: Batch, micro: int, case: Case, weigh: bool) -> None:
    """Plain accumulation with the step's regions (`choose_regions(model, weigh)`) each in torch's checkpoint."""
    # the schedules' own regions, not a public API
    from accumnorm._engine.checkpointing.checkpointed import patched
    from accumnorm._engine.checkpointing.regions import choose_regions

    with patched(choose_regions(model, weigh), _torch_checkpoint):
        plain_step(model, batch, micro, case)


def _torch_checkpoint(region: object, forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """A region's call in torch's checkpoint, its tensors passed in and its arguments' structure built afresh around
    them, as recompute's region call does: a list the caller appends to after the call (DenseNet's features) is
    recomputed as the forward saw it."""
    leaves, spec = tree_flatten((args, kwargs))
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def run(*inputs: torch.Tensor) -> Any:
        filled = list(leaves)
        for i, t in zip(tensors, inputs):
            filled[i] = t
        a, kw = tree_unflatten(filled, spec)
        return forward(*a, **kw)

    return checkpoint(run, *[leaves[i] for i in tensors], use_reentrant=False, preserve_rng_state=True)


class NoFloor(ValueError):
    """A model a floor cannot run (bench_backward.py shows "n/a" for it)."""


class _Pause:
    """A micro-batch's forward, paused at a BatchNorm layer's call with its piece of the input."""

    def __init__(self, layer: nn.Module, piece: torch.Tensor) -> None:
        self.layer, self.input = layer, piece


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def lockstep_step(model: nn.Module, batch: Batch, micro: int, case: Case) -> None:
    """The layerwise schedule's lockstep and nothing else: the floor under its time.

    Each micro-batch's forward runs as a greenlet on this thread and pauses at every call of one of torch's
    BatchNorm layers; once all have paused there, the layer's own forward normalizes their pieces concatenated,
    and each goes on with its rows. Then one backward over the K losses (or the whole batch's loss). The
    gradient is the whole batch's, as layerwise's is, without any of accumnorm's checks, state swaps, random
    streams or transaction. Only torch's own BatchNorm layers are met, outside checkpointed regions (whose
    recomputation in the backward is made exact by accumnorm's machinery alone): any other model is refused
    with `NoFloor`.
    """
    driver = greenlet.getcurrent()

    def pause(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # A checkpointed region's saved-tensor hooks are the thread's: the interleaved forwards would share them.
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            raise NoFloor("the lockstep floor meets no BatchNorm call inside a checkpointed region")
        return driver.switch(_Pause(layer, x))

    layers = [m for m in model.modules() if type(m) in _BATCH_NORMS and m.training]
    if len(layers) != sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise NoFloor("the lockstep floor meets torch's BatchNorm1d/2d/3d layers in training mode only")
    for m in layers:
        vars(m)["forward"] = types.MethodType(pause, m)
    parts = split(batch, micro)
    forward = case.micro_forward
    try:
        forwards = [greenlet.greenlet(lambda part: forward(model, part)) for _ in parts]
        ends = [g.switch(part) for g, part in zip(forwards, parts)]
        while any(isinstance(end, _Pause) for end in ends):
            if not all(isinstance(end, _Pause) and end.layer is ends[0].layer for end in ends):
                raise RuntimeError("the micro-batches' forwards did not meet at the same BatchNorm call")
            layer = ends[0].layer
            whole = type(layer).forward(layer, torch.cat([end.input for end in ends]))
            rows = whole.unsafe_split_with_sizes([len(end.input) for end in ends])  # ReLU(inplace=True) next
            ends = [g.switch(y) for g, y in zip(forwards, rows)]
    finally:
        for m in layers:
            vars(m).pop("forward", None)
    if case.batch_loss is None:
        torch.autograd.backward([loss * samples(part) / samples(batch) for loss, part in zip(ends, parts)])
    else:
        case.batch_loss(_concatenated(ends), None).backward()


def _concatenated(outputs: list[Any]) -> Any:
    """The micro-batches' outputs, a tensor or a tuple of them each, concatenated along dim 0."""
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    return type(outputs[0])(torch.cat(parts) for parts in zip(*outputs))


COMPILED_PLAIN, COMPILED_FLOOR = "compiled plain", "compiled floor"


def compiled(schedule: str) -> str:
    """The name of `schedule` run on a compiled model."""
    return f"compiled {schedule}"


def is_compiled(method: str) -> bool:
    return method.startswith("compiled ")


def compiled_methods(schedules: list[str]) -> list[str]:
    """The methods timed on compiled models, in the compile table's order: plain, the floor, each schedule."""
    return [COMPILED_PLAIN, COMPILED_FLOOR, *map(compiled, schedules)]


def break_at_batch_norms(model: nn.Module) -> nn.Module:
    """`model` with each BatchNorm layer's forward run untraced (`torch.compiler.disable`): compiled, its graph
    breaks at each BatchNorm call, as dynamo's does at each batch-statistics call during accumnorm's step, and the
    layer normalizes in eager torch, as accumnorm's handler does."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            vars(m)["forward"] = torch.compiler.disable(m.forward)
    return model


def compiled_model(method: str, model: nn.Module, backend: str | Callable) -> nn.Module:
    """The model `method` runs on, made from a copy of the base model: torch.compile of it for a compiled method
    (for the floor, after `break_at_batch_norms`), the copy itself otherwise."""
    if not is_compiled(method):
        return model
    return torch.compile(break_at_batch_norms(model) if method == COMPILED_FLOOR else model, backend=backend)


@contextlib.contextmanager
def compiling_apart(models: int) -> Iterator[None]:
    """Dynamo as in a new process, with room for `models` compiled copies of one network: its recompile limit
    counts the graphs of each code object, which the copies share (a residual block's forward holds one graph per
    block shape in each compiled copy that breaks its graph inside blocks), so it is multiplied by their number and
    no copy runs blocks uncompiled for the others' graphs."""
    import torch._dynamo

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit * models):
        yield


def first_step(method: str) -> contextlib.AbstractContextManager:
    """Where `method`'s first step runs: a compiled model's, which compiles it, with inductor's caches empty (a
    fresh cache directory, the in-memory caches cleared), as in a new process on a new machine, so that its
    compile time owes nothing to kernels an earlier method compiled."""
    if not is_compiled(method):
        return contextlib.nullcontext()
    from torch._inductor.utils import fresh_cache  # not a public API

    return fresh_cache()


class CountBN(TorchFunctionMode):
    """Counts the training-mode F.batch_norm calls made under it (torch's, timm's, anyone's BatchNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm and kwargs.get("training", args[5] if len(args) > 5 else False):
            self.calls += 1
        return func(*args, **kwargs)


def bn_calls(model: nn.Module, batch: Batch, loss_fn: Callable[[nn.Module, Batch], torch.Tensor]) -> int:
    """L: the BatchNorm calls one forward makes (counted on a copy, on 2 samples, without grad)."""
    with torch.no_grad(), CountBN() as count:
        loss_fn(copy.deepcopy(model), split(batch, 2)[0])
    return count.calls


def prepare(name: str, size: int, volume: int, device: torch.device) -> tuple[nn.Module, Batch] | None:
    """The model (seeded, no dropout) and its batch on the device; None, with a note, if its library is missing."""
    case = MODELS[name]
    torch.manual_seed(0)
    try:
        model = case.build().train().to(device)
    except ImportError as e:  # a benchmark extra that is not installed
        print(f"note: {name} skipped: {e}", file=sys.stderr, flush=True)
        return None
    for m in model.modules():  # dropout would make the runs differ; timing does not need it
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return model, to(case.batch(size, volume), device)
