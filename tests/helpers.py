"""Shared test helpers: the whole-batch oracle, a relative-error measure, snapshots, a saved-tensor meter,
the exact schedules by name, and child processes."""
from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import unittest.mock
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import accumnorm

EXACT_SCHEDULES = ("layerwise", "recompute", "segments", "passes")
STEP_SCHEDULES = (*EXACT_SCHEDULES, "auto")  # every value of `schedule` a step takes


# The schedule's options the Trainer and every integration pass on to accumnorm.backward: `assert_ran_with` checks
# that a step ran with them, from what last_schedule says of it
SCHEDULE_OPTIONS = {"keep_every": dict(schedule="segments", keep_every=2), "memory_budget": dict(memory_budget=1 << 30)}


def passes_need(model: nn.Module, batch, loss_fn: Callable | None, micro_batch_size: int, **kwargs) -> int:
    """What a step of a copy of `model` under "auto"'s last resort, passes, needs: the step's gradients and what its
    meter counts of one pass (the least any exact schedule keeps: a budget below it is refused). `kwargs`: the
    step's other arguments (forward_fn and batch_loss_fn)."""
    from accumnorm._engine.schedules import decide

    trial = copy.deepcopy(model)
    with unittest.mock.patch.object(decide, "_by_memory", lambda: []), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accumnorm.backward(trial, batch, loss_fn, micro_batch_size=micro_batch_size, memory_budget=2**40, **kwargs)
    choice = accumnorm.last_schedule(trial)
    assert choice.schedule == "passes", choice
    return choice.need


def assert_ran_with(model: nn.Module, options: dict) -> None:
    """The last exact step on `model` ran with `options`, a value of SCHEDULE_OPTIONS."""
    choice = accumnorm.last_schedule(model)
    assert choice is not None
    if "keep_every" in options:
        assert (choice.schedule, choice.settings) == (options["schedule"], {"keep_every": options["keep_every"]})
    if "memory_budget" in options:
        assert choice.budget == options["memory_budget"]


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - b| / max(max |b|, floor): relative error against the oracle b."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / max(float(b.abs().max()), floor, 1e-300))


def ce_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def whole_batch(ref: nn.Module, batch, loss_fn=ce_loss) -> torch.Tensor:
    """The oracle: one forward/backward of the whole batch through plain PyTorch; returns the loss."""
    loss = loss_fn(ref, batch)
    loss.backward()
    return loss.detach()


def quiet_next_step(model: nn.Module, ref: nn.Module, batch, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Another step from zeroed gradients: accumnorm's on `model` (`kwargs` to accumnorm.backward, with ce_loss),
    failing on any warning, and the oracle's on `ref`; returns (ours, the oracle's) losses."""
    for m in (model, ref):
        m.zero_grad()
    expected = whole_batch(ref, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = accumnorm.backward(model, batch, ce_loss, **kwargs)
    return loss, expected


def oracle_and_ours(ref: nn.Module) -> tuple[nn.Module, nn.Module]:
    """ref (torch norms) and an independent accumnorm copy of it with the same tensors' values."""
    return ref, accumnorm.convert(copy.deepcopy(ref))


def compare(ref: nn.Module, ours: nn.Module, tol: float, same_dtype: bool = True) -> dict[str, float]:
    """Worst relative error of gradients and buffers of `ours` against `ref`; asserts each is <= tol.

    Gradients of tensors whose true gradient is ~0 (a conv bias right before BatchNorm) are compared
    against 1% of the largest gradient in the model rather than their own rounding noise; likewise a
    running mean that is ~0 (BatchNorm right after another one) against 1% of its layer's running std.
    `same_dtype=False` lets a float32 model be measured against a float64 one.
    """
    grads_ref = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    scale = max(float(g.abs().max()) for g in grads_ref.values())
    errs = {}
    for (n, p), (n2, q) in zip(ref.named_parameters(), ours.named_parameters()):
        assert n == n2
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            errs[f"grad {n}"] = rel_err(q.grad, p.grad, 1e-2 * scale)
    buffers_ref = dict(ref.named_buffers())
    for (n, b), (n2, c) in zip(ref.named_buffers(), ours.named_buffers()):
        assert n == n2 and (b.dtype == c.dtype or not same_dtype) and b.shape == c.shape, n
        var = buffers_ref.get(n.removesuffix("running_mean") + "running_var") if n.endswith("running_mean") else None
        floor = 1e-6 if var is None else max(1e-6, 1e-2 * float(var.max()) ** 0.5)
        errs[f"buffer {n}"] = rel_err(c, b, floor)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tol, f"{worst}: relative error {errs[worst]:.3g} > {tol}"
    return errs


