"""A step of plain gradient accumulation computed as one forward/backward of the whole batch.

Plain accumulation runs K micro-batches of B samples through the model with the weights fixed
(the optimizer steps only after the K-th) and adds up the gradients of each micro-batch's mean
loss divided by K. For a model whose layers treat each sample on its own (convs, ReLU,
max-pool, GroupNorm, InstanceNorm without running statistics, LayerNorm, no norm), that is
exactly the gradient of the mean loss over the whole batch in one forward: the same sum of
per-sample terms. torch's BatchNorm couples the samples of a micro-batch only, through that
micro-batch's statistics, and updates its running statistics once per micro-batch, in order.
Both are reproduced in one forward by "ghost batches": the whole batch goes through once, and
each BatchNorm normalizes each group of B consecutive samples with that group's own statistics
and then updates its running statistics K times in order with them.

At micro-batch 1 a step of the study's net is a chain of small calls; one call per layer for the
whole batch instead of K does the same arithmetic in a fraction of the time. The runner uses this
for every plain-accumulation cell whose model `fusable` accepts; tests/study/test_study_fused.py checks
it against the literal K-micro-batch loop (float64, several optimizer steps, parameters and
running statistics).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from ..layers import EvoNorm2dS0, FilterResponseNorm2d
from ._model import SimpleModel, SingleRun, StackedConv2d, StackedModel

__all__ = ["fusable", "use_ghost_batches", "ghost_batch_norm"]

# Layers that compute each sample's output from that sample alone, and keep no state across calls.
_PER_SAMPLE = (nn.Conv2d, StackedConv2d, nn.Linear, nn.ReLU, nn.MaxPool2d, nn.Identity, nn.GroupNorm, nn.LayerNorm,
               FilterResponseNorm2d, EvoNorm2dS0)
_CONTAINERS = (nn.Sequential, SimpleModel, StackedModel, SingleRun)


def fusable(model: nn.Module) -> bool:
    """Whether a plain-accumulation step of `model` equals one whole-batch forward with ghost batches.

    True when every layer is per-sample (see _PER_SAMPLE; InstanceNorm only without running
    statistics) or torch's BatchNorm with numeric or cumulative momentum; False for anything else
    (e.g. Batch Renormalization, whose correction depends on running statistics that change between
    the micro-batches of a step), which then goes through the literal loop.
    """
    for m in model.modules():
        if isinstance(m, _InstanceNorm):
            if m.track_running_stats:
                return False
        elif isinstance(m, _BatchNorm):
            if isinstance(m, nn.SyncBatchNorm):
                return False
        elif not isinstance(m, _PER_SAMPLE + _CONTAINERS):
            return False
    return True


def use_ghost_batches(model: nn.Module, size: int) -> None:
    """Make every BatchNorm of `model` normalize groups of `size` samples on their own (see ghost_batch_norm).

    In eval mode with running statistics the layers are unchanged.
    """
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            # NOTE: an instance attribute shadows the class's forward for this private model only;
            # the module, its parameters and its state_dict stay torch's.
            m.forward = functools.partial(ghost_batch_norm, m, size=size)


def ghost_batch_norm(module: _BatchNorm, x: Tensor, size: int) -> Tensor:
    """`module`'s output for `x` as if x went through it in groups of `size` samples, one after the other.

    Each group is normalized with its own batch statistics and, in training mode, the running
    statistics are updated once per group in order, as K calls of `module` on the K groups would.
    """
    if not module.training and module.running_mean is not None:
        return type(module).forward(module, x)
    module._check_input_dim(x)
    n, c = x.shape[:2]
    if n % size:
        raise ValueError(f"expected a batch that splits into groups of {size}, got {n} samples")
    k = n // size
    if size * math.prod(x.shape[2:]) == 1:  # torch's own check, on what one group would be
        raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                         f"{torch.Size([size, *x.shape[1:]])}")
    # Groups side by side as channels, (K*B, C, *) -> (B, K*C, *): one native batch norm call then
    # normalizes each group of each channel with its own statistics.
    grouped = x.unflatten(0, (k, size)).transpose(0, 1).flatten(1, 2)
    weight = module.weight.repeat(k) if module.weight is not None else None
    bias = module.bias.repeat(k) if module.bias is not None else None
    track = module.training and module.track_running_stats
    # With momentum 1 the kernel writes each group's mean and unbiased variance into these, as it
    # would blend them into running statistics: the very numbers torch's BatchNorm would use.
    mean, var = (torch.zeros(k * c, dtype=x.dtype, device=x.device) for _ in range(2)) if track else (None, None)
    out = F.batch_norm(grouped, mean, var, weight, bias, True, 1.0, module.eps)
    if track:
        _update_in_order(module, mean, var, k)
    return out.unflatten(1, (k, c)).transpose(0, 1).flatten(0, 1)


@torch.no_grad()
def _update_in_order(module: _BatchNorm, mean: Tensor, var: Tensor, k: int) -> None:
    """Running statistics after K updates with the groups' (K*C,) statistics, as torch's BatchNorm makes them."""
    n0 = int(module.num_batches_tracked)
    factors = [module.momentum if module.momentum is not None else 1.0 / (n0 + i) for i in range(1, k + 1)]
    # r_K = prod(1 - f_i) r_0 + sum_i f_i prod_{j > i}(1 - f_j) s_i: the K updates unrolled.
    weights, keep = [], 1.0
    for f in reversed(factors):
        weights.append(f * keep)
        keep *= 1.0 - f
    w = torch.tensor(weights[::-1], dtype=mean.dtype, device=mean.device)
    for running, stat in ((module.running_mean, mean), (module.running_var, var)):
        running.mul_(keep).add_((w @ stat.view(k, -1)).to(running.dtype))
    module.num_batches_tracked.add_(k)
