"""Trainer checkpoints: read back whole or refused saying why, checked against the trainer they go into
before anything changes, and the RNG states they carry.

torch.load does not check the CRC-32 that its zip format stores with every record, so a flipped bit
in a tensor loads silently as a wrong number; `read_checkpoint` checks every record first.
"""
from __future__ import annotations

import os
import random
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["LoaderStreams", "read_checkpoint", "check_fits", "get_rng", "set_rng"]

KEYS = ("config", "model", "optimizer", "scheduler", "scaler", "step", "epoch", "batch_in_epoch", "rng")
_TYPES = {"config": dict, "model": dict, "optimizer": dict, "rng": list, "step": int, "epoch": int,
          "batch_in_epoch": int}


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The state `Trainer.save` wrote to `path`.

    Raises FileNotFoundError when there is no such file, and a ValueError naming it when it is truncated
    or corrupt (torch.load fails, or a record fails its CRC-32 check) or is not an accumnorm checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}" + (" (it is a directory)" if path.is_dir() else ""))
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
        if bad is not None:
            raise ValueError(f"its record {bad} fails its CRC-32 check")
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # whatever the reader trips on, the file cannot be resumed from
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path} is truncated or corrupt, or not a file that torch.save wrote: {reason}") from err
    problem = _structure_problem(state)
    if problem is not None:
        raise ValueError(f"{path} is not an accumnorm checkpoint ({problem}): Trainer.load reads what Trainer.save "
                         "wrote")
    return state


def _structure_problem(state: Any) -> str | None:
    """What keeps `state` from being a Trainer's state_dict, or None."""
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a dict"
    missing = [key for key in KEYS if key not in state]
    if missing:
        return f"it has no {', '.join(missing)}"
    wrong = [key for key, kind in _TYPES.items() if not isinstance(state[key], kind)]
    if wrong:
        return f"its {', '.join(wrong)} are of the wrong type"
    if not {"state", "param_groups"} <= state["optimizer"].keys():
        return "its optimizer state has no param_groups"
    if not all(isinstance(r, dict) and {"now", "epoch_start"} <= r.keys() for r in state["rng"]):
        return "its RNG states are not those of a Trainer"
    return None


def check_fits(state: dict[str, Any], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: Any, scaler: Any, world_size: int) -> None:
    """Raise a ValueError saying everything that differs between a checkpoint and the trainer it would go into."""
    problem = _structure_problem(state)
    if problem is not None:
        raise ValueError(f"not a Trainer's state_dict: {problem}")
    problems = [*_model_problems(state["model"], model.state_dict()), *_optimizer_problems(state, optimizer)]
    for name, ours in (("scheduler", scheduler), ("scaler", scaler)):
        if (state[name] is None) != (ours is None):
            problems.append(f"{name}: the checkpoint {'has none' if state[name] is None else 'has one'}, this trainer "
                            f"{'has one' if ours is not None else 'has none'}")
    problems += _class_problem("scheduler", state.get("scheduler_class"), scheduler)
    if len(state["rng"]) != world_size:
        problems.append(f"world size: the checkpoint holds RNG states of {len(state['rng'])} ranks, this run has "
                        f"{world_size}; resume with the same world size")
    if problems:
        raise ValueError("the checkpoint does not fit this trainer:" + "".join(f"\n  {p}" for p in problems))


def _model_problems(saved: dict[str, Any], own: dict[str, torch.Tensor]) -> list[str]:
    missing = sorted(own.keys() - saved.keys())
    unexpected = sorted(saved.keys() - own.keys())
    shapes = [f"{k} {tuple(saved[k].shape)} in checkpoint, {tuple(v.shape)} in model"
              for k, v in own.items() if k in saved and getattr(saved[k], "shape", None) != v.shape]
    return [f"model, {what}: {'; '.join(keys)}" for what, keys in (
        ("missing in checkpoint", missing), ("not in model", unexpected), ("shapes differ", shapes)) if keys]


def _optimizer_problems(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> list[str]:
    """A different optimizer class would load and then fail at its first step (Adam's state in SGD: KeyError)."""
    problems = _class_problem("optimizer", state.get("optimizer_class"), optimizer)
    saved = [len(group["params"]) for group in state["optimizer"]["param_groups"]]
    ours = [len(group["params"]) for group in optimizer.param_groups]
    if saved != ours:
        problems.append(f"optimizer: {_groups(saved)} in checkpoint, {_groups(ours)} in this one")
    return problems


def _class_problem(name: str, saved: str | None, ours: Any) -> list[str]:
    """Checkpoints record the class names of their optimizer and scheduler (older ones do not: nothing to check)."""
    if saved is None or ours is None or saved == type(ours).__name__:
        return []
    return [f"{name}: a {saved} in checkpoint, a {type(ours).__name__} in this trainer; resume with the {name} "
            "the run was saved with"]


def _groups(sizes: list[int]) -> str:
    return f"{len(sizes)} param group{'s' if len(sizes) != 1 else ''} of {', '.join(map(str, sizes))} tensors"


def get_rng() -> dict[str, Any]:
    """torch (CPU and, once used, CUDA), python and numpy RNG states, in types torch.load(weights_only=True) reads."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:  # only a program that imported numpy can depend on its RNG
        name, keys, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    return state


def set_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


class LoaderStreams:
    """The torch.Generators a loader draws from itself (its own `generator`, its sampler's: the shuffle, the workers'
    base seed), which the process's RNG states leave out. A resumed run starts them where the run it continues had
    them: at the epoch's start, to replay the batches already trained on, or as they were at an epoch's end."""

    def __init__(self) -> None:
        self.generators: list[torch.Generator] = []  # the loader's, once each
        self.epoch_start: list[torch.Tensor] | None = None  # their states when the epoch's iterator was made
        self.resumed: dict[str, Any] | None = None  # a checkpoint's states, until the next loader is attached

    def attach(self, loader: Any, mid_epoch: bool) -> None:
        """The loader of the epoch about to be iterated (`mid_epoch`: past batches already trained on): a
        checkpoint's states go into its generators, those at the epoch's start where it is replayed."""
        holders = (loader, getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None),
                                                                      "sampler", None))
        found = (getattr(h, "generator", None) for h in holders)
        self.generators = list({id(g): g for g in found if isinstance(g, torch.Generator)}.values())
        resumed, self.resumed = self.resumed, None
        states = None if resumed is None else resumed["epoch_start" if mid_epoch else "now"]
        if states is None:  # none resumed, or a checkpoint written before these states were kept
            return
        if len(states) != len(self.generators):
            raise ValueError(f"the checkpoint holds the states of {len(states)} generators of the loader (its own "
                             f"and its sampler's), the loader given to fit has {len(self.generators)}: resume with a "
                             "loader made as the run's was")
        self.epoch_start = list(states) if mid_epoch else None
        self._put(states)

    def epoch_started(self) -> None:
        self.epoch_start = [g.get_state() for g in self.generators]

    def replay(self) -> None:
        """The generators back at the epoch's start, to make its iterator again."""
        if self.epoch_start is not None and len(self.epoch_start) == len(self.generators):
            self._put(self.epoch_start)

    def state(self) -> dict[str, Any]:
        return {"now": [g.get_state() for g in self.generators], "epoch_start": self.epoch_start}

    def _put(self, states: list[torch.Tensor]) -> None:
        for g, state in zip(self.generators, states):
            g.set_state(state)