def exact_vs_whole_batch(ref: nn.Module, ours: nn.Module, batch, micro_batch_size: int, tol: float,
                         **step) -> dict[str, float]:
    """One forward/backward of `ref` over the whole batch against accumnorm.backward(bn="exact", **step) on `ours`:
    the loss, every gradient and every buffer within `tol` (relative)."""
    expected = ce_loss(ref, batch)
    expected.backward()
    loss = accumnorm.backward(ours, batch, ce_loss, micro_batch_size=micro_batch_size, bn="exact", **step)
    assert rel_err(loss, expected) <= tol
    return compare(ref, ours, tol)


def child_env() -> dict[str, str]:
    """The environment of a program run as a subprocess: it imports this accumnorm, and helpers and models
    from tests/ (for programs in tests/programs)."""
    path = [str(Path(accumnorm.__file__).parents[1]), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def sgd_halving(params) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """SGD with momentum whose learning rate halves every step: the optimizer of the framework oracle tests."""
    optimizer = torch.optim.SGD(params, lr=0.2, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def train_whole_batch(model: nn.Module, batches, *, max_grad_norm: float = float("inf"),
                      autocast: torch.dtype | None = None,
                      penalty: Callable[[nn.Module], torch.Tensor] | None = None) -> tuple[list[float], list[float]]:
    """The oracle: plain PyTorch, one forward/backward of each whole batch per step of `sgd_halving`,
    the gradient clipped to `max_grad_norm`, under CPU autocast to `autocast` if given, `penalty(model)` added to
    the loss back-propagated if given. Returns the losses (without the penalty) and the gradient norms before
    clipping."""
    optimizer, scheduler = sgd_halving(model.parameters())
    losses, norms = [], []
    for batch in batches:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = ce_loss(model, batch)
        (loss if penalty is None else loss + penalty(model)).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, norms


def assert_state_close(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> None:
    """Every parameter and buffer of `state` within `tol` relative error of `want`'s; counters equal."""
    assert state.keys() == want.keys()
    for key, value in want.items():
        if value.dtype == torch.long:  # num_batches_tracked
            assert torch.equal(state[key], value), key
        else:
            assert rel_err(state[key], value) <= tol, f"{key}: relative error {rel_err(state[key], value):.3g}"


def assert_state_within_rounding(state: dict[str, torch.Tensor], other: dict[str, torch.Tensor],
                                 truth: dict[str, torch.Tensor], tol: float, slack: float) -> None:
    """Low-precision training: every float entry of `state` within `tol` relative error of float64 `truth`'s, or,
    where `other` (plain torch's run of the same steps at that precision) is already further off, within `slack`
    times torch's own error. A BatchNorm bias after few steps is mostly rounding, for torch as for us."""
    assert state.keys() == other.keys() == truth.keys()
    for key, want in truth.items():
        if want.dtype == torch.long:
            assert torch.equal(state[key], other[key]), key
            continue
        ours, torchs = rel_err(state[key].double(), want), rel_err(other[key].double(), want)
        assert ours <= max(tol, slack * torchs), f"{key}: relative error {ours:.3g}, plain torch's own {torchs:.3g}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(**extra: str) -> dict[str, str]:
    """`child_env`, on the CPU only with one thread per process, plus `extra`."""
    return {**child_env(), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **extra}


# torch 2.14's gloo can abort a finished process at interpreter exit, its worker threads still alive during
# finalization (pytorch/pytorch#190489, #179291): seen about once in 15 runs of a two-process test, after the
# program's last line, destroy_process_group and a barrier included.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def ended_well(returncode: int, log: str) -> bool:
    """A child process exited 0, or was aborted by gloo's exit-time teardown after its last output line. Callers
    then check what the program wrote (results, metrics), so work that did not finish still fails the test."""
    if returncode == 0:
        return True
    return returncode == -signal.SIGABRT and log.rstrip().endswith(GLOO_EXIT_ABORT)


def assert_ranks_ended_well(results: Sequence[tuple[int, str]]) -> None:
    """Every rank of `launch_ranks` ended well (see `ended_well`); else the tails of their logs."""
    assert all(ended_well(rc, log) for rc, log in results), "\n".join(f"rc {rc}: {log[-3000:]}" for rc, log in results)


def launch_ranks(argv: Sequence[str], logs: Path, *, world_size: int = 2, wait_s: float = 900,
                 wait_for: Sequence[int] | None = None, **env: str) -> list[tuple[int, str]]:
    """Start `world_size` processes `python *argv` with torchrun's environment (RANK, LOCAL_RANK, NODE_RANK,
    WORLD_SIZE, MASTER_ADDR 127.0.0.1, a free MASTER_PORT) plus `env`, logging to logs/rank<r>.log.
    Returns (returncode, log) per rank once the ranks `wait_for` (all by default) have ended, killing
    the others; fails the test if those are still running after `wait_s`, so a hang cannot block CI."""
    port, procs = free_port(), []
    for rank in range(world_size):
        rank_env = cpu_env(RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)
        with open(logs / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env, stdout=log,
                                          stderr=subprocess.STDOUT))
    deadline = time.monotonic() + wait_s
    try:
        for rank in range(world_size) if wait_for is None else wait_for:
            procs[rank].wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"ranks still running after {wait_s}s: "
                    + " | ".join((logs / f"rank{r}.log").read_text()[-500:] for r in range(world_size)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, (logs / f"rank{r}.log").read_text()) for r, p in enumerate(procs)]


def accelerate_steps(exact, accelerator, model, optimizer, scheduler, batches, max_grad_norm: float) -> list[float]:
    """The training loop of an Accelerate user with an accumnorm ExactAccumulator `exact`; returns the losses."""
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        losses.append(exact.backward(batch).item())
        accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        scheduler.step()
    return losses


def assert_ranks_trained_like_whole_batch(out: Path, world_size: int, oracle: nn.Module, max_grad_norm: float,
                                          penalty: Callable[[nn.Module], torch.Tensor] | None = None) -> None:
    """Each rank's out/rank<r>.pt holds the batches it trained on and its net's final state: joined, the
    ranks' batches make the global batches, on which `train_whole_batch` (with `penalty`) must take `oracle` (the
    net as the ranks started it) to that same state."""
    ranks = [torch.load(out / f"rank{rank}.pt") for rank in range(world_size)]
    steps = zip(*(r["batches"] for r in ranks), strict=True)
    global_batches = [[torch.cat(parts) for parts in zip(*step, strict=True)] for step in steps]
    _, norms = train_whole_batch(oracle, global_batches, max_grad_norm=max_grad_norm, penalty=penalty)
    assert min(norms) > max_grad_norm  # clipping is part of what is compared
    for got in ranks:
        assert_state_close(got["state"], oracle.state_dict(), 1e-9)

def compare_within_rounding(truth: nn.Module, other: nn.Module, ours: nn.Module, tol: float,
                            slack: float) -> dict[str, float]:
    """`ours` against `truth`: each gradient and buffer within `tol`, or, where `other`, another computation of
    the same thing in plain torch, is already further off `truth` (rounding in an ill-conditioned spot), within
    `slack` times that. Asserts; the message names the worst entry and both errors. Returns our errors.

    Float32 against float64 truth: `other` is torch's own float32 run (deep nets, BN over few values lose
    digits whoever computes them). Float64: `other` is whole-batch torch over the batch in another sample order.
    """
    noise, errs = (compare(truth, m, float("inf"), same_dtype=False) for m in (other, ours))
    bounds = {k: max(tol, slack * e) for k, e in noise.items()}
    worst = max(errs, key=lambda k: errs[k] / bounds[k])
    assert errs[worst] <= bounds[worst], (
        f"{worst}: relative error {errs[worst]:.3g} > {tol}, and plain torch's own is {noise[worst]:.3g}")
    return errs


def snapshot(model: nn.Module) -> tuple[list, list]:
    """Copies of every .grad and buffer, for `assert_unchanged`."""
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()], \
        [b.clone() for b in model.buffers()]


