"""Gradient accumulation that is exact for BatchNorm: `accumnorm.backward`.

Plain accumulation runs K micro-batches through the model and adds up their gradients. That is the
gradient of the whole batch for every layer but BatchNorm, which normalizes each micro-batch with its
own statistics. `backward(..., bn="exact")` gives every accumnorm BatchNorm call the statistics and
backward sums of the whole batch, while holding the activations of one micro-batch at a time.

Why several passes over the micro-batches. A BN call's statistics depend on every BN call below it,
and its backward sums, sum(dy) and sum(dy * x_hat), on every BN call above it. With L BN calls:

  1. L statistics passes, bottom up: pass j runs the forward up to call j (calls below use their
     now-known whole-batch statistics), adds each micro-batch's moments there, and stops.
  2. Backward sums, top down. Calls t..L-1 (the top ones) each get a "sums pass": forward with grad
     from call j up, backward down to call j's input, where its sums are added up.
  3. One full pass: forward and backward of every micro-batch, accumulating parameter gradients.
     Calls >= t back-propagate exactly (their sums are known); calls < t back-propagate only
     weight * invstd * dy and add their sums (not yet complete: the corrections below feed them).
  4. Correction passes for calls t-1..0, top down: once call j's sums are complete, its missing
     backward term, -weight * invstd * (sum(dy) + x_hat * sum(dy * x_hat)) / N, is a known function
     of the micro-batch's own input. Each pass runs the forward up to call j and back-propagates that
     term from there (gradients are linear, so adding it later is exact), adding to the sums below.

That is 2L + 1 passes (plus one forward of the first micro-batch, which finds where the BN calls
end), the fewest a micro-batch-at-a-time schedule allows: the forward needs L sequential
reductions, the backward L more, and the parameters below the first BN call need its complete sums. A sums pass costs the part of the network above its call, a correction pass the
part below, so the split `t` puts the bottom half under corrections. The cost relative to plain
accumulation grows linearly with the number of BN calls (see benchmarks/bench_backward.py).

Each micro-batch replays the same random numbers in every pass (dropout masks agree), and the call
is transactional: on any error, `.grad` and running statistics are as they were before it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.nn.parameter import is_lazy

from .functional import GradSums, Moments, combine_moments, moments, normalize
from .layers.batchnorm import _AccumBatchNorm

__all__ = ["backward"]

Batch = Union[Tensor, Sequence[Tensor], Mapping[str, Tensor]]
LossFn = Callable[[nn.Module, Any], Tensor]
BN_MODES = ("exact", "micro")


class _Stop(BaseException):
    """Ends a truncated pass at its target BN call. A BaseException so user `except Exception` won't eat it."""


class _Call:
    """One BatchNorm call of the forward: its whole-batch statistics and backward sums."""

    def __init__(self, module: _AccumBatchNorm) -> None:
        self.module = module
        self.parts: list[Moments] = []  # per-micro-batch moments during its statistics pass
        self.stats: Moments | None = None
        self.mean: Tensor | None = None
        self.var: Tensor | None = None
        self.sums: GradSums | None = None
        self.input: Tensor | None = None  # the BN input of the current micro-batch, for sums/correction passes


class _Plan:
    """What each accumnorm BN call does in the current pass; every layer forwards to `batch_norm`."""

    STATS, SUMS, FULL, CORRECT = "stats", "sums", "full", "correct"

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.mode = self.STATS
        self.target = 0
        self.index = 0  # BN calls seen so far in the current micro-batch's forward

    def begin(self, mode: str, target: int) -> None:
        self.mode, self.target = mode, target

    def batch_norm(self, module: _AccumBatchNorm, x: Tensor) -> Tensor:
        i, self.index = self.index, self.index + 1
        if i == len(self.calls) and self.mode == self.STATS and i == self.target:
            self.calls.append(_Call(module))  # first time the forward gets this deep: a new call
        if i >= len(self.calls) or self.calls[i].module is not module:
            raise RuntimeError(
                "accumnorm.backward(bn='exact') needs the same sequence of BatchNorm calls in every forward "
                f"of the step; call {i} went to a different layer than in the first pass"
            )
        call, target = self.calls[i], self.target
        w, b, eps = module.weight, module.bias, module.eps
        if self.mode == self.STATS or (self.mode == self.SUMS and i < target):
            if i == target:
                call.parts.append(moments(x))
                raise _Stop
            return F.batch_norm(x, call.mean, call.var, w, b, False, 0.0, eps)  # no grad needed here
        if self.mode == self.SUMS and i == target:
            # Back-propagation stops at this detached input: the pass only wants this call's sums.
            call.input = x.detach().requires_grad_()
            torch.set_grad_enabled(True)  # the forward below ran without grad; from here up it is needed
            return normalize(call.input, call.mean, call.var, w, b, eps, call.sums)
        if self.mode == self.CORRECT and i == target:
            call.input = x
            raise _Stop
        return normalize(x, call.mean, call.var, w, b, eps, call.sums)


