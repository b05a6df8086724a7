"""accumnorm on a CUDA GPU in one command: exactness, GradScaler, memory, speed and NCCL, public API only.

    python benchmarks/gpu_check.py       # one table; a few minutes on one GPU (budget: 5)

Each check is a function returning rows of the table (check, case, measured, limit, status); one that
raises is a FAIL row naming the check (its traceback goes to stderr) and the others still run.

  exact <precision>  accumnorm.backward (batch 32 at 32x32, micro-batch 4) in float32 (TF32 off) on
                     torchvision's resnet18 (20 BN calls), under bf16 autocast and under fp16 autocast with a
                     GradScaler (scale 1024, unscaled with unscale_) on the study's VGG-like net (4 BN calls:
                     through resnet18's depth, bf16 rounding alone moves the gradients by ~40%, which would
                     hide any error), against the oracle: one forward/backward of the whole batch in float64
                     on the GPU. Measured: the worst tensor's |error| / |oracle| (L2 norms) over every
                     gradient and running-statistic update (tensors zero in exact arithmetic, as a conv bias
                     before BatchNorm, are left out). Limit: twice the error of the same whole batch in
                     plain torch at that precision, at least a floor. Plain accumulation (bn="micro") is
                     shown for scale.
  fp16 overflow      a GradScaler scale of 2**40, which overflows the fp16 gradients: .grad holds inf/nan,
                     scaler.step skips the optimizer, update() halves the scale, and the running statistics
                     are still the whole batch's (the forward ran, as in torch); then the same through
                     accumnorm.Trainer(amp="fp16"): the step and its scheduler step are skipped, the next
                     finite step trains.
  memory             torch.cuda.max_memory_allocated, reset between, for one step of resnet18 at 112 px: plain
                     accumulation at micro-batch 8; exact at 8 x 8 with store=None (pinned host memory, the
                     default on CUDA) and store="cuda"; the whole batch of 64 in torch. Limit: the pinned store
                     holds less on the GPU than store="cuda" and than the whole batch.
  cost bf16          resnet50 at 224 px, micro-batch 32 x 8, under bf16 autocast: each way's peak
                     torch.cuda.max_memory_allocated above the level before its step (after a warm-up
                     step) and its time, each beside plain accumulation's: layerwise with the pinned
                     host store (store=None) and with store="cuda", the recompute schedule and the segments
                     schedule at keep_every 1 and 2 where accumnorm.backward has them, the whole batch of 256
                     in torch ("out of memory" where it does not fit). Time: 3 interleaved rounds, every
                     other in reverse order, the ratio the median of each round's ratio to plain (INFO:
                     speed is not pass/fail).
  compile bf16       torch.compile(backend="inductor") on resnet18 at 224 px, micro-batch 32 x 4, under bf16
                     autocast, each on its own compiled copy: plain accumulation in torch (BatchNorm fused in the
                     graph), the compiled floor (plain accumulation with a graph break at each BatchNorm call, as
                     exact mode breaks the graph, and nothing else of accumnorm's) and accumnorm.backward
                     (layerwise). Each one's time as cost bf16 measures it, over compiled plain's and, for exact,
                     over the floor's, and its first step's seconds (compiling, from empty caches); INFO. With
                     --device cpu it runs aot_eager at 16 px, 4 x 4, to exercise the script.
  nccl               a one-rank NCCL process group (file:// rendezvous) through
                     accumnorm.backward(process_group=...), against the oracle as for float32.

Exit status: 0 every check passed; 1 a check failed; 77 no CUDA GPU present, nothing checked (77 means
"skipped" to automake and meson: a CPU-only CI tells it from a pass and from a failure).
`--device cpu` runs the checks that can run without a GPU, for working on this script; it says nothing
about CUDA.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from _methods import refusal

import accumnorm

NO_GPU = 77
SCALE = 1024.0  # the GradScaler scale of the finite fp16 steps: far from overflow on resnet18
FLOOR = {"float32": 1e-4, "bf16": 2e-2, "fp16": 1e-2}  # the least error each precision is allowed
AUTOCAST = {"float32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Row(NamedTuple):
    check: str
    case: str
    measured: str
    limit: str
    status: str  # PASS, FAIL, INFO or SKIP


def verdict(check: str, case: str, value: float, limit: float, fmt: str = ".1e") -> Row:
    return Row(check, case, f"{value:{fmt}}", f"<= {limit:{fmt}}", "PASS" if value <= limit else "FAIL")


def truth(check: str, case: str, ok: bool, seen: str) -> Row:
    return Row(check, case, seen, "", "PASS" if ok else "FAIL")


# ---------------------------------------------------------------- models, batches, the oracle
def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def resnet(name: str, device: torch.device) -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, name)(num_classes=10).to(device)


def study_net(device: torch.device) -> nn.Module:
    """The study's VGG-like net: conv 32-64-128-256, each + BatchNorm + ReLU, max-pool between."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    c0 = 3
    for i, c in enumerate((32, 64, 128, 256)):
        layers += [nn.Conv2d(c0, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()] + ([nn.MaxPool2d(2)] if i < 3 else [])
        c0 = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c0, 10)).to(device)


