"""A step as a transaction: whatever ends it early, the model's gradients, parameters, buffers and modes are as
they were.

The step writes its gradients to fresh `.grad` tensors, the caller's set aside; buffers (running
statistics, counters) are copied before it starts. Leaves outside the model that the losses reach (an
input that requires grad, a temperature held outside the model) are found in the graph before each of
the step's backwards (`backward`) and join the transaction there, their gradients set aside the same
way. `commit` adds the step's gradients into the caller's in place, as autograd accumulates them (a `.grad`
that is a view of a flat buffer, or one the caller holds, stays that tensor), each copied aside first, so
that until `backward` returns `rollback` can still restore them, even when an interrupt arrives in the
middle of the merge. A lazy module (torch's `Lazy*` layers, accumnorm's norms built without a channel count) that
the step's first forward materialized is made lazy again, and a buffer, parameter or layer a forward registered is
taken out. A step whose forwards changed a buffer, other than the running statistics it updates itself once, is
refused (`refuse_buffers_changed`): each micro-batch's forward changed it where the whole batch's would once.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.parameter import is_lazy

from .tree import module_names, parameters

__all__ = ["Transaction"]


class Transaction:
    """What a step may change in `model`: every parameter's `.grad` and every buffer (module doc)."""

    def __init__(self, model: nn.Module, names: dict[nn.Module, str] | None = None) -> None:
        self.names = module_names(model) if names is None else names  # every module, once, with its name
        self.modules = list(self.names)  # what the step walks over
        self.all_params = parameters(self.modules)
        # (module, name, the parameter): a forward may swap in other tensors (torch.func.functional_call), which the
        # interleaved micro-batches can leave there; the step refuses that and puts the model's own back.
        self.slots = [(m, name, p) for m in self.modules for name, p in m._parameters.items()]
        self.training = [m.training for m in self.modules]  # a loss_fn may switch modes (model.eval() at its end)
        self.params = [p for p in self.all_params if p.requires_grad]
        self.grads: list[Tensor | None] = [p.grad for p in self.params]
        self.leaves: list[tuple[Tensor, Tensor | None]] = []  # leaves outside the model, with their .grad before
        self.merged: list[tuple[Tensor, Tensor]] = []  # each .grad the commit added into, with its values before
        self._known = {id(p) for p in self.params}
        # (module, name, the buffer object, a copy of its values): a forward may change a buffer in place or
        # replace it by another tensor; both are undone.
        self.buffers = [(m, name, b, b.clone()) for m in self.modules for name, b in m._buffers.items()
                        if b is not None and not is_lazy(b)]
        # a buffer a failed step registered goes (a TorchScript module's C++ table registers none from Python), and
        # so does a parameter or a submodule (a layer a forward makes at its first call)
        self.buffer_names = [tuple(m._buffers) if isinstance(m._buffers, dict) else None for m in self.modules]
        self.registered = [(m, tuple(m._parameters), tuple(m._modules)) for m in self.modules
                           if isinstance(m._parameters, dict) and isinstance(m._modules, dict)]
        self.lazy = [_Lazy(m) for m in self.modules
                     if any(t is not None and is_lazy(t) for t in (*m._parameters.values(), *m._buffers.values()))]

    def cuda_devices(self) -> list[int]:
        """The CUDA devices the model's parameters and buffers are on (frozen and lazy ones too)."""
        if not torch.cuda.is_initialized():  # a CUDA tensor initializes CUDA: none exists yet
            return []
        return sorted({t.device.index for m in self.modules for t in (*m._parameters.values(), *m._buffers.values())
                       if t is not None and t.device.type == "cuda"})

    def begin(self) -> None:
        """Set the caller's gradients aside: the step accumulates into fresh ones."""
        for p in self.params:
            p.grad = None
        for leaf, _ in self.leaves:
            leaf.grad = None

    def backward(self, tensors: Tensor | Sequence[Tensor], grad_tensors: Sequence[Tensor] | None = None,
                 inputs: Sequence[Tensor] | None = None) -> None:
        """`torch.autograd.backward`, every leaf it will write a gradient to made part of the transaction first
        (given `inputs`, the step's own tensors, only those get one)."""
        roots = [tensors] if isinstance(tensors, Tensor) else list(tensors)
        if inputs is None:
            self._take(_leaves(roots))
        torch.autograd.backward(roots, grad_tensors, inputs=inputs)

    def join(self, leaves: Sequence[Tensor]) -> None:
        """Leaves a backward of the step's will write a gradient to: those outside the model join the transaction."""
        self._take(leaves)

    def _take(self, leaves: Sequence[Tensor]) -> None:
        for leaf in leaves:
            if leaf.is_leaf and id(leaf) not in self._known:
                self._known.add(id(leaf))
                self.leaves.append((leaf, leaf.grad))
                leaf.grad = None

    def commit(self) -> None:
        """Add the step's gradients into the caller's (module doc): in place where autograd would add in place, else
        as a new tensor."""
        in_place = []
        for p, old in (*zip(self.params, self.grads), *self.leaves):
            if old is None:
                continue
            new = p.grad
            if new is not None and _adds_in_place(old, new):
                in_place.append((p, old, new))
            else:
                p.grad = old if new is None else old + new
        with torch.no_grad():
            for p, old, new in in_place:
                self.merged.append((old, old.clone()))  # before the add: a rollback puts back what it finds here
                old.add_(new)
                p.grad = old

    def refuse_parameters_replaced(self) -> None:
        """Raise if a module of the model holds another tensor in a parameter's place than before the step."""
        for m, name, p in self.slots:
            if m._parameters.get(name, p) is not p:
                layer = f"{type(m).__name__} {self.names.get(m) or '(the model)'}"
                raise ValueError(
                    f"bn='exact': after the micro-batches' forwards, {layer} holds another tensor as its parameter "
                    f"{name!r} than before the step. A forward that swaps "
                    "parameters in and back (torch.func.functional_call, torch.nn.utils.stateless) across a BatchNorm "
                    "call restores them out of order: the micro-batches' forwards run interleaved, meeting at every "
                    "BatchNorm call, and some ran with the wrong ones. Nothing was changed. Swap the parameters "
                    "around the step instead of inside your function, or use schedule='passes', which runs each "
                    "micro-batch's forward alone")

    def refuse_buffers_changed(self, micro_batches: int, kept: Callable[[nn.Module, str], bool]) -> None:
        """Raise if the micro-batches' forwards left a buffer of the model with other values than it held before the
        step (changed in place, or another tensor put in its place), but those the step updates itself (`kept(module,
        name)`): each forward changed it where the whole batch's would once, and each later micro-batch ran with what
        the earlier ones left (a spectral norm's power iteration, a quantization observer, a queue of past outputs).
        Values, not version counters: a fused observer's op changes its buffers in place without counting it."""
        for m, name, _, saved in self.buffers:
            now = m._buffers.get(name)
            if kept(m, name) or (now is not None and (now.shape, now.dtype, now.device) == (
                    saved.shape, saved.dtype, saved.device) and torch.equal(now, saved)):
                continue  # a buffer put back with the same values (a cache registered again) is the same
            layer = f"{type(m).__name__} {self.names.get(m) or '(the model)'}"
            raise ValueError(
                f"bn='exact': the micro-batches' forwards changed the buffer {name!r} of {layer}. Each of the "
                f"{micro_batches} forwards changes it where the whole batch's forward would once, and each later "
                "micro-batch runs with what the earlier ones left, so the step would not be the whole batch's. Nothing "
                "was changed. Change such state outside the step (once, before or after it), keep the module in eval "
                "mode for the step if it changes its state only in training, or pass bn='micro' for plain "
                "accumulation")

    def rollback(self) -> None:
        """The gradients, parameters, buffers, submodules and train/eval modes as they were before the step."""
        for m, parameters_before, modules_before in self.registered:
            _take_out_added(m._parameters, parameters_before)
            _take_out_added(m._modules, modules_before)
        for m, name, p in self.slots:
            m._parameters[name] = p
        for m, training in zip(self.modules, self.training):
            vars(m)["training"] = training
        with torch.no_grad():
            for old, saved in self.merged:
                old.copy_(saved)
        self.merged.clear()
        for p, old in (*zip(self.params, self.grads), *self.leaves):
            p.grad = old
        self.restore_buffers()
        for lazy in self.lazy:
            lazy.restore()

    def restore_buffers(self) -> None:
        """Every buffer (the very tensor, and its values) as it was before the step, and none it registered."""
        for m, names in zip(self.modules, self.buffer_names):
            if names is not None:
                _take_out_added(m._buffers, names)
        with torch.no_grad():
            for m, name, b, saved in self.buffers:
                m._buffers[name] = b
                if b.shape != saved.shape:  # resized in place (an observer's, from empty at its first forward)
                    b.resize_(saved.shape)
                b.copy_(saved)


