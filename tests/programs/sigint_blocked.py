"""Ctrl-C while loss_fn waits: for each way of waiting and each path, a step whose micro-batch 1 blocks (after a
BatchNorm call) prints "blocked <case>" and waits until the parent sends one SIGINT; the step must end in
KeyboardInterrupt, with the model and the thread's torch state as they were. One line per case:
"ok <case>" or "problem <case>: ...".

    python tests/programs/sigint_blocked.py     # driven by tests/engine/test_process_state.py
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import accumnorm
from helpers import EXACT_SCHEDULES

PATHS = {**{s: dict(schedule=s) for s in EXACT_SCHEDULES}, "micro": dict(bn="micro")}


def _pipe_read() -> None:
    read, write = os.pipe()  # nobody writes: a stalled data pipe
    try:
        os.read(read, 1)
    finally:
        os.close(read)
        os.close(write)


WAITS = {
    "Event.wait": lambda: threading.Event().wait(),
    "a stalled pipe": _pipe_read,
    "Queue.get": lambda: queue.Queue().get(),
    "time.sleep": lambda: time.sleep(3600),
    "Thread.join": lambda: _forever_thread().join(),
}


def _forever_thread() -> threading.Thread:
    t = threading.Thread(target=threading.Event().wait, daemon=True)
    t.start()
    return t


def state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*(p.grad for p in model.parameters()), *model.buffers())]


def run_case(case: str, wait, kwargs: dict) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 10))
    batch = (torch.randn(8, 6), torch.randint(0, 10, (8,)))
    accumnorm.backward(model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=2, **kwargs)
    before = state(model)
    calls = []

    def block_after_batch_norm(module, args, out):
        calls.append(1)
        if len(calls) == 2:  # micro-batch 1, whatever the path
            print(f"blocked {case}", flush=True)
            wait()

    hook = model[2].register_forward_hook(block_after_batch_norm)
    try:
        accumnorm.backward(model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=2, **kwargs)
    except KeyboardInterrupt:
        pass
    else:
        return f"problem {case}: the step ended without KeyboardInterrupt"
    finally:
        hook.remove()
    if not all(torch.equal(x, y) for x, y in zip(state(model), before, strict=True)):
        return f"problem {case}: the model changed"
    thread_state = (torch.is_grad_enabled(), torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())
    if thread_state != (True, 0, 0):
        return f"problem {case}: the thread's torch state changed: {thread_state}"
    return f"ok {case}"


def main() -> int:
    torch.set_num_threads(1)
    for path, kwargs in PATHS.items():
        for name, wait in WAITS.items():
            print(run_case(f"{path}, {name}", wait, kwargs), flush=True)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
