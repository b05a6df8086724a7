"""What exact mode refuses.

Before a step: layers whose batch statistics no schedule can see or make exact (a TorchScript BatchNorm, a
torch.compile'd module with fullgraph=True, CUDA graphs or compiled autograd, nn.DataParallel's replica threads,
a layer that declares it through `accumnorm_exact_refusal` or that `known` names, a norm function of
torch.nn.functional a library replaced), and backward hooks that would hook the met call's node rather than the
layer's. After it, the step's ledger holds every BatchNorm forward to a call the step saw
(`step.ledger.check_every_call_seen`).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

from .known import library_refusal
from .torchs import refuse_replaced_norm_function

__all__ = ["backward_hooked", "gradient_hooks", "has_norm_statistics", "refuse_node_backward_hooks",
           "refuse_unseen_batch_norms"]


def refuse_unseen_batch_norms(names: dict[nn.Module, str], schedule: str) -> None:
    """Refuse, before anything runs, the layers whose batch statistics no schedule could see or make exact
    (`names`: the model's modules, `tree.module_names`)."""
    holders: dict[tuple[Any, ...], nn.Module] = {}  # where a running_mean's values are -> the layer holding it
    calls: set[str] = set()  # the norm functions of torch's whose calls the step meets, by the model's layers
    for m, name in names.items():
        if isinstance(m, _BatchNorm):
            calls.add("batch_norm")
        elif _has_statistics(m):
            calls.add("instance_norm")
        where = name or "the model"
        if isinstance(m, _BatchNorm) and m.running_mean is not None:
            other = holders.setdefault(_memory(m.running_mean), m)
            if other is not m:
                raise ValueError(f"bn='exact': the BatchNorm layers {names[other] or 'the model'} and {where} hold the "
                                 "same running_mean tensor, or two tensors over the same memory (a .detach() or .data "
                                 "of the other's). The step tells a layer's calls apart by the layer that holds its "
                                 "running statistics, and could not count these. Nothing was changed. Give each layer "
                                 "its own running statistics (or call one layer twice), or pass bn='micro'")
        if isinstance(m, torch.jit.ScriptModule) and "BatchNorm" in getattr(m, "original_name", ""):
            raise ValueError(f"bn='exact' cannot see the BatchNorm of the TorchScript module {where} "
                             f"({m.original_name}): TorchScript runs it in C++. Script the model after training, or "
                             "pass bn='micro'")
        _refuse_compile_options(m, name, schedule)
        if isinstance(m, nn.DataParallel) and len(m.device_ids) > 1:
            raise ValueError(f"bn='exact' cannot see the BatchNorm calls of nn.DataParallel ({where}): its replicas "
                             "run in threads of their own. Use torch.distributed (accumnorm.backward's process_group, "
                             "or the Trainer under torchrun), or one device")
        # A method, looked up on the class: nn.Module's __getattr__ is slow to say a module has none.
        refusal = getattr(type(m), "accumnorm_exact_refusal", None)
        reason = refusal(m, schedule) if callable(refusal) else library_refusal(m)
        if reason:
            raise ValueError(f"bn='exact' cannot make {type(m).__name__} ({where}) exact under the {schedule} "
                             f"schedule: {reason}")
    for name in sorted(calls):
        refuse_replaced_norm_function(name)


def _memory(t: Tensor) -> tuple[Any, ...]:
    """Where a tensor's values are: two tensors over the same elements (one a .detach() or .data of the other) are
    one running statistic; one without elements of its own (a lazy layer's before its first call, an empty, meta or
    fake tensor) is told apart by identity."""
    if is_lazy(t) or t.numel() == 0 or t.device.type == "meta":
        return (id(t),)
    try:
        return t.device, t.data_ptr(), t.stride(), t.shape
    except RuntimeError:
        return (id(t),)


def _refuse_compile_options(m: nn.Module, name: str, schedule: str) -> None:
    """A module torch.compile runs with options no step can keep exact: `fullgraph=True`, which makes the graph break
    at each BatchNorm call (`untraced`) an error; CUDA graphs on CUDA, which replay each graph into the same output
    memory while a step holds every micro-batch's outputs of it at once; and, but under passes, compiled autograd,
    whose context each compiled call enters and leaves, which the micro-batches' interleaved forwards would leave out
    of order."""
    context = _compile_context(m)
    if context is None:
        return
    compiled = f"the torch.compile'd module {name}" if name else "the torch.compile'd model"
    if schedule != "passes" and torch._dynamo.config.compiled_autograd:
        raise ValueError(f"bn='exact' cannot run {compiled} under compiled autograd "
                         "(torch._dynamo.config.compiled_autograd=True) with the micro-batches' forwards interleaved "
                         f"({schedule}): each compiled call enters a compiled-autograd context that they would leave "
                         "out of order. Nothing was changed. Set compiled_autograd=False for the step, or pass "
                         "schedule='passes', which runs each micro-batch's forward alone")
    # A module without a norm layer breaks no graph at a layer's call; a direct F.batch_norm call in it fails inside
    # the step, which is then undone, with dynamo's error and `untraced.REASON`.
    if _fullgraph(context) and has_norm_statistics(m.modules()):
        raise ValueError(f"bn='exact' needs a graph break at each BatchNorm call of {compiled}, where the "
                         "micro-batches meet, but it was compiled with fullgraph=True, which makes a graph break an "
                         "error. Nothing was changed. Compile it with fullgraph=False (the default), or pass "
                         "bn='micro'")
    backend = _backend(context)
    config = getattr(backend, "config", None)
    cudagraphs = getattr(backend, "_compiler_name", None) == "cudagraphs" or (
        isinstance(config, dict) and bool(config.get("triton.cudagraphs")))
    if cudagraphs and any(p.is_cuda for p in m.parameters()):
        raise ValueError(f"bn='exact' cannot run {compiled} under CUDA graphs (mode='reduce-overhead' or "
                         "'max-autotune', or the cudagraphs backend): a CUDA graph replays into the same output "
                         "memory at each call, while the step holds every micro-batch's outputs of it at once. Nothing "
                         "was changed. Compile it with mode='default' or 'max-autotune-no-cudagraphs'")


def _compile_context(m: nn.Module) -> object | None:
    """The dynamo context that runs `m`'s forward, if torch.compile does: its wrapper's (`torch.compile(module)`), or
    the one in the closure of `module.compile()`'s compiled call."""
    if type(m).__name__ == "OptimizedModule":
        return getattr(m, "dynamo_ctx", None)
    compiled = vars(m).get("_compiled_call_impl")
    if compiled is None:
        return None
    cells = getattr(compiled, "__closure__", None) or ()
    contexts = (c.cell_contents for c in cells)
    return next((c for c in contexts if isinstance(c, torch._dynamo.eval_frame._TorchDynamoContext)), None)


def _fullgraph(context: object) -> bool:
    """Whether a dynamo context compiles with fullgraph=True: its own setting, or in torch 2.8 its callback's."""
    if hasattr(context, "fullgraph"):
        return bool(context.fullgraph)
    return bool(getattr(getattr(context, "callback", None), "_one_graph", False))


def _backend(context: object) -> object:
    """The compiler a dynamo context hands its graphs to (inductor's wrapper keeps its options in `config`)."""
    backend = getattr(context, "callback", None)
    for _ in range(4):  # dynamo's wrappers around it, each pointing to the next
        inner = getattr(backend, "_torchdynamo_orig_backend", None)
        if inner is None:
            break
        backend = inner
    return backend


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
    return any(_has_statistics(m) for m in modules)


def _has_statistics(m: nn.Module) -> bool:
    return isinstance(m, _BatchNorm) or (isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats)


def gradient_hooks(model: nn.Module, schedule: str) -> str | None:
    """Why `schedule`, which back-propagates each micro-batch more than once, cannot run `model` exactly: a hook on a
    parameter's gradient (`Tensor.register_hook`, `register_post_accumulate_grad_hook`), which whole-batch torch calls
    once with the whole batch's gradient, would be called at each of those backwards with a part of it (a clamp of
    each part is not a clamp of the sum). None if no parameter has one."""
    for name, p in model.named_parameters():
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            return (f"the {schedule} schedule back-propagates each micro-batch several times, so the hook on the "
                    f"gradient of the parameter {name} would be called with a part of the whole batch's gradient at "
                    "each, where whole-batch torch calls it once with all of it")
    return None


def backward_hooked(modules: Iterable[nn.Module], in_graph: bool) -> bool:
    """Whether the backward may not be linear in its gradient: a full backward hook or pre-hook on one of `modules` (or
    a global one), or, `in_graph`, a hook a forward of the step registered on a tensor (`Watch.tensor_hooks`) or a
    custom autograd.Function of yours in the graph (`graphs.holds_user_functions`), whose backward may clamp the
    gradient it gets. The schedules that add a call's backward in parts, a correction after the rest (passes, and
    segments inside a region), need the backward below the call linear: with such a hook, every call gets its
    backward sums before the gradient goes below it, and that gradient is whole.

    A hook set on a graph node (`grad_fn.register_hook`) is not seen (docs/exact-covers.md)."""
    hooks = torch.nn.modules.module
    return (in_graph or bool(hooks._global_backward_hooks or hooks._global_backward_pre_hooks)
            or any(m._backward_hooks or m._backward_pre_hooks for m in modules))
