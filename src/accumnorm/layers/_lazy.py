"""The base shared by every accumnorm norm layer: lazy shape inference, input checks, PyTorch's tools.

PyTorch has lazy BatchNorm/InstanceNorm only, as separate classes whose first positional argument is
`eps` (so the popular `nn.LazyBatchNorm2d(32)` silently means eps=32). Here every norm takes its
channel count first and is lazy when it is None: its parameters and buffers start as torch's
`UninitializedParameter`/`UninitializedBuffer` and take their shape (C,) from dim 1 of the first
input, through torch's own `LazyModuleMixin` (so a lazy layer also loads a materialized state_dict).
Built with an int, a layer is an ordinary module: the lazy hooks are removed at construction.

The shared `forward` checks the input, then runs the layer's norm. It also lets the layers pass
where torch's own norms pass: under `torch.fx` a layer is one `call_module` node, as torch's norms
are (fx's tracer treats only modules from `torch.nn` as leaves); TorchScript compiles only the
norm itself; and `nn.DataParallel` replicates any layer whose shape is known.
"""
from __future__ import annotations

import numbers
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn as nn
from torch import Tensor
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, is_lazy

__all__ = ["check_num_features", "norm_forward", "LazyNormMixin", "LazyNormBase"]


def check_num_features(value: Any, name: str = "num_features") -> int | None:
    """Validate a channel count given to a norm constructor: a positive int (any integer type torch's layers take,
    such as numpy's int64, as a Python int) or None (lazy)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int or None (lazy), got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int or None (lazy), got {value}")
    return int(value)


def norm_forward(forward: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """torch's `forward` of a layer, as the `_norm_forward` method of ours.

    TorchScript names a method it compiles after its function's `__name__`, and the layer's own
    `forward` is already "forward": the same code under the name "_norm_forward" compiles beside it.
    """
    method = types.FunctionType(forward.__code__, forward.__globals__, "_norm_forward", forward.__defaults__,
                                forward.__closure__)
    method.__annotations__, method.__kwdefaults__ = forward.__annotations__, forward.__kwdefaults__
    method.__qualname__ = f"{forward.__qualname__.rsplit('.', 1)[0]}._norm_forward"
    return method


class _UninitializedBuffer(UninitializedBuffer):
    """torch's UninitializedBuffer that deep-copies, as UninitializedParameter does.

    NOTE: torch's lazy BatchNorm cannot be deep-copied before its first forward (its buffers raise).
    """

    def __deepcopy__(self, memo: dict[int, Any]) -> _UninitializedBuffer:
        if id(self) not in memo:
            memo[id(self)] = type(self)(self.requires_grad, self.device, self.dtype)
        return memo[id(self)]


class LazyNormMixin(LazyModuleMixin):
    """Mixin (listed first in the bases) for norms whose parameters and buffers are all (C,) vectors.

    Subclasses call `_init_lazy(...)` at the end of `__init__`, name their channel-count attribute in
    `_features_attr` ("num_features", "num_channels"), and define `_norm_forward`, the norm itself
    (`norm_forward(torch's forward)` of the layer they extend), which TorchScript compiles.
    """

    _features_attr = "num_features"

    def _init_lazy(
        self, lazy: bool, affine: bool, bias: bool, buffers: tuple[str, ...], factory_kwargs: dict[str, Any]
    ) -> None:
        """Drop the bias if asked, then make the tensors uninitialized if lazy, else drop the lazy hooks."""
        if not bias:
            # NOTE: torch's own `bias=` is newer than the torch we support (and than timm's BatchNormAct2d,
            # which extends BatchNorm2d without it): build with a bias, then unregister it.
            self.register_parameter("bias", None)
        if not lazy:
            self._initialize_hook.remove()
            self._load_hook.remove()
            del self._initialize_hook, self._load_hook
            return
        setattr(self, self._features_attr, None)
        for name in (("weight", "bias") if bias else ("weight",)) if affine else ():
            setattr(self, name, UninitializedParameter(**factory_kwargs))
        for name in buffers:
            self.register_buffer(name, _UninitializedBuffer(**factory_kwargs))

    def _feature_dim(self, input: Tensor) -> int:
        return 1

    def initialize_parameters(self, input: Tensor) -> None:  # type: ignore[override]
        """Called by the lazy pre-forward hook: learn C from the first input and materialize."""
        self._check_input_dim(input)
        tensors = [t for t in (*self._parameters.values(), *self._buffers.values()) if t is not None]
        lazy = [t for t in tensors if is_lazy(t)]
        given = [(t, t.detach().clone()) for t in tensors if not is_lazy(t)]  # by a state_dict, or never lazy
        # A state_dict loaded before the first forward has already materialized the shapes: they win.
        shaped = [t for t, _ in given if t.dim() == 1]
        c = shaped[0].shape[0] if shaped else input.shape[self._feature_dim(input)]
        with torch.no_grad():
            for tensor in lazy:
                tensor.materialize((c,))
        setattr(self, self._features_attr, c)
        if lazy:  # the tensors still lazy get their initial values; those a state_dict gave keep theirs
            self.reset_parameters()
            with torch.no_grad():
                for tensor, value in given:
                    tensor.copy_(value)

    def reset_parameters(self) -> None:
        if not self.has_uninitialized_params():
            super().reset_parameters()  # type: ignore[misc]

    def _check_channels(self, input: Tensor) -> None:
        """A clear ValueError when the input's channel count does not fit the layer."""
        c = getattr(self, self._features_attr)
        dim = self._feature_dim(input)
        if c is not None and input.shape[dim] != c:
            raise ValueError(
                f"{self._get_name()} expected {c} channels at dim {dim}, got input of shape {tuple(input.shape)}"
            )

    def forward(self, input: Tensor) -> Tensor:
        # TorchScript compiles only the taken branch: the norm, not the Python-only checks and hooks.
        if torch.jit.is_scripting():
            return self._norm_forward(input)
        else:
            return self._checked_forward(input)

    def _checked_forward(self, input: Tensor) -> Tensor:
        # A layer traced on its own (the root) has no module path: it is traced through, as torch's would be.
        if isinstance(input, torch.fx.Proxy) and self is not getattr(input.tracer, "root", None):
            return _fx_leaf_call(self, input)
        self._check_input_dim(input)
        self._check_channels(input)
        return self._norm_forward(input)

    def _replicate_for_data_parallel(self) -> nn.Module:
        # LazyModuleMixin refuses every replica; only a layer whose shape is still unknown must be refused.
        if self.has_uninitialized_params():
            return super()._replicate_for_data_parallel()
        return nn.Module._replicate_for_data_parallel(self)


