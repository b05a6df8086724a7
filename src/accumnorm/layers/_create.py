"""One registry of norms by name, and converters between torch's (and timm's) BatchNorm and accumnorm's.

`norm_layer("gn16")` returns what builds the layer given its channel count (a class or a partial, as
timm's get_norm_layer does), so a name validates before any channel count is known; `norm("gn16", 64)`
builds the layer. Both read the one registry below; an unknown name lists the valid ones.
`convert(model)` swaps torch's BatchNorm layers for accumnorm's in place, as
`torch.nn.SyncBatchNorm.convert_sync_batchnorm` does: same Parameter and buffer objects (an optimizer
built before still works), same child modules, same train/eval flag, and, unlike it, the layer's hooks
and the attributes set on it. torch's lazy BatchNorm still lazy becomes accumnorm's lazy layer (its
shape comes from the first input, as before). `revert(model)` goes back; torch's BatchNorm classes
have no lazy state, so a layer still lazy is refused.
"""
from __future__ import annotations

import inspect
import re
import sys
import weakref
from collections.abc import Callable, Iterable
from functools import partial
from types import MethodType
from typing import Any

import torch.nn as nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.modules.module import _WrappedHook
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

from ._alternatives import BatchRenorm2d, StaleBatchNorm2d
from ._batchnorm import BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d
from ._lazy import _UninitializedBuffer
from ._norms import GroupNorm, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d, LayerNorm
from ._per_sample import EvoNorm2dS0, FilterResponseNorm2d

__all__ = ["norm_layer", "norm", "NORM_NAMES", "convert", "revert"]

NormLayer = Callable[..., nn.Module]

# The registry: name -> what builds the layer, called as layer(num_features, **kwargs). One line a norm.
_NORMS: dict[str, NormLayer] = {
    "bn": BatchNorm2d,
    "bn1d": BatchNorm1d,
    "bn2d": BatchNorm2d,
    "bn3d": BatchNorm3d,
    "in": partial(InstanceNorm2d, affine=True),
    "in1d": partial(InstanceNorm1d, affine=True),
    "in2d": partial(InstanceNorm2d, affine=True),
    "in3d": partial(InstanceNorm3d, affine=True),
    "ln": LayerNorm,
    "none": nn.Identity,  # takes and ignores any arguments
    "brn": BatchRenorm2d,
    "bn-stale": StaleBatchNorm2d,
    "frn": FilterResponseNorm2d,
    "evonorm-s0": EvoNorm2dS0,
}
_GN = re.compile(r"gn(\d+)")  # "gn<G>": GroupNorm with G groups, e.g. "gn16"
NORM_NAMES = (*list(_NORMS)[:4], "gn<G>", *list(_NORMS)[4:])  # the registry's order, GroupNorm beside BatchNorm


def norm_layer(name: str) -> NormLayer:
    """What builds the norm `name`, given its channel count: `norm_layer("gn16")(64)` is a GroupNorm.

    A drop-in `norm_layer=` for torchvision and timm models. Names (case-insensitive): "bn"
    (accumnorm.BatchNorm2d; "bn1d"/"bn3d" for other ranks), "gn<G>" (GroupNorm with G groups, e.g.
    "gn4", "gn16"), "in" (InstanceNorm2d with affine=True; "in1d"/"in3d"), "ln" (LayerNorm over the
    channel dim), "none" (Identity); the alternatives to BatchNorm "brn" (BatchRenorm2d), "bn-stale"
    (StaleBatchNorm2d), "frn" (FilterResponseNorm2d, with TLU), "evonorm-s0" (EvoNorm2dS0). Channels
    None makes the layer lazy.
    """
    if not isinstance(name, str):
        raise TypeError(f"norm name must be a str, got {type(name).__name__} {name!r}")
    key = name.strip().lower()
    gn = _GN.fullmatch(key)
    if gn and int(gn.group(1)) >= 1:
        return partial(GroupNorm, num_groups=int(gn.group(1)))
    if key not in _NORMS:
        raise ValueError(f"unknown norm {name!r}; valid names: {', '.join(NORM_NAMES)} (G >= 1: gn4, gn16...)")
    return _NORMS[key]