def assert_unchanged(model: nn.Module, snap: tuple[list, list]) -> None:
    """Every .grad and buffer (running statistics, num_batches_tracked) is bit for bit as in `snap`."""
    grads, bufs = snap
    for (n, p), g in zip(model.named_parameters(), grads):
        assert (p.grad is None and g is None) or (p.grad is not None and g is not None and torch.equal(p.grad, g)), n
    for (n, b), b0 in zip(model.named_buffers(), bufs):
        assert torch.equal(b, b0), n


class _Held:
    """A tensor saved for backward, counted in its meter until autograd lets go of it."""

    def __init__(self, meter: SavedBytes, t: torch.Tensor, key: int) -> None:
        # Detached: the tensor's grad_fn would hold the node that holds this, a cycle no collector breaks, keeping
        # alive a graph that nothing back-propagates (autograd gives an unpacked tensor its place in the graph).
        self.meter, self.t, self.key = meter, t.detach(), key
        meter._add(key, t.untyped_storage().nbytes(), 1)

    def __del__(self) -> None:
        self.meter._add(self.key, 0, -1)


class SavedBytes:
    """Peak bytes of the tensors autograd holds for backward (activation memory), via saved-tensor hooks.

    A storage saved by several autograd nodes counts once, and storages in `exclude` (the model's
    parameters, held whatever the step does) not at all. Thread-safe: the layerwise schedule runs
    its micro-batches in worker threads, into which accumnorm carries the caller's hooks.

        with SavedBytes(model.parameters()) as saved:
            accumnorm.backward(model, batch, loss_fn, micro_batch_size=4)
        saved.peak
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.live = self.peak = 0
        self._held: dict[int, list[int]] = {}  # storage address -> [references, bytes]
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._lock = threading.Lock()

    def _add(self, key: int, nbytes: int, references: int) -> None:
        with self._lock:
            entry = self._held.setdefault(key, [0, nbytes])
            entry[0] += references
            if references > 0 and entry[0] == 1:
                self.live += entry[1]
                self.peak = max(self.peak, self.live)
            elif entry[0] == 0:
                self.live -= entry[1]
                del self._held[key]

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _Held:
        key = t.untyped_storage().data_ptr()
        return t if key in self._exclude else _Held(self, t, key)

    @staticmethod
    def _unpack(saved: torch.Tensor | _Held) -> torch.Tensor:
        return saved.t if isinstance(saved, _Held) else saved

    def __enter__(self) -> SavedBytes:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


def failing_below(size: int):
    """A cross-entropy loss_fn that raises in a micro-batch of fewer than `size` samples (a short last one, after the
    others' forwards)."""
    def loss_fn(model, batch):
        if len(batch[0]) < size:
            raise RuntimeError("the forward fails")
        return F.cross_entropy(model(batch[0]), batch[1])
    return loss_fn


def failing_forward(failure: str):
    """A forward hook that makes a layer's forward fail: raise ("exception") or give NaNs ("nan")."""
    def fail(module, inputs, output):
        if failure == "exception":
            raise RuntimeError("the model failed")
        return output * float("nan")
    return fail


def live_peak(step) -> int:
    """The peak bytes of live tensors while `step()` runs (torch's CPU allocator, as the profiler records it)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak
