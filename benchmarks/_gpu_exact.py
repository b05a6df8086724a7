"""gpu_check.py's exactness checks: one step against the float64 oracle in float32, bf16 and fp16, GradScaler's
overflow (alone and through accumnorm.Trainer), and a one-rank NCCL process group."""
from __future__ import annotations

import copy
import tempfile
from typing import Any

import torch
import torch.nn as nn
from _gpu_steps import (
    FLOOR,
    Row,
    accumulated,
    batch_of,
    loss_fn,
    one_step,
    oracle,
    resnet,
    state_of,
    study_net,
    tf32_off,
    truth,
    verdict,
    whole_batch,
    worst_error,
)

import accumnorm


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