class _Group:
    """The collectives a step needs, no-ops without a process group."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def sum_(self, t: Tensor) -> Tensor:
        if self.group is not None:
            dist.all_reduce(t, group=self.group)
        return t

    def gather_moments(self, m: Moments) -> Moments:
        if self.group is None:
            return m
        flat = m.pack()
        out = [torch.empty_like(flat) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, flat, group=self.group)
        return combine_moments(Moments.unpack(torch.stack(out)))


def _split_point(num_calls: int) -> int:
    """How many bottom BN calls get correction passes (the others get sums passes), see the module doc."""
    return num_calls // 2


def _split(batch: Batch, size: int) -> tuple[list[Any], list[int]]:
    """Cut a tensor, sequence or mapping of tensors into micro-batches of `size` along dim 0."""
    if isinstance(batch, Tensor):
        leaves, rebuild = [("batch", batch)], lambda parts: parts[0]
    elif isinstance(batch, Mapping):
        leaves = list(batch.items())
        rebuild = lambda parts: dict(zip(batch.keys(), parts))  # noqa: E731
    elif isinstance(batch, (list, tuple)):
        leaves = [(f"batch[{i}]", t) for i, t in enumerate(batch)]
        rebuild = lambda parts: type(batch)(parts)  # noqa: E731
    else:
        raise TypeError(f"batch must be a Tensor or a tuple/list/dict of Tensors, got {type(batch).__name__}")
    if not leaves:
        raise ValueError("batch is empty: expected at least one tensor")
    for name, t in leaves:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError(f"{name} is a 0-dim tensor: expected a batch dimension 0")
    lengths = {name: t.shape[0] for name, t in leaves}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"batch tensors must share dimension 0, got lengths {lengths}")
    n = leaves[0][1].shape[0]
    if n == 0:
        raise ValueError("batch is empty: dimension 0 has length 0")
    chunks = [t.split(size) for _, t in leaves]
    return [rebuild(list(parts)) for parts in zip(*chunks)], [min(size, n - i) for i in range(0, n, size)]


def _check_loss(loss: Any, k: int) -> Tensor:
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss_fn must return a scalar Tensor, got {type(loss).__name__} for micro-batch {k}")
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar (0-dim) Tensor, got shape {tuple(loss.shape)} for micro-batch {k}")
    return loss


@contextmanager
def _replay_rng(seed: int | None, devices: list[int]) -> Iterator[None]:
    """Give a micro-batch the same random numbers in every pass (None: leave the RNG alone)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=devices):
        # Seed only the generators in use: torch.manual_seed would also queue a lazy CUDA seeding
        # (with a captured traceback) on every call, a large cost on CPU.
        torch.default_generator.manual_seed(seed)
        for d in devices:
            torch.cuda.default_generators[d].manual_seed(seed)
        yield


