"""The model's modules and parameters, each once, in torch's order, found in one pass without recursion.

A step looks at every module several times (its refusals, its transaction, its messages). torch's
`named_modules` is a recursive generator: each module it yields passes up through one generator per level
above it, and a deep model pays that at every module, on every look. `module_names` walks the `_modules`
dicts with a stack instead, giving the same modules in the same order (pre-order, each once, as
`named_modules` with its defaults), with their names; the step takes it once and reuses it.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch.nn as nn

__all__ = ["Names", "module_names", "parameters"]


def module_names(model: nn.Module) -> dict[nn.Module, str]:
    """Each module of `model` and its name, as `model.named_modules()` gives them (the model itself is "")."""
    names: dict[nn.Module, str] = {}
    pending = [("", model)]
    while pending:
        name, m = pending.pop()
        if m not in names:
            names[m] = name
            pending += [(f"{name}.{n}" if name else n, c) for n, c in reversed(m._modules.items()) if c is not None]
    return names


def parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The parameters of `modules` (a model's, in `module_names`' order), each once, as `model.parameters()`."""
    seen: set[int] = set()
    found = []
    for m in modules:
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                found.append(p)
    return found


class Names(Mapping[nn.Module, str]):
    """Each module's name in the model, for messages ("(the model)" for the model itself), from `module_names`'
    dict; made at the first message, as most steps give none."""

    def __init__(self, modules: dict[nn.Module, str]) -> None:
        self._modules = modules
        self._names: dict[nn.Module, str] | None = None

    def _made(self) -> dict[nn.Module, str]:
        if self._names is None:
            self._names = {m: name or "(the model)" for m, name in self._modules.items()}
        return self._names

    def __getitem__(self, module: nn.Module) -> str:
        return self._made()[module]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._made())

    def __len__(self) -> int:
        return len(self._modules)