def batch_of(n: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, size, size, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device)


def state_of(model: nn.Module, base: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient of `model`, and how far each floating-point running statistic moved from `base`'s, in float64."""
    state = {f"grad {n}": p.grad.double() for n, p in model.named_parameters()}
    before = dict(base.named_buffers())
    state.update({f"update {n}": b.double() - before[n].double() for n, b in model.named_buffers()
                  if b.is_floating_point()})
    return state


def worst_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The worst tensor's |got - want| / |want| (L2), over the tensors of `want` not zero up to rounding."""
    largest = max(float(v.norm()) for v in want.values())
    return max(float((got[k] - v).norm() / v.norm()) for k, v in want.items() if v.norm() > 1e-6 * largest)


def oracle(base: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One forward/backward of the whole batch in float64: the gradients and running statistics to match."""
    model = copy.deepcopy(base).double()
    x, y = batch
    loss_fn(model, (x.double(), y)).backward()
    return state_of(model, base)


@contextlib.contextmanager
def tf32_off() -> Iterator[None]:
    """float32 as float32: cuDNN's TF32 convolutions (on by default) round to 10 bits."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


Backward = Callable[[nn.Module, Any, "torch.amp.GradScaler | None"], Any]


def whole_batch(model: nn.Module, batch: Any, scaler: torch.amp.GradScaler | None) -> None:
    loss = loss_fn(model, batch)
    (scaler.scale(loss) if scaler is not None else loss).backward()


def plain_accumulation(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], micro: int) -> None:
    """Plain accumulation in torch alone: loss * b / B, backward, once per micro-batch of `micro` samples."""
    x, y = batch
    for xs, ys in zip(x.split(micro), y.split(micro)):
        (loss_fn(model, (xs, ys)) * len(xs) / len(x)).backward()


def accumulated(**kwargs: Any) -> Backward:
    return lambda model, batch, scaler: accumnorm.backward(model, batch, loss_fn, grad_scaler=scaler, **kwargs)


def one_step(base: nn.Module, batch: Any, precision: str, backward: Backward) -> dict[str, torch.Tensor]:
    """The gradients (unscaled, as GradScaler.unscale_ leaves them) and statistics of one step of a copy of `base`."""
    model = copy.deepcopy(base)
    device = next(model.parameters()).device
    scaler = torch.amp.GradScaler(device.type, init_scale=SCALE) if precision == "fp16" else None
    dtype = AUTOCAST[precision]
    with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
        backward(model, batch, scaler)
    if scaler is not None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler.unscale_(optimizer)  # the true gradient; inf/nan found here makes step() skip and update() back off
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() != SCALE:
            raise AssertionError(f"GradScaler found inf/nan in a step that should be finite (scale now "
                                 f"{scaler.get_scale()})")
    return state_of(model, base)


# ---------------------------------------------------------------- the checks
def check_exact(device: torch.device, precision: str) -> list[Row]:
    name = f"exact {precision}"
    base = resnet("resnet18", device) if precision == "float32" else study_net(device)
    batch = batch_of(32, 32, device)
    with tf32_off():
        want = oracle(base, batch)
        reference = worst_error(one_step(base, batch, precision, whole_batch), want)
        limit = max(FLOOR[precision], 2 * reference)
        rows = [Row(name, "whole batch in torch (reference)", f"{reference:.1e}", "", "INFO")]
        cases = {"layerwise, store=None": dict(schedule="layerwise")}  # pinned host memory on CUDA
        if precision == "float32":
            cases["passes"] = dict(schedule="passes")
            if device.type == "cuda":
                cases["layerwise, store='cuda'"] = dict(schedule="layerwise", store="cuda")
        for case, kwargs in cases.items():
            got = one_step(base, batch, precision, accumulated(micro_batch_size=4, **kwargs))
            rows.append(verdict(name, f"{case}, 8 x 4", worst_error(got, want), limit))
        plain = worst_error(one_step(base, batch, precision, accumulated(micro_batch_size=4, bn="micro")), want)
        rows.append(Row(name, "plain accumulation bn='micro' (for scale)", f"{plain:.1e}", "", "INFO"))
    return rows


def check_overflow(device: torch.device) -> list[Row]:
    """A step whose fp16 gradients overflow is skipped as GradScaler skips it; running statistics still update."""
    name = "fp16 overflow"
    base, batch = study_net(device), batch_of(32, 32, device)
    want = {k: v for k, v in oracle(base, batch).items() if k.startswith("update")}
    model = copy.deepcopy(base)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**40)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast(device.type, dtype=torch.float16):
        loss = accumnorm.backward(model, batch, loss_fn, micro_batch_size=4, grad_scaler=scaler)
    scaler.unscale_(optimizer)
    overflowed = any(not torch.isfinite(p.grad).all() for p in model.parameters())
    scaler.step(optimizer)
    scaler.update()
    kept = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    stats = {k: v for k, v in state_of(model, base).items() if k.startswith("update")}
    return [
        truth(name, "loss returned finite (unscaled)", bool(torch.isfinite(loss)), f"{float(loss):.4g}"),
        truth(name, ".grad holds inf/nan after unscale_", overflowed, str(overflowed)),
        truth(name, "scaler.step skipped the optimizer", kept, f"weights {'kept' if kept else 'changed'}"),
        truth(name, "update() halved the scale", scaler.get_scale() == 2.0**39, f"{scaler.get_scale():.3g}"),
        verdict(name, "running statistics: the whole batch's", worst_error(stats, want), FLOOR["fp16"]),
    ]