class _Step:
    """One call of `backward`: the micro-batches, their loss weights and the passes over them."""

    def __init__(self, model, micro_batches, weights, loss_fn, group: _Group, grad_scaler) -> None:
        self.model, self.micro_batches, self.weights, self.loss_fn = model, micro_batches, weights, loss_fn
        self.group, self.grad_scaler = group, grad_scaler
        self.losses: list[Tensor] = []
        self.seeds: list[int | None] = [None] * len(micro_batches)
        self.devices = sorted({p.device.index for p in model.parameters() if p.device.type == "cuda"})

    def _weighted(self, loss: Tensor, k: int) -> Tensor:
        """This micro-batch's share of the whole-batch mean loss (times the AMP scale, if any)."""
        loss = loss * self.weights[k]
        return self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss

    def _forward(self, k: int, plan: _Plan | None = None) -> Tensor | None:
        """Run loss_fn on micro-batch k; None if a truncated pass stopped it at its target call."""
        try:
            loss = self.loss_fn(self.model, self.micro_batches[k])
        except _Stop:
            return None
        if plan is not None and plan.index != len(plan.calls):
            raise RuntimeError(
                f"micro-batch {k} made {plan.index} BatchNorm calls where micro-batch 0 made {len(plan.calls)}: "
                "bn='exact' needs the same sequence of BatchNorm calls in every forward of the step"
            )
        return _check_loss(loss, k)

    def exact(self, layers: list[_AccumBatchNorm]) -> list[_Call]:
        """The 2L + 1 passes of the module doc; returns the BN calls with their whole-batch statistics."""
        self.seeds = torch.randint(2**62, (len(self.micro_batches),)).tolist()
        plan = _Plan()
        for layer in layers:
            layer._accum_plan = plan
        try:
            self._statistics(plan)
            calls, t = plan.calls, _split_point(len(plan.calls))
            for j in reversed(range(t, len(calls))):
                self._sums_pass(plan, j)
            self.full_pass(plan, t)
            for j in reversed(range(t)):
                self._finish_sums(calls[j])
                self._correction_pass(plan, j)
            return calls
        finally:
            for layer in layers:
                layer._accum_plan = None

    def _each(self, plan: _Plan | None) -> Iterator[int]:
        for k in range(len(self.micro_batches)):
            if plan is not None:
                plan.index = 0
            with _replay_rng(self.seeds[k], self.devices):
                yield k

    def _statistics(self, plan: _Plan) -> None:
        """Passes 1..L: whole-batch statistics, one BN call deeper per pass, until a forward completes."""
        while True:
            j = len(plan.calls)
            plan.begin(plan.STATS, j)
            with torch.no_grad():
                for k in self._each(plan):
                    if self._forward(k, plan) is not None:  # micro-batch 0 never reached call j: there are j
                        return
            call = plan.calls[j]
            parts = call.parts
            local = combine_moments(Moments(torch.stack([p.count for p in parts]),
                                            torch.stack([p.mean for p in parts]), torch.stack([p.m2 for p in parts])))
            # Two or more micro-batches (or ranks) hold at least 2 values per channel: no count check needed.
            call.stats, call.parts = self.group.gather_moments(local), []
            call.mean, call.var = call.stats.mean, call.stats.var
            call.sums = GradSums(call.mean.shape[0], call.stats.count)

    def _finish_sums(self, call: _Call) -> None:
        """Call's sums are complete on this rank: reduce them across ranks and switch it to exact backward."""
        sums = call.sums
        both = self.group.sum_(torch.cat([sums.sum_dy, sums.sum_dy_xhat]))
        sums.sum_dy, sums.sum_dy_xhat = both.chunk(2)
        sums.collect = False

    def _sums_pass(self, plan: _Plan, j: int) -> None:
        plan.begin(plan.SUMS, j)
        call = plan.calls[j]
        for k in self._each(plan):
            with torch.no_grad():  # the BN call switches grad on: nothing below it needs a graph
                loss = self._forward(k, plan)
            # Only the sums (collected by the call's backward) matter, not the gradient itself.
            torch.autograd.grad(self._weighted(loss, k), call.input, allow_unused=True)
        call.input = None
        self._finish_sums(call)

    def full_pass(self, plan: _Plan | None = None, t: int = 0) -> None:
        """Forward/backward of every micro-batch into .grad; without a plan, plain accumulation."""
        if plan is not None:
            plan.begin(plan.FULL, t)
        for k in self._each(plan):
            loss = self._forward(k, plan)
            self.losses.append(loss.detach())
            self._weighted(loss, k).backward()

    def _correction_pass(self, plan: _Plan, j: int) -> None:
        plan.begin(plan.CORRECT, j)
        call = plan.calls[j]
        for k in self._each(plan):
            self._forward(k, plan)
            x, call.input = call.input, None
            if not x.requires_grad:  # nothing below this call learns: no correction to send down
                return
            shape = [1, -1] + [1] * (x.dim() - 2)
            invstd = torch.rsqrt(call.var + call.module.eps)
            scale = invstd if call.module.weight is None else invstd * call.module.weight.detach().to(invstd.dtype)
            x_hat = (x.detach().to(call.mean.dtype) - call.mean.view(shape)) * invstd.view(shape)
            torch.autograd.backward(x, call.sums.correction(x_hat, scale).to(x.dtype))


def _update_running_stats(calls: list[_Call]) -> None:
    """Update running statistics once per BN call, as torch's BatchNorm over the whole batch would."""
    for call in calls:
        m = call.module
        if not (m.training and m.track_running_stats):
            continue
        m.num_batches_tracked.add_(1)
        factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
        n = call.stats.count
        unbiased = call.stats.m2 / (n - 1)
        with torch.no_grad():
            m.running_mean.mul_(1 - factor).add_(call.mean.to(m.running_mean.dtype), alpha=factor)
            m.running_var.mul_(1 - factor).add_(unbiased.to(m.running_var.dtype), alpha=factor)


def unwrap_ddp(model: nn.Module, process_group: Any) -> tuple[nn.Module, Any]:
    """A DDP-wrapped model runs as its inner module: gradients are reduced here, once per step."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module, process_group if process_group is not None else model.process_group
    return model, process_group


def backward(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    *,
    micro_batch_size: int,
    bn: str = "exact",
    process_group: Any = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> Tensor:
    """Accumulate into `.grad` the gradient of the mean loss over `batch`, one micro-batch at a time.

    Args:
        model: the module; `loss_fn(model, micro_batch)` returns the mean loss over a micro-batch.
        batch: a Tensor or a tuple/list/dict of Tensors sharing dim 0, cut into micro-batches of
            `micro_batch_size` (the last may be smaller; every sample weighs the same).
        bn: "exact": accumnorm BatchNorm layers see the whole batch, as if it went through at once
            (torch's own BatchNorm in training mode is refused: convert it with `accumnorm.convert`).
            "micro": each micro-batch uses its own statistics, as plain accumulation does.
        process_group: with torch.distributed, `batch` is this rank's share of the global batch:
            statistics, sums, loss and gradients are reduced over the group (do not wrap the model in
            DDP as well; a DDP-wrapped model is unwrapped and its group used).
        grad_scaler: a `torch.amp.GradScaler`: the loss is scaled by it before backward.

    Returns the whole-batch mean loss, detached. On any error nothing is changed.
    """
    model, process_group = unwrap_ddp(model, process_group)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, micro_batch), got {type(loss_fn).__name__}")
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise TypeError(f"micro_batch_size must be an int, got {type(micro_batch_size).__name__} {micro_batch_size!r}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if bn not in BN_MODES:
        raise ValueError(f"bn must be one of {BN_MODES}, got {bn!r}")
    micro_batches, sizes = _split(batch, micro_batch_size)
    layers = [m for m in model.modules() if isinstance(m, _AccumBatchNorm)]
    if bn == "exact":
        for name, m in model.named_modules():
            if isinstance(m, _BatchNorm) and not isinstance(m, _AccumBatchNorm) and (
                m.training or (m.running_mean is None and m.running_var is None)
            ):
                raise ValueError(
                    f"bn='exact' needs accumnorm BatchNorm layers, but {name or 'the model'} is torch's "
                    f"{type(m).__name__} using batch statistics; convert the model with accumnorm.convert(model), "
                    "or pass bn='micro' for plain accumulation"
                )

    group = _Group(process_group)
    total = sum(sizes)
    if group.group is not None:  # every sample of the global batch weighs the same
        total = int(group.sum_(torch.tensor(total, device=_device(model))).item())
    step = _Step(model, micro_batches, [n / total for n in sizes], loss_fn, group, grad_scaler)

    # Transaction: new gradients go to fresh .grad tensors, merged into the old ones only on success.
    params = [p for p in model.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    norms = [m for m in model.modules() if isinstance(m, _NormBase) and m.track_running_stats]
    saved_stats = [{k: b.clone() for k, b in m._buffers.items() if b is not None and not is_lazy(b)} for m in norms]
    for p in params:
        p.grad = None
    try:
        # One micro-batch on one process is the whole batch: plain BatchNorm is already exact.
        whole = len(micro_batches) == 1 and group.group is None
        exact = bn == "exact" and not whole and any(m.uses_batch_stats() for m in layers)
        calls = step.exact(layers) if exact else step.full_pass()
        losses = torch.stack(step.losses)
        finite = torch.isfinite(losses)
        # Under a GradScaler an overflow is expected now and then: its inf/nan gradients make the
        # scaler skip the step and lower the scale, so only an unscaled run treats it as an error.
        if grad_scaler is None and not bool(finite.all()):
            k = int((~finite).nonzero()[0])
            raise ValueError(f"loss is not finite ({losses[k].item()}) for micro-batch {k}; nothing was changed")
        loss = group.sum_(losses @ torch.tensor(step.weights, dtype=losses.dtype, device=losses.device))
        if group.group is not None:
            _all_reduce_grads(params, group)
    except BaseException:
        for p, g in zip(params, saved_grads):
            p.grad = g
        for m, bufs in zip(norms, saved_stats):
            for k, b in bufs.items():
                m._buffers[k].copy_(b)
        raise
    for p, old in zip(params, saved_grads):
        if old is not None and p.grad is not None:
            p.grad = old.add_(p.grad)
        elif old is not None:
            p.grad = old
    if exact:
        _update_running_stats(calls)
    return loss


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _all_reduce_grads(params: list[nn.Parameter], group: _Group) -> None:
    """Sum this step's gradients over the ranks in one flat all-reduce (unused parameters count as 0)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if not grads:
        return
    flat = group.sum_(torch.cat([g.reshape(-1) for g in grads]))
    for p, chunk in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = chunk.view_as(p).clone() if p.grad is None else p.grad.copy_(chunk.view_as(p))
