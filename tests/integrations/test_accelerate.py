"""accumnorm.integrations.accelerate: an Accelerate training loop with micro-batches trains like plain
PyTorch with the whole batch per step, on one process and on two CPU processes; misuse fails at set-up.

`accelerate launch --cpu --num_processes 2` starts a single process here (multi-CPU goes through mpirun),
so the two processes get torchrun's environment, which Accelerate reads as a multi-CPU (gloo) run.
"""
import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.state import AcceleratorState

import accumnorm
from accumnorm.integrations.accelerate import ExactAccumulator
from helpers import (
    SCHEDULE_OPTIONS,
    accelerate_steps,
    assert_ran_with,
    assert_ranks_ended_well,
    assert_ranks_trained_like_whole_batch,
    assert_state_close,
    ce_loss,
    launch_ranks,
    sgd_halving,
    train_whole_batch,
)
from models import TinyUnrolled, timm_model, tiny_bn, tiny_dataset

PROGRAM = Path(__file__).parents[1] / "programs" / "accelerate_ddp.py"
CLIP = 0.05  # the gradient norm is ~0.1-1 here: every step is clipped


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """Accelerate keeps one process-wide state, fixed by the first Accelerator: each test makes its own."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def prepared(accelerator: Accelerator, net: nn.Module, data, micro_batch_size: int = 3):
    """net, its optimizer and scheduler and a loader of batches of 8, through `prepare`, plus an ExactAccumulator."""
    optimizer, scheduler = sgd_halving(net.parameters())
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, optimizer, loader, scheduler = accelerator.prepare(net, optimizer, loader, scheduler)
    exact = ExactAccumulator(accelerator, model, optimizer, ce_loss, micro_batch_size=micro_batch_size)
    return exact, model, optimizer, scheduler, list(loader)


def test_loop_equals_whole_batch_training_and_resumes_from_save_state(tmp_path):
    """3 steps over batches of 8 as micro-batches 3 + 3 + 2, float64, clipped with clip_grad_norm_, the LR halved every
    step, accumnorm's BatchNorm (the two-process test keeps torch's): parameters, running statistics and losses are
    whole-batch PyTorch's; the state saved after step 2 by save_state, loaded into fresh objects, gives the same
    step 3."""
    data = tiny_dataset(16)
    accelerator = Accelerator(cpu=True)
    net = accumnorm.convert(tiny_bn())
    exact, model, optimizer, scheduler, batches = prepared(accelerator, net, data)
    losses = accelerate_steps(exact, accelerator, model, optimizer, scheduler, batches, CLIP)
    accelerator.save_state(tmp_path / "state")
    losses += accelerate_steps(exact, accelerator, model, optimizer, scheduler, batches[:1], CLIP)

    oracle = tiny_bn()
    want, norms = train_whole_batch(oracle, [batches[0], batches[1], batches[0]], max_grad_norm=CLIP)
    assert min(norms) > CLIP  # clipping is part of what is compared
    assert losses == pytest.approx(want, rel=1e-12)
    assert_state_close(net.state_dict(), oracle.state_dict(), 1e-9)

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    resumed = accumnorm.convert(tiny_bn())
    exact, model, optimizer, scheduler, batches = prepared(accelerator, resumed, data)
    accelerator.load_state(tmp_path / "state")
    accelerate_steps(exact, accelerator, model, optimizer, scheduler, batches[:1], CLIP)
    assert_state_close(resumed.state_dict(), net.state_dict(), 0.0)


@pytest.mark.usefixtures("fresh_dynamo")
def test_dynamo_backend_compiles_the_model_and_trains_like_whole_batch_training():
    """Accelerator(dynamo_backend="aot_eager"): prepare compiles the model; 2 steps over batches of 8 as micro-batches
    3 + 3 + 2, float64, clipped, the LR halved every step: dynamo compiles graphs between the BatchNorm calls, and the
    losses, parameters and running statistics are whole-batch PyTorch's."""
    from torch._dynamo.utils import counters

    accelerator = Accelerator(cpu=True, dynamo_backend="aot_eager")
    net = TinyUnrolled()
    exact, model, optimizer, scheduler, batches = prepared(accelerator, net, tiny_dataset(16))
    assert type(model).__name__ == "OptimizedModule"
    losses = accelerate_steps(exact, accelerator, model, optimizer, scheduler, batches, CLIP)
    assert counters["stats"]["unique_graphs"] > 0
    oracle = TinyUnrolled()
    want, norms = train_whole_batch(oracle, batches, max_grad_norm=CLIP)
    assert min(norms) > CLIP  # clipping is part of what is compared
    assert losses == pytest.approx(want, rel=1e-12)
    assert_state_close(net.state_dict(), oracle.state_dict(), 1e-9)


