"""Lazy shape inference shared by every accumnorm norm layer.

PyTorch has lazy BatchNorm/InstanceNorm only, as separate classes whose first positional argument is
`eps` (so the popular `nn.LazyBatchNorm2d(32)` silently means eps=32). Here every norm takes its
channel count first and is lazy when it is None: its parameters and buffers start as torch's
`UninitializedParameter`/`UninitializedBuffer` and take their shape (C,) from dim 1 of the first
input, through torch's own `LazyModuleMixin` (so a lazy layer also loads a materialized state_dict).
Built with an int, a layer is an ordinary module: the lazy hooks are removed at construction.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, is_lazy


def check_num_features(value: Any, name: str = "num_features") -> int | None:
    """Validate a channel count given to a norm constructor: a positive int or None (lazy)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int or None (lazy), got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int or None (lazy), got {value}")
    return value


class LazyNormMixin(LazyModuleMixin):
    """Mixin (listed first in the bases) for norms whose parameters and buffers are all (C,) vectors.

    Subclasses call `_init_lazy(lazy, ...)` at the end of `__init__`, and name their channel-count
    attribute in `_features_attr` ("num_features", "num_channels").
    """

    _features_attr = "num_features"

    def _init_lazy(
        self, lazy: bool, params: tuple[str, ...], buffers: tuple[str, ...], factory_kwargs: dict[str, Any]
    ) -> None:
        """Swap the named parameters/buffers for uninitialized ones, or drop the lazy hooks if not lazy."""
        if not lazy:
            self._initialize_hook.remove()
            self._load_hook.remove()
            del self._initialize_hook, self._load_hook
            return
        setattr(self, self._features_attr, None)
        for name in params:
            setattr(self, name, UninitializedParameter(**factory_kwargs))
        for name in buffers:
            self.register_buffer(name, UninitializedBuffer(**factory_kwargs))

    def _feature_dim(self, input: Tensor) -> int:
        return 1

    def initialize_parameters(self, input: Tensor) -> None:  # type: ignore[override]
        """Called by the lazy pre-forward hook: learn C from the first input and materialize."""
        self._check_input_dim(input)
        # A state_dict loaded before the first forward has already materialized the shapes: they win.
        loaded = [t for t in self._parameters.values() if t is not None and not is_lazy(t)]
        c = loaded[0].shape[0] if loaded else input.shape[self._feature_dim(input)]
        with torch.no_grad():
            for tensor in list(self._parameters.values()) + list(self._buffers.values()):
                if tensor is not None and is_lazy(tensor):
                    tensor.materialize((c,))
        setattr(self, self._features_attr, c)
        self.reset_parameters()

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
        self._init_lazy(
            lazy,
            params=("weight", "bias") if lazy and affine else (),
            buffers=("running_mean", "running_var") if lazy and track_running_stats else (),
            factory_kwargs=factory_kwargs,
        )
        if lazy and track_running_stats:
            self.num_batches_tracked = torch.tensor(0, dtype=torch.long, device=device)