def norm(name: str, num_features: int | None = None, **kwargs: Any) -> nn.Module:
    """Build the norm `name` (see `norm_layer`), lazy when num_features is None; kwargs go to its constructor."""
    build = norm_layer(name)
    cls = build.func if isinstance(build, partial) else build
    try:  # a keyword the layer does not take is named with the layer, not with the base class that refuses it
        inspect.signature(build).bind(num_features, **kwargs)
    except TypeError as err:
        takes = ", ".join(inspect.signature(build).parameters)
        raise TypeError(f"norm({name!r}) builds {cls.__name__}, which takes {takes}: {err}") from None
    return build(num_features, **kwargs)


_TO_ACCUM: dict[type, type] = {
    nn.BatchNorm1d: BatchNorm1d,
    nn.BatchNorm2d: BatchNorm2d,
    nn.BatchNorm3d: BatchNorm3d,
    nn.SyncBatchNorm: BatchNorm,
}
_TO_TORCH: dict[type, type] = {accum: torch_cls for torch_cls, accum in _TO_ACCUM.items()}
# After its first forward torch's lazy layer is a plain BatchNorm1d/2d/3d; before it, one of these.
_TORCH_LAZY: dict[type, type] = {
    nn.LazyBatchNorm1d: BatchNorm1d,
    nn.LazyBatchNorm2d: BatchNorm2d,
    nn.LazyBatchNorm3d: BatchNorm3d,
}


def _mappings() -> tuple[dict[type, type], dict[type, type]]:
    """(to accumnorm, back) for torch's layers, and for timm's where timm is in use (already imported)."""
    if sys.modules.get("timm") is None:  # a model can hold timm's layers only once timm is imported: stay optional
        return {**_TO_ACCUM, **_TORCH_LAZY}, _TO_TORCH
    from ..integrations import timm as timm_layers

    return {**timm_layers._TO_ACCUM, **_TO_ACCUM, **_TORCH_LAZY}, {**timm_layers._TO_TIMM, **_TO_TORCH}


def _swap(module: nn.Module, mapping: dict[type, type], caller: str) -> nn.Module:
    """Check every module to swap, then rebuild each around the same tensors and children, in place."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{caller} expects an nn.Module, got {type(module).__name__}")
    for name, m in module.named_modules():
        cls = mapping.get(type(m))
        if cls is not None and parametrize.is_parametrized(m):
            raise ValueError(f"cannot {caller} {name or 'the model'} ({m._get_name()}): its parametrization of "
                             f"{', '.join(m.parametrizations)} (torch.nn.utils.parametrize) lives in its class, which "
                             "the conversion replaces. Nothing was changed. Remove it first "
                             "(parametrize.remove_parametrizations) and register it again on the converted layer")
        if cls is not None and _is_lazy(m) and not issubclass(cls, LazyModuleMixin):
            raise ValueError(f"cannot {caller} {name or 'the model'} ({m._get_name()}) before its lazy shape is known: "
                             f"{cls.__name__} is never lazy; run one forward first")
    return _rebuild(module, mapping, {})


def _is_lazy(m: nn.Module) -> bool:
    return isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()


def _num_features(m: nn.Module) -> int | None:
    """The layer's channel count; None while it is lazy. torch's lazy layer says 0 until its first forward, also
    after a state_dict gave it its tensors."""
    if _is_lazy(m):
        return None
    tensors = [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None and t.dim() == 1]
    return m.num_features or (tensors[0].shape[0] if tensors else None)


def _rebuild(module: nn.Module, mapping: dict[type, type], memo: dict[int, nn.Module]) -> nn.Module:
    if id(module) in memo:  # a layer used at two places stays one layer
        return memo[id(module)]
    out = module
    cls = mapping.get(type(module))
    if cls is not None:
        features = _num_features(module)
        out = cls(features, module.eps, module.momentum, module.affine, module.track_running_stats)
        _carry_over(module, out)
        if type(module) in _TORCH_LAZY:
            _from_torch_lazy(out, features)
        elif features is not None:
            _shape_known(out, features)
    memo[id(module)] = out
    # Every slot, not named_children(), which skips a module's second slot; also carries timm's act and drop over.
    for name, child in list(module._modules.items()):
        if child is not None:
            out.add_module(name, _rebuild(child, mapping, memo))
    return out


def _from_torch_lazy(out: nn.Module, features: int | None) -> None:
    """What `_carry_over` took from torch's lazy layer that accumnorm's holds its own way: the channel count (None
    while lazy, not torch's 0), buffers still uninitialized (accumnorm's deep-copy), and the lazy hooks of a layer
    whose shape is known (`_shape_known`; while it is lazy, torch's hooks, rebound to the new layer, run its lazy
    code)."""
    out.num_features = features
    for name, buffer in out._buffers.items():
        if is_lazy(buffer):
            out._buffers[name] = _UninitializedBuffer(device=buffer.device, dtype=buffer.dtype)
    if features is not None:
        _shape_known(out, features)


def _shape_known(out: nn.Module, features: int) -> None:
    """A layer whose channel count is known: that count, where `_carry_over` took a lazy layer's None (or torch's 0),
    and none of the lazy hooks a lazy layer keeps until its first forward, also after a state_dict gave it its
    tensors: on a layer that is never lazy they would run lazy code it has not."""
    out.num_features = features
    if hasattr(out, "_initialize_hook"):
        out._initialize_hook.remove()
        out._load_hook.remove()
        del out._initialize_hook, out._load_hook


def _carry_over(old: nn.Module, new: nn.Module) -> None:
    """Give `new` all that `old` holds but its class and children: the very same Parameter and buffer objects
    (optimizers that hold them stay valid), its hooks of every kind (the same dicts: their handles still remove
    them), its train flag and every attribute set on it (qconfig, a user's tag)."""
    for name, value in vars(old).items():
        if name in ("_parameters", "_buffers"):
            getattr(new, name).update(value)
        elif name.endswith("hooks"):  # _forward_hooks, _state_dict_pre_hooks...: the same dict, moved over
            for key, hook in value.items():
                value[key] = _rebound(hook, old, new)
            new.__dict__[name] = value
        elif name != "_modules":  # the children are rebuilt by the caller
            new.__dict__[name] = _rebound(value, old, new)


def _rebound(value: Any, old: nn.Module, new: nn.Module) -> Any:
    """`value`, pointing at `new` where it pointed at `old`: a method bound to it, a hook given the module."""
    if inspect.ismethod(value) and value.__self__ is old:
        return MethodType(value.__func__, new)
    if isinstance(value, _WrappedHook):  # register_load_state_dict_pre_hook's: their module held weakly, or bound
        if value.with_module and value.module() is old:
            value.module = weakref.ref(new)
        value.hook = _rebound(value.hook, old, new)  # a lazy layer's own _lazy_load_hook
    return value


def convert(module: nn.Module, types: type | Iterable[type] = ()) -> nn.Module:
    """Swap torch's BatchNorm1d/2d/3d, LazyBatchNorm1d/2d/3d and SyncBatchNorm, and timm's BatchNormAct2d family,
    for accumnorm's. A lazy layer keeps its eps, momentum, affine and track_running_stats and stays lazy until its
    first forward (or keeps the tensors a state_dict gave it); `nn.LazyBatchNorm2d(32)` means eps=32, and so does
    its conversion: `accumnorm.backward` warns of such an eps.

    Only those exact types: a subclass of them (say, your own BatchNorm with its own forward) is left
    alone unless listed in `types` (a class or several); a listed class becomes accumnorm's layer of
    its nearest torch (or timm) base, without the subclass's own code, and `revert` gives that base.
    Returns the converted module (a new object if `module` itself is converted), like
    `torch.nn.SyncBatchNorm.convert_sync_batchnorm`. On error nothing is changed.
    """
    to_accum, _ = _mappings()
    extra = {}
    if not isinstance(types, type | Iterable):
        raise TypeError(f"convert(types=...) expects a class or an iterable of classes, got {type(types).__name__}")
    for cls in (types,) if isinstance(types, type) else types:
        base = next((b for b in cls.__mro__ if b in to_accum), None) if isinstance(cls, type) else None
        if base is None:
            names = ", ".join(sorted(c.__name__ for c in to_accum))
            raise TypeError(f"convert(types=...) expects subclasses of {names}, got {cls!r}")
        extra[cls] = to_accum[base]
    return _swap(module, {**extra, **to_accum}, "convert")


def revert(module: nn.Module) -> nn.Module:
    """Turn accumnorm's BatchNorm layers back into torch's (accumnorm.BatchNorm becomes SyncBatchNorm, and
    accumnorm's timm BatchNormAct2d timm's), e.g. for tools that match torch's exact BatchNorm types."""
    return _swap(module, _mappings()[1], "revert")