def test_a_compiled_ddp_wrapper_is_refused(tmp_path):
    """What dynamo_backend makes on several processes, torch.compile over DDP, in a one-process gloo group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        accelerator = Accelerator(cpu=True)
        net = tiny_bn()
        optimizer = accelerator.prepare(torch.optim.SGD(net.parameters(), lr=0.1))
        model = torch.compile(nn.parallel.DistributedDataParallel(net), backend="aot_eager")
        with pytest.raises(ValueError, match=re.escape("the model is a torch.compile'd DDP wrapper (Accelerator("
                                                       "dynamo_backend=...) on several processes)")):
            ExactAccumulator(accelerator, model, optimizer, ce_loss, micro_batch_size=3)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_autocasts_and_scales(precision):
    """bf16: the forward runs in bfloat16 and the steps are whole-batch PyTorch's under the same autocast.
    fp16: Accelerate makes no GradScaler on a CPU, so the test gives it the one it makes on CUDA (and turns
    its autocast on): a gradient left scaled, or unscaled twice, would be off by the scale, 2**12."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    if precision == "fp16":
        accelerator.native_amp, accelerator.scaler = True, torch.amp.GradScaler("cpu", init_scale=2.0**12)
    net = accumnorm.convert(tiny_bn(torch.float32))
    seen = set()
    net[0].register_forward_hook(lambda module, inputs, output: seen.add(output.dtype))
    exact, model, optimizer, scheduler, batches = prepared(accelerator, net, tiny_dataset(16, torch.float32))
    accelerate_steps(exact, accelerator, model, optimizer, scheduler, batches, CLIP)
    assert seen == {dtype}
    if precision == "fp16":
        assert accelerator.scaler.get_scale() == 2.0**12  # no step overflowed
    oracle = tiny_bn(torch.float32)
    train_whole_batch(oracle, batches, max_grad_norm=CLIP, autocast=dtype)
    assert_state_close(net.state_dict(), oracle.state_dict(), 2e-2)


def _set_up(accelerator: Accelerator, optimizer: str) -> tuple:
    net = accumnorm.convert(tiny_bn(torch.float32))
    params = nn.Linear(2, 2).parameters() if optimizer == "foreign" else net.parameters()
    opt = torch.optim.SGD(params, lr=0.1)
    model, prepared_opt = accelerator.prepare(net, opt)
    return model, (opt if optimizer == "unprepared" else prepared_opt)


MISUSES = {  # name: (Accelerator arguments, which optimizer, ExactAccumulator arguments, the error, its words)
    "gradient_accumulation_steps": (dict(gradient_accumulation_steps=4), "prepared", {}, ValueError,
                                    "Accelerator(gradient_accumulation_steps=4) accumulates with each batch's own"),
    "unprepared optimizer": ({}, "unprepared", {}, ValueError,
                             "the optimizer (SGD) did not go through accelerator.prepare"),
    "foreign optimizer": ({}, "foreign", {}, ValueError, "steps 2 tensors, 2 of them not parameters of Sequential"),
    "micro_batch_size": ({}, "prepared", dict(micro_batch_size=0), ValueError, "micro_batch_size must be >= 1, got 0"),
    "bn": ({}, "prepared", dict(bn="exactly"), ValueError, "bn must be one of ('exact', 'micro'), got 'exactly'"),
    "schedule": ({}, "prepared", dict(schedule="fast"), ValueError, "schedule must be one of ('auto', 'layerwise'"),
    "store": ({}, "prepared", dict(store=3), TypeError, "store must be None, 'cpu' or a torch.device, got int 3"),
    "memory_budget": ({}, "prepared", dict(memory_budget=1.5e9), TypeError,
                      "memory_budget must be a number of bytes (an int) or None, got float 1500000000.0"),
    "keep_every": ({}, "prepared", dict(keep_every=2), ValueError,
                   "keep_every is the segments schedule's setting, but schedule is 'auto'"),
    "loss_fn": ({}, "prepared", dict(loss_fn="ce"), TypeError, "loss_fn must be callable as loss_fn(model, micro_b"),
}