def _take_out_added(table: dict[str, object], names: tuple[str, ...]) -> None:
    """Take out of a module's table (of parameters, buffers or submodules) the entries not among `names`, its names
    before the step."""
    if tuple(table) != names:
        for name in [name for name in table if name not in names]:
            del table[name]


def _adds_in_place(old: Tensor, new: Tensor) -> bool:
    """Whether autograd would add `new` into the existing gradient `old` in place: both dense, alike, and outside
    any graph."""
    return (old.layout == new.layout == torch.strided and old.shape == new.shape and old.dtype == new.dtype
            and old.device == new.device and not old.requires_grad and not new.requires_grad)


def _leaves(roots: Sequence[Tensor]) -> list[Tensor]:
    """The leaves (tensors autograd accumulates a gradient into) that a backward from `roots` reaches."""
    found = [t for t in roots if t.grad_fn is None and t.requires_grad]
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen = set(stack)
    while stack:
        for node, _ in stack.pop().next_functions:
            if node is not None and node not in seen:
                seen.add(node)
                leaf = getattr(node, "variable", None)
                if leaf is None:
                    stack.append(node)
                else:
                    found.append(leaf)
    return found


class _Lazy:
    """A lazy module as it was before its first forward: its class, attributes and hooks, and each uninitialized
    tensor's class and (empty) data, which materializing replaces in place."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.cls = module, type(module)
        self.attributes = {k: dict(v) if type(v) in (dict, OrderedDict) else v for k, v in vars(module).items()}
        self.tensors = [(t, type(t), t.data) for t in (*module._parameters.values(), *module._buffers.values())
                        if t is not None and is_lazy(t)]

    def restore(self) -> None:
        for t, cls, data in self.tensors:
            t.data = data
            t.__class__ = cls
        module = self.module
        module.__class__ = self.cls
        for key, value in self.attributes.items():
            current = vars(module).get(key)
            if type(value) is dict and type(current) in (dict, OrderedDict):
                current.clear()  # the same hook dicts: handles made before the step still find their hooks
                current.update(value)
            else:
                vars(module)[key] = value
        for key in set(vars(module)) - set(self.attributes):
            del vars(module)[key]
