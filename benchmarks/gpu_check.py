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
import sys
import time
import traceback
from collections.abc import Callable

import torch
from _gpu_cost import check_compile, check_cost, check_memory
from _gpu_exact import check_exact, check_nccl, check_overflow, check_trainer_overflow
from _gpu_steps import Row

import accumnorm

NO_GPU = 77


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