@pytest.mark.parametrize("misuse", MISUSES)
def test_misuse_raises_at_set_up(misuse):
    accelerator_args, optimizer, args, error, message = MISUSES[misuse]
    accelerator = Accelerator(cpu=True, **accelerator_args)
    model, opt = _set_up(accelerator, optimizer)
    with pytest.raises(error, match=re.escape(message)):
        ExactAccumulator(accelerator, model, opt, **{"loss_fn": ce_loss, "micro_batch_size": 3, **args})


def test_a_run_under_recompute_resumed_by_load_state_steps_as_one_that_never_stopped(tmp_path):
    """timm's LCNet, whose smallest blocks recompute runs as they are from its second step on (a BatchNorm call there
    rounds otherwise than in a checkpointed block): with the ExactAccumulator registered for checkpointing, save_state
    keeps recompute's measurements and the resumed run's first step is bit for bit the step of a run that never
    stopped."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(12, 3, 32, 32, generator=g), torch.randint(0, 10, (12,), generator=g)) for _ in range(3)]
    torch.manual_seed(0)
    start = timm_model()

    def run(steps: list, load: bool = False) -> nn.Module:
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = Accelerator(cpu=True)
        net = copy.deepcopy(start)
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
        exact = ExactAccumulator(accelerator, model, optimizer, ce_loss, micro_batch_size=4, schedule="recompute")
        accelerator.register_for_checkpointing(exact)
        if load:
            accelerator.load_state(tmp_path / "state")
        for batch in steps:
            optimizer.zero_grad()
            exact.backward(batch)
            optimizer.step()
        if len(steps) == 2:
            accelerator.save_state(tmp_path / "state")
        return net

    never_stopped = run(batches)
    run(batches[:2])
    resumed = run(batches[2:], load=True)
    assert_state_close(resumed.state_dict(), never_stopped.state_dict(), 0.0)


@pytest.mark.parametrize("option", SCHEDULE_OPTIONS)
def test_the_schedules_options_reach_the_step(option):
    options = SCHEDULE_OPTIONS[option]
    accelerator = Accelerator(cpu=True)
    model, opt = _set_up(accelerator, "prepared")
    ExactAccumulator(accelerator, model, opt, ce_loss, micro_batch_size=3, **options).backward(
        tiny_dataset(8, torch.float32)[:])
    assert_ran_with(model, options)


def test_a_batch_that_cannot_be_split_changes_nothing():
    accelerator = Accelerator(cpu=True)
    model, opt = _set_up(accelerator, "prepared")
    exact = ExactAccumulator(accelerator, model, opt, ce_loss, micro_batch_size=3)
    x, y = tiny_dataset(8, torch.float32)[:]
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=re.escape("batch fields must share their length (dim 0 of a tensor, len of")):
        exact.backward((x, y[:5]))
    assert all(p.grad is None for p in model.parameters())
    assert_state_close(model.state_dict(), before, 0.0)


@pytest.mark.realtime
@pytest.mark.slow
def test_two_cpu_processes_equal_one_process_with_the_global_batch(tmp_path):
    """2 processes x micro-batches 3 + 1 of 4 samples each against plain PyTorch on batches of 8, float64, clipped,
    torch's BatchNorm unconverted: the DDP wrapper that prepare makes must not reduce a second time nor wait for its
    own backward."""
    results = launch_ranks([str(PROGRAM), str(tmp_path), str(CLIP)], tmp_path, wait_s=900)
    assert_ranks_ended_well(results)
    assert_ranks_trained_like_whole_batch(tmp_path, 2, tiny_bn(), CLIP)
    for rank in range(2):  # the model must be the DDP wrapper that prepare made
        refused = (tmp_path / f"unwrapped-{rank}.txt").read_text()
        assert "got distributed_type=MULTI_CPU with a Sequential model" in refused