def check_trainer_overflow(device: torch.device) -> list[Row]:
    """accumnorm.Trainer(amp="fp16"): an overflowing step skips the optimizer and scheduler; a finite one trains."""
    name = "fp16 overflow, Trainer"
    model = resnet("resnet18", device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    blow_up = [1e8]  # times the loss: finite in float32, inf in the fp16 gradients

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        return loss_fn(model, batch) * blow_up[0]

    trainer = accumnorm.Trainer(model, optimizer, loss, micro_batch_size=4, amp="fp16", scheduler=scheduler)
    batch, scale = batch_of(32, 32, device), trainer.scaler.get_scale()
    before = [p.detach().clone() for p in model.parameters()]
    trainer.step(batch)
    kept = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    seen = f"weights kept: {kept}, lr {scheduler.get_last_lr()[0]:g}, scale {trainer.scaler.get_scale():g}"
    rows = [truth(name, "overflowing step skipped", kept and scheduler.get_last_lr() == [0.1]
                  and trainer.scaler.get_scale() == scale / 2, seen)]
    blow_up[0] = 1.0
    trainer.step(batch)
    moved = not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    rows.append(truth(name, "next finite step trains", moved and scheduler.get_last_lr() == [0.05],
                      f"weights moved: {moved}, lr {scheduler.get_last_lr()[0]:g}"))
    return rows


def check_memory(device: torch.device) -> list[Row]:
    name, b, k = "memory", 8, 8
    base, batch = resnet("resnet18", device), batch_of(b * k, 112, device)
    steps = {
        f"plain accumulation, micro-batch {b}": accumulated(micro_batch_size=b, bn="micro"),
        f"exact {b} x {k}, store=None (pinned host)": accumulated(micro_batch_size=b),
        f"exact {b} x {k}, store='cuda'": accumulated(micro_batch_size=b, store="cuda"),
        f"whole batch of {b * k} in torch": whole_batch,
    }
    peaks = {}
    for case, backward in steps.items():
        model = copy.deepcopy(base)
        backward(model, batch, None)  # warm-up: cuDNN's algorithms and the host allocator's first blocks
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        backward(model, batch, None)
        torch.cuda.synchronize()
        peaks[case] = (torch.cuda.max_memory_allocated() - start) / 2**20
    plain, pinned, on_gpu, whole = peaks.values()
    rows = [Row(name, case, f"{mib:.0f} MiB ({mib / plain:.2f}x plain, {mib / whole:.2f}x whole)", "", "INFO")
            for case, mib in peaks.items()]
    rows.append(truth(name, "pinned store below store='cuda' and the whole batch", pinned < min(on_gpu, whole),
                      f"{pinned:.0f} < min({on_gpu:.0f}, {whole:.0f}) MiB"))
    return rows


class Interleaved:
    """Steps timed side by side under bf16 autocast: `steps[case](model)` on each case's own model. A case that
    runs out of memory is an INFO row, one that raises a FAIL row (`failed`), and the others go on."""

    def __init__(self, name: str, steps: dict[str, Callable[[nn.Module], Any]], models: dict[str, nn.Module],
                 device: torch.device) -> None:
        self.name, self.steps, self.models, self.device = name, steps, models, device
        self.times: dict[str, list[float | None]] = {case: [] for case in steps}
        self.failed: dict[str, Row] = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def step(self, case: str) -> float:
        """The seconds of one step of `case`."""
        self.models[case].zero_grad(set_to_none=True)
        self.sync()
        start = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            self.steps[case](self.models[case])
        self.sync()
        return time.perf_counter() - start

    def peak(self, case: str) -> float:
        """The MiB one step of `case` allocates above the level before it (CUDA)."""
        self.models[case].zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        self.step(case)
        return (torch.cuda.max_memory_allocated() - before) / 2**20

    def attempt(self, case: str, measure: Callable[[str], float]) -> float | None:
        if case in self.failed:
            return None
        try:
            return measure(case)
        except torch.OutOfMemoryError:
            self.failed[case] = Row(self.name, f"{case}: out of memory", "", "", "INFO")
        except Exception as err:  # this case fails; the others go on
            traceback.print_exc()
            self.failed[case] = Row(self.name, f"{case}: raised", f"{type(err).__name__}: {err}"[:200], "", "FAIL")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return None

    def rounds(self, n: int) -> None:
        """n timed rounds, interleaved so that the machine's drift hits every case alike, every other in reverse
        order so that no case gains from its place in the round."""
        order = list(self.steps)
        for r in range(n):
            for case in order if r % 2 == 0 else order[::-1]:
                self.times[case].append(self.attempt(case, self.step))

    def median(self, case: str) -> float:
        timed = [t for t in self.times[case] if t is not None]
        return statistics.median(timed) if timed else float("nan")

    def ratio(self, case: str, over: str) -> float:
        """The median of each round's time of `case` over `over`'s (a ratio within one round cancels drift); nan if
        they share no timed round."""
        ratios = [t / b for t, b in zip(self.times[case], self.times[over]) if t is not None and b is not None]
        return statistics.median(ratios) if ratios else float("nan")


def check_cost(device: torch.device) -> list[Row]:
    """Peak memory and time of one step against plain accumulation's: resnet50 at 224 px, 32 x 8, bf16 autocast."""
    name, b, k, rounds = "cost bf16", 32, 8, 3
    base, batch = resnet("resnet50", device), batch_of(b * k, 224, device)
    backwards = {"plain (bn='micro')": accumulated(micro_batch_size=b, bn="micro"),
                 "layerwise, store=None (pinned host)": accumulated(micro_batch_size=b, schedule="layerwise"),
                 "layerwise, store='cuda'": accumulated(micro_batch_size=b, schedule="layerwise", store="cuda")}
    if refusal("recompute") is None:
        backwards["recompute"] = accumulated(micro_batch_size=b, schedule="recompute")
    for keep_every in (1, 2):  # every region's arguments kept, and one region's in two
        if refusal(f"segments:keep_every={keep_every}") is None:
            backwards[f"segments, keep_every={keep_every}"] = accumulated(micro_batch_size=b, schedule="segments",
                                                                        keep_every=keep_every)
    backwards[f"whole batch of {b * k} in torch"] = whole_batch
    runs = Interleaved(name, {case: lambda model, f=f: f(model, batch, None) for case, f in backwards.items()},
                       {case: copy.deepcopy(base) for case in backwards}, device)
    peaks: dict[str, float] = {}
    for case in backwards:  # a warm-up step (cuDNN's algorithms, the host allocator's first blocks), then the peak
        if runs.attempt(case, runs.step) is not None:
            peaks[case] = runs.attempt(case, runs.peak)
    runs.rounds(rounds)
    plain = "plain (bn='micro')"
    rows = []
    for case in backwards:
        if case in runs.failed:
            rows.append(runs.failed[case])
            continue
        rows.append(Row(name, f"resnet50 224 px {b} x {k}: {case}",
                        f"{peaks[case]:.0f} MiB ({peaks[case] / peaks[plain]:.2f}x plain), "
                        f"{runs.median(case) * 1e3:.0f} ms ({runs.ratio(case, plain):.2f}x plain)", "", "INFO"))
    return rows


def check_compile(device: torch.device) -> list[Row]:
    """One step's time on torch.compile'd copies of resnet18 (inductor, bf16 autocast, 224 px, 32 x 4): exact
    (layerwise) and the compiled floor (plain accumulation with a graph break at each BatchNorm call, as exact mode
    breaks the graph) against compiled plain accumulation, exact against the floor, and each one's first step,
    which compiles it. On a CPU, for working on this script: aot_eager at 16 px, 4 x 4."""
    from _steps import break_at_batch_norms, compiling_apart, first_step

    name, rounds = "compile bf16", 3
    backend, size, b, k = ("inductor", 224, 32, 4) if device.type == "cuda" else ("aot_eager", 16, 4, 4)
    base, batch = resnet("resnet18", device), batch_of(b * k, size, device)
    plain, floor, exact = "compiled plain", "compiled floor", "compiled exact (layerwise)"
    runs = Interleaved(name, {
        plain: lambda model: plain_accumulation(model, batch, b),
        floor: lambda model: plain_accumulation(model, batch, b),
        exact: lambda model: accumnorm.backward(model, batch, loss_fn, micro_batch_size=b, schedule="layerwise"),
    }, {case: torch.compile(break_at_batch_norms(copy.deepcopy(base)) if case == floor else copy.deepcopy(base),
                            backend=backend) for case in (plain, floor, exact)}, device)
    first = {}
    with compiling_apart(len(runs.steps)):
        for case in runs.steps:  # the step that compiles, from empty caches; untimed in the rounds
            with first_step(case):
                first[case] = runs.attempt(case, runs.step)
        runs.rounds(rounds)
    rows = []
    for case in runs.steps:
        if case in runs.failed:
            rows.append(runs.failed[case])
            continue
        seen = f"{runs.median(case) * 1e3:.0f} ms ({runs.ratio(case, plain):.2f}x compiled plain"
        seen += f", {runs.ratio(case, floor):.2f}x the floor)" if case == exact else ")"
        rows.append(Row(name, f"resnet18 {size} px {b} x {k}, {backend}: {case}",
                        f"{seen}, first step {first[case]:.0f} s", "", "INFO"))
    return rows


def check_nccl(device: torch.device) -> list[Row]:
    import torch.distributed as dist

    name = "nccl"
    base, batch = resnet("resnet18", device), batch_of(32, 32, device)
    with tempfile.TemporaryDirectory() as tmp, tf32_off():
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            got = one_step(base, batch, "float32", accumulated(micro_batch_size=4, process_group=dist.group.WORLD))
        finally:
            dist.destroy_process_group()
        error = worst_error(got, oracle(base, batch))
    return [verdict(name, "one rank, process_group=WORLD, 8 x 4", error, FLOOR["float32"])]


CHECKS: dict[str, tuple[Callable[..., list[Row]], tuple, bool]] = {  # name: (check, its arguments, needs CUDA)
    "exact float32": (check_exact, ("float32",), False),
    "exact bf16": (check_exact, ("bf16",), False),
    "exact fp16": (check_exact, ("fp16",), False),
    "fp16 overflow": (check_overflow, (), False),
    "fp16 overflow, Trainer": (check_trainer_overflow, (), True),
    "memory": (check_memory, (), True),
    "cost bf16": (check_cost, (), True),
    "compile bf16": (check_compile, (), False),
    "nccl": (check_nccl, (), True),
}


def run(name: str, device: torch.device) -> list[Row]:
    """The rows of one check; a check that raises is one FAIL row, and the rest still run."""
    check, args, needs_cuda = CHECKS[name]
    if needs_cuda and device.type != "cuda":
        return [Row(name, "-", "", "", "SKIP (needs CUDA)")]
    try:
        return check(device, *args)
    except Exception as err:  # report it and go on: one failure must not hide the others
        traceback.print_exc()
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return [Row(name, "raised", f"{type(err).__name__}: {reason}"[:200], "", "FAIL")]
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def table(rows: list[Row]) -> str:
    widths = [max(len(field), *(len(row[i]) for row in rows)) for i, field in enumerate(Row._fields)]
    lines = [Row._fields, tuple("-" * w for w in widths), *rows]
    return "\n".join("| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths)) + " |" for line in lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: only the checks that can run without a GPU, for working on this script")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"no CUDA GPU present: nothing checked (exit status {NO_GPU}; --device cpu runs what can run on a CPU)")
        return NO_GPU
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    start = time.perf_counter()
    rows = [row for name in CHECKS for row in run(name, device)]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (nothing about CUDA checked)"
    print(f"accumnorm {accumnorm.__version__}, torch {torch.__version__}, {where}, "
          f"{time.perf_counter() - start:.0f} s\n")
    print(table(rows))
    return 1 if any(row.status == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