def _fx_leaf_call(module: nn.Module, input: torch.fx.Proxy) -> Any:
    """Record `module(input)` as one call_module node of the fx graph, as fx does for torch's own norms.

    fx traces into any module not defined in torch.nn, and a norm's shape checks cannot be traced; as a
    leaf the layer keeps its checks and its train/eval switch in the traced graph, and a converted model
    traces to the same graph (same node names) as the torch model it came from.
    """
    tracer = input.tracer
    return tracer.create_proxy("call_module", tracer.path_of_module(module), (input,), {})


class LazyNormBase(LazyNormMixin):
    """Constructor of the lazy `_NormBase` layers (BatchNorm, InstanceNorm): channels first, None = lazy."""

    def __init__(
        self,
        num_features: int | None = None,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        num_features = check_num_features(num_features)
        lazy = num_features is None
        factory_kwargs = {"device": device, "dtype": dtype}
        # A lazy layer is built without tensors, which are then declared uninitialized (as torch's _LazyNormBase).
        super().__init__(  # type: ignore[call-arg]
            0 if lazy else num_features, eps, momentum, affine and not lazy, track_running_stats and not lazy,
            **factory_kwargs,
        )
        self.affine, self.track_running_stats = affine, track_running_stats
        self._init_lazy(lazy, affine, bias, ("running_mean", "running_var") if lazy and track_running_stats else (),
                        factory_kwargs)
        if lazy and track_running_stats:
            self.num_batches_tracked = torch.tensor(0, dtype=torch.long, device=device)
