"""What exact mode refuses.

Before a step: layers whose batch statistics no schedule can see or make exact (a TorchScript BatchNorm,
a BatchNorm inside a torch.compile'd module, nn.DataParallel's replica threads, a layer that declares it through
`accumnorm_exact_refusal`), and backward hooks that would hook the met call's node rather than the layer's. After
it, the step's ledger holds every BatchNorm forward to a call the step saw (`step.ledger.check_every_call_seen`).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["refuse_unseen_batch_norms", "refuse_node_backward_hooks", "has_norm_statistics"]


def refuse_unseen_batch_norms(names: dict[nn.Module, str], schedule: str) -> None:
    """Refuse, before anything runs, the layers whose batch statistics no schedule could see or make exact
    (`names`: the model's modules, `tree.module_names`)."""
    holders: dict[int, nn.Module] = {}  # id(running_mean) -> the BatchNorm layer holding it
    for m, name in names.items():
        where = name or "the model"
        if isinstance(m, _BatchNorm) and m.running_mean is not None:
            other = holders.setdefault(id(m.running_mean), m)
            if other is not m:
                raise ValueError(f"bn='exact': the BatchNorm layers {names[other] or 'the model'} and {where} hold the "
                                 "same running_mean tensor. The step tells a layer's calls apart by the layer that "
                                 "holds its running statistics, and could not count these. Nothing was changed. Give "
                                 "each layer its own running statistics (or call one layer twice), or pass bn='micro'")
        if isinstance(m, torch.jit.ScriptModule) and "BatchNorm" in getattr(m, "original_name", ""):
            raise ValueError(f"bn='exact' cannot see the BatchNorm of the TorchScript module {where} "
                             f"({m.original_name}): TorchScript runs it in C++. Script the model after training, or "
                             "pass bn='micro'")
        if _compiled(m) and any(isinstance(d, _BatchNorm) and (d.training or d.running_mean is None)
                                for d in m.modules()):
            compiled = f"the torch.compile'd module {name}" if name else "the torch.compile'd model"
            raise ValueError(f"bn='exact' cannot see the BatchNorm calls inside {compiled}: "
                             "dynamo compiles them into its graph, where each normalizes one micro-batch alone, and "
                             "would trace the step's own code at each of them. Nothing was changed. Compile the parts "
                             "between the BatchNorm layers (each block's convolutions, say), train uncompiled, or pass "
                             "bn='micro'")
        if isinstance(m, nn.DataParallel) and len(m.device_ids) > 1:
            raise ValueError(f"bn='exact' cannot see the BatchNorm calls of nn.DataParallel ({where}): its replicas "
                             "run in threads of their own. Use torch.distributed (accumnorm.backward's process_group, "
                             "or the Trainer under torchrun), or one device")
        # A method, looked up on the class: nn.Module's __getattr__ is slow to say a module has none.
        refusal = getattr(type(m), "accumnorm_exact_refusal", None)
        reason = refusal(m, schedule) if callable(refusal) else None
        if reason:
            raise ValueError(f"bn='exact' cannot make {type(m).__name__} ({where}) exact under the {schedule} "
                             f"schedule: {reason}")


def _compiled(m: nn.Module) -> bool:
    """Whether torch.compile runs `m`'s forward: its wrapper (`torch.compile(module)`) or `module.compile()`."""
    return type(m).__name__ == "OptimizedModule" or vars(m).get("_compiled_call_impl") is not None


def refuse_node_backward_hooks(names: dict[nn.Module, str]) -> None:
    """Refuse `register_backward_hook` (the deprecated, not-full kind) on a BatchNorm layer, or process-wide: it hooks
    the autograd node that made the layer's output, which under bn='exact' is the node handing each micro-batch its
    rows of the whole batch's output, not the BatchNorm's."""
    module_hooks = nn.modules.module
    if module_hooks._global_backward_hooks and module_hooks._global_is_full_backward_hook is False:
        if any(isinstance(m, _BatchNorm) for m in names):
            raise ValueError("bn='exact' cannot run a module backward hook registered with "
                             "register_module_backward_hook on the model's BatchNorm layers: it would see the "
                             "gradient of the node that hands out each micro-batch's rows. Nothing was changed. Use "
                             "register_module_full_backward_hook instead")
    for m, name in names.items():
        if isinstance(m, _BatchNorm) and m._backward_hooks and m._is_full_backward_hook is False:
            raise ValueError(f"bn='exact' cannot run the backward hook registered with register_backward_hook on "
                             f"{type(m).__name__} {name or '(the model)'}: it would see the gradient of the node that "
                             "hands out each micro-batch's rows of the whole batch's output. Nothing was changed. "
                             "Use register_full_backward_hook instead")


def has_norm_statistics(modules: Iterable[nn.Module]) -> bool:
    """Whether the model (its `modules`) has a layer that normalizes with batch statistics or keeps running ones (an
    InstanceNorm without running statistics normalizes each sample alone: it has none)."""
    return any(isinstance(m, _BatchNorm) or (isinstance(m, nn.modules.instancenorm._InstanceNorm)
                                             and m.track_running_stats) for m in modules)
