"""What a step leaves of the process, and of the objects outside the model: the process-wide flags a loss_fn enters
and leaves, the gradients of leaves the losses reach, another thread's random numbers, the memory of failed steps,
Ctrl-C while loss_fn waits, and steps that wait for each other."""
from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import queue
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, noop_context_fn, set_checkpoint_early_stop

import accumnorm
from helpers import EXACT_SCHEDULES, assert_unchanged, ce_loss, compare, cpu_env, rel_err, snapshot, whole_batch
from models import data, resnet


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                         nn.Tanh(), nn.Linear(8, 10)).double()


@contextlib.contextmanager
def _set(get, set_, value):
    """The process flag that `get` reads set to `value` by `set_` for the block, as it was after."""
    before = get()
    set_(value)
    try:
        yield
    finally:
        set_(before)


@contextlib.contextmanager
def _deterministic():
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@contextlib.contextmanager
def _ignoring_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _sdpa_math_only():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.MATH])


# (name, the context loss_fn enters around the model, what it changes: read inside and after the step)
_FLAG_CONTEXTS = {
    "detect_anomaly": (torch.autograd.detect_anomaly, torch.is_anomaly_enabled),
    "detect_anomaly(check_nan=False)": (lambda: torch.autograd.detect_anomaly(check_nan=False),
                                        lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())),
    "mkldnn.flags": (lambda: torch.backends.mkldnn.flags(enabled=False), lambda: torch.backends.mkldnn.enabled),
    "cudnn.flags": (lambda: torch.backends.cudnn.flags(enabled=False, benchmark=True, deterministic=True),
                    lambda: (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
                             torch.backends.cudnn.deterministic)),
    "default dtype": (lambda: _set(torch.get_default_dtype, torch.set_default_dtype, torch.float16),
                      torch.get_default_dtype),
    "set_checkpoint_early_stop": (lambda: set_checkpoint_early_stop(False),
                                  lambda: torch.utils.checkpoint._enable_checkpoint_early_stop),
    "deterministic algorithms": (_deterministic, torch.are_deterministic_algorithms_enabled),
    "sdpa_kernel": (_sdpa_math_only, torch.backends.cuda.flash_sdp_enabled),
    "warnings.catch_warnings": (_ignoring_warnings, lambda: warnings.filters[0][0]),
    "set_float32_matmul_precision": (lambda: _set(torch.get_float32_matmul_precision,
                                                   torch.set_float32_matmul_precision, "medium"),
                                     torch.get_float32_matmul_precision),
}


@pytest.mark.parametrize("name", list(_FLAG_CONTEXTS))
def test_a_process_flag_entered_in_loss_fn_is_each_micro_batchs_own_and_as_it_was_after(schedule, name):
    """A process-wide flag that loss_fn enters and leaves around the model: each micro-batch sees its own after its
    BatchNorm calls, the step is exact, and after it the flag is as it was; also after a failed step."""
    enter, read = _FLAG_CONTEXTS[name]
    ref = _tiny()
    ours = copy.deepcopy(ref)
    batch = data((6,), 8, torch.float64)
    seen = []

    def loss_fn(m, b, fail=False):
        with enter():
            out = m(b[0])
            seen.append(read())
            if fail and len(seen) == 3:
                raise RuntimeError("late failure")
        return F.cross_entropy(out, b[1])

    with enter():
        inside = read()
    before = read()
    assert inside != before  # the context does change the flag
    loss = accumnorm.backward(ours, batch, loss_fn, micro_batch_size=2, schedule=schedule)
    assert read() == before
    assert seen and all(s == inside for s in seen)
    assert rel_err(loss, whole_batch(ref, batch, loss_fn)) < 1e-12
    compare(ref, ours, 1e-9)
    seen.clear()
    with pytest.raises(RuntimeError, match="late failure"):
        accumnorm.backward(ours, batch, lambda m, b: loss_fn(m, b, fail=True), micro_batch_size=2,
                           schedule=schedule)
    assert read() == before
    assert all(s == inside for s in seen)


def test_the_modes_read_again_unchanged_are_the_same_object_and_a_change_is_read():
    """Modes.current() at every BatchNorm call returns the object it returned last while nothing changed (the calls'
    modes then compare at identity), and reads a change of grad mode or of a process-wide flag."""
    from accumnorm._engine.safety.threadstate import Modes

    first = Modes.current()
    assert Modes.current() is first
    with torch.no_grad():
        off = Modes.current()
        assert off is not first and not off.grad and Modes.current() is off
    with _set(torch.get_default_dtype, torch.set_default_dtype, torch.float64):
        assert Modes.current().flags != first.flags
    assert Modes.current() == first


class _Hooked:
    """A tensor hook that counts its calls and raises at call `fail_at` (None: never)."""

    def __init__(self) -> None:
        self.calls, self.fail_at = 0, None

    def __call__(self, grad: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("failure in the backward")


@pytest.mark.parametrize("form", ["loss_fn", "whole-batch loss"])
@pytest.mark.parametrize("failure", ["nan loss in micro-batch 2", "error in the last backward"])
def test_leaves_outside_the_model_are_part_of_the_transaction(schedule, form, failure):
    """An input that requires grad (adversarial training) and a temperature held outside the model: a failed step
    leaves their .grad as it was, a successful one adds the whole batch's gradient to it."""
    if form == "whole-batch loss" and failure.startswith("nan"):
        failure = "error in the last backward"  # a whole-batch loss is checked before any backward
    ref = _tiny()
    ours = copy.deepcopy(ref)
    x, y = data((6,), 8, torch.float64)
    hook = _Hooked()
    leaves = []
    for _ in range(2):  # the oracle's and ours
        temp = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
        temp.register_hook(hook)
        xs = x.clone().requires_grad_()
        xs.grad, temp.grad = torch.ones_like(x), torch.tensor(0.25, dtype=torch.float64)  # from earlier steps
        leaves.append((xs, temp))
    (x_ref, t_ref), (x_ours, t_ours) = leaves
    poisoned = x_ours.detach()[4:6]

    def loss_fn(m, b, temp, nan=False):
        loss = F.cross_entropy(m(b[0]) / temp, b[1])
        return loss * float("nan") if nan and torch.equal(b[0].detach(), poisoned) else loss

    def step(fail: bool) -> None:
        nan = fail and failure.startswith("nan")
        if form == "loss_fn":
            accumnorm.backward(ours, (x_ours, y), lambda m, b: loss_fn(m, b, t_ours, nan), micro_batch_size=2,
                               schedule=schedule)
        else:
            accumnorm.backward(ours, (x_ours, y), micro_batch_size=2, schedule=schedule, targets=y,
                               forward_fn=lambda m, b: m(b[0]),
                               batch_loss_fn=lambda out, t: F.cross_entropy(out / t_ours, t))

    hook.calls = 0
    whole_batch(ref, (x_ref, y), lambda m, b: loss_fn(m, b, t_ref))
    ours_before = [p.grad for p in ours.parameters()], x_ours.grad.clone(), t_ours.grad.clone()
    hook.calls, hook.fail_at = 0, None
    buffers = copy.deepcopy(ours.state_dict())
    step(fail=False)  # counts the hook's calls in one step
    calls = hook.calls
    ours.load_state_dict(buffers)
    for p, g in zip(ours.parameters(), ours_before[0]):
        p.grad = g
    x_ours.grad, t_ours.grad = ours_before[1].clone(), ours_before[2].clone()
    hook.calls, hook.fail_at = 0, calls if failure.startswith("error") else None
    with pytest.raises((ValueError, RuntimeError), match="not finite|failure in the backward"):
        step(fail=True)
    assert all(p.grad is None for p in ours.parameters())
    assert torch.equal(x_ours.grad, ours_before[1]) and torch.equal(t_ours.grad, ours_before[2])
    hook.fail_at = None
    step(fail=False)
    compare(ref, ours, 1e-9)
    assert rel_err(x_ours.grad, x_ref.grad) < 1e-9 and rel_err(t_ours.grad, t_ref.grad) < 1e-9


def test_a_draw_between_a_micro_batchs_turns_is_not_drawn_again():
    """Between a micro-batch's turns the generator holds the process's stream: what another thread draws then is
    neither a value the micro-batch draws next nor one the process's stream gives again."""
    from accumnorm._engine.safety.rng import StepRng

    rng = StepRng(2, [])
    rng.start()
    rng.begin(0)
    torch.rand(3)
    rng.end(0)
    foreign = torch.rand(50, dtype=torch.float64)  # another thread, between micro-batch 0's turns
    rng.begin(0)
    own = torch.rand(50, dtype=torch.float64)
    rng.end(0)
    later = torch.rand(50, dtype=torch.float64)
    rng.close(failed=False)
    values = torch.cat([foreign, own, later])
    assert values.unique().numel() == values.numel()


def test_turns_that_follow_one_another_keep_each_stream_and_end_with_the_process_stream():
    """Layerwise's turns go from one micro-batch's stream straight to the next's: each stream goes on where it was
    left, as with an end between turns, and once the turns end the process's stream goes on where it was."""
    from accumnorm._engine.safety.rng import StepRng

    def draws(follow_on: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        rng = StepRng(2, [])
        rng.start()
        got = []
        for k in (0, 1, 0, 1):
            rng.begin(k)
            got.append(torch.rand(4, dtype=torch.float64))
            if not follow_on:
                rng.end(k)
        rng.end_turns()
        after = torch.rand(4, dtype=torch.float64)
        rng.close(failed=False)
        return got, after

    (chained, after_chained), (separate, after_separate) = draws(True), draws(False)
    for a, b in zip(chained, separate):
        assert torch.equal(a, b)
    assert torch.equal(after_chained, after_separate)
    values = torch.cat([*chained, after_chained])
    assert values.unique().numel() == values.numel()


def test_a_step_inside_another_is_refused_saying_steps_cannot_be_nested(schedule):
    model, inner = _tiny(), _tiny()
    batch = data((6,), 8, torch.float64)
    snap = snapshot(model)

    def loss_fn(m, b):
        accumnorm.backward(inner, b, ce_loss, micro_batch_size=2, schedule=schedule)
        return ce_loss(m, b)

    with pytest.raises(ValueError, match="steps cannot be nested"):
        accumnorm.backward(model, batch, loss_fn, micro_batch_size=2, schedule=schedule)
    assert_unchanged(model, snap)
    assert all(p.grad is None for p in inner.parameters())


@pytest.mark.realtime
def test_a_loss_fn_may_wait_for_a_step_on_another_thread(schedule):
    """loss_fn hands a step on another model to a worker thread and waits for it: both steps finish, each exact."""
    torch.manual_seed(0)
    ref, other_ref = _tiny(), _tiny()
    ours, other = copy.deepcopy(ref), copy.deepcopy(other_ref)
    batch, other_batch = data((6,), 8, torch.float64), data((6,), 8, torch.float64)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            accumnorm.backward(other, other_batch, ce_loss, micro_batch_size=2, schedule=schedule)
        except BaseException as e:  # handed to the test's thread
            errors.append(e)

    def loss_fn(m, b):
        loss = ce_loss(m, b)
        if not any(p.grad is not None for p in other.parameters()):  # once, in the first micro-batch
            t = threading.Thread(target=worker, daemon=True)
            t.start()
            t.join(timeout=120)  # a hang guard only: the worker's step takes well under a second
            assert not t.is_alive(), "the worker's step is still waiting"
        return loss

    accumnorm.backward(ours, batch, loss_fn, micro_batch_size=2, schedule=schedule)
    assert not errors, errors
    whole_batch(ref, batch)
    whole_batch(other_ref, other_batch)
    compare(ref, ours, 1e-9)
    compare(other_ref, other, 1e-9)


class _Checkpointed(nn.Module):
    """BatchNorm inside a checkpoint(use_reentrant=False) region, and one after it."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 10))

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=False))


def _checkpoint_left_open(function, *args):
    """torch 2.8's `checkpoint(use_reentrant=False)`, line for line: when `function` raises, its generator stays
    open, its saved-tensor hooks on the thread's stack, until the error is collected (newer torch closes it at
    once). Built from torch's own generator, whose settings differ between versions."""
    make = torch.utils.checkpoint._checkpoint_without_reentrant_generator
    early_stop = (True,) if "early_stop" in inspect.signature(make).parameters else ()
    generator = make(function, True, noop_context_fn, "default", False, *early_stop, *args)
    next(generator)
    out = function(*args)
    try:
        next(generator)
    except StopIteration:
        return out


def _pack(t):
    return t


def _unpack(t):
    return t


class _FailsInRegion(nn.Module):
    """A checkpointed region with a BatchNorm that raises in the last micro-batch of 7 samples in threes."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.head = nn.Linear(8, 10)

    def region(self, x):
        y = self.block(x)
        if x.shape[0] == 1:
            raise RuntimeError("failure in the last micro-batch's region")
        return y

    def forward(self, x):
        return self.head(_checkpoint_left_open(self.region, x))


@pytest.mark.filterwarnings("ignore:accumnorm.backward. the segments schedule recomputes")
def test_an_error_inside_a_checkpointed_region_leaves_the_callers_saved_tensor_hooks_in_place(schedule):
    # On torch 2.8 the region's hooks were popped when the error was collected, after the step had put the caller's
    # hooks back: the pop took the caller's own, and the caller's `with` block then failed on an empty stack (an
    # INTERNAL ASSERT of SavedTensorHooks.cpp).
    model = _FailsInRegion().double()
    x, y = data((6,), 7, torch.float64)

    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        with pytest.raises(RuntimeError, match="failure in the last micro-batch's region"):
            accumnorm.backward(model, (x, y), ce_loss, micro_batch_size=3, schedule=schedule)
        gc.collect()
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) == (_pack, _unpack)


class _RecomputedBlock(nn.Module):
    """A BatchNorm call, then a checkpointed function without one, which raises once `armed[0]` (set by the loss, so
    in the segments schedule's recomputation of the block in the step's backward)."""

    def __init__(self, armed: list[bool]) -> None:
        super().__init__()
        self.armed = armed
        self.norm = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
        self.mid = nn.Linear(8, 8)

    def region(self, x):
        if self.armed[0]:
            raise RuntimeError("failure in the region's recomputation")
        return torch.tanh(self.mid(x))

    def forward(self, x):
        return x + _checkpoint_left_open(self.region, self.norm(x))


@pytest.mark.parametrize("keep_every", [1, 2])
def test_an_error_inside_a_checkpoint_recomputed_by_segments_leaves_the_callers_saved_tensor_hooks_in_place(
        keep_every):
    # The segments schedule runs a region's forward again in the step's backward, outside the micro-batch's forward:
    # a checkpoint left open there by an error took the caller's hooks on torch 2.8, as above.
    armed = [False]
    model = nn.Sequential(nn.Linear(6, 8), *[_RecomputedBlock(armed) for _ in range(6)], nn.Linear(8, 10)).double()
    x, y = data((6,), 6, torch.float64)

    def loss_fn(m, batch):
        loss = ce_loss(m, batch)
        armed[0] = torch.equal(batch[0], x[4:])  # after the last micro-batch's forward
        return loss

    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        with pytest.raises(RuntimeError, match="failure in the region's recomputation"):
            accumnorm.backward(model, (x, y), loss_fn, micro_batch_size=2, schedule="segments",
                               keep_every=keep_every)
        gc.collect()
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) == (_pack, _unpack)


def _live_tensors() -> int:
    gc.collect()
    return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["error after the forward", "error at a BatchNorm call", "nan loss"])
def test_failed_steps_on_a_checkpointed_model_free_everything(schedule, failure, one_thread):
    """300 failing steps: the number of live tensors does not grow."""
    model = _Checkpointed()
    x, y = data((6,), 8)
    poisoned = x[4:6]

    def fail_at_batch_norm(module, args):
        if args[0].shape[0] == 2 and failure == "error at a BatchNorm call" and calls[0] >= 2:
            raise RuntimeError("failure in micro-batch 2")

    calls = [0]
    model.head[1].register_forward_pre_hook(fail_at_batch_norm)

    def loss_fn(m, b):
        calls[0] += 1
        loss = ce_loss(m, b)
        if torch.equal(b[0], poisoned):
            if failure == "nan loss":
                return loss * float("nan")
            raise RuntimeError("failure in micro-batch 2")
        return loss

    def failing_steps(n: int) -> None:
        for _ in range(n):
            calls[0] = 0
            with pytest.raises((RuntimeError, ValueError), match="failure in micro-batch 2|not finite"):
                accumnorm.backward(model, (x, y), loss_fn, micro_batch_size=2, schedule=schedule)

    failing_steps(10)
    before = _live_tensors()
    failing_steps(300)
    assert _live_tensors() <= before


@pytest.mark.parametrize("fails", [False, True], ids=["step", "failed step"])
@pytest.mark.parametrize("make", ["checkpointed", "blocks"])
def test_a_step_leaves_nothing_for_pythons_collector(schedule, fails, make):
    """What a step made is freed when it returns, as what torch's backward makes is: no tensor (the transaction's
    copies of the gradients, the micro-batches) and no object of the step's waits in a reference cycle for
    Python's next full collection, which may be many steps away (steps on resnet18 with zero_grad(set_to_none=False)
    held hundreds of MiB more). On a model of residual blocks recompute and segments run in regions of their own,
    whose patched forwards their check of the modules' attributes had kept."""
    model, (x, y) = (_Checkpointed(), data((6,), 8)) if make == "checkpointed" else (resnet(), data((1, 8, 8), 8))

    def loss_fn(m, b):
        loss = ce_loss(m, b)
        if fails and torch.equal(b[0], x[4:6]):
            raise RuntimeError("failure in micro-batch 2")
        return loss

    def step() -> None:
        try:
            accumnorm.backward(model, (x, y), loss_fn, micro_batch_size=2, schedule=schedule)
        except RuntimeError as e:
            assert "failure in micro-batch 2" in str(e) and fails

    step()  # gradients now exist, which the next step's transaction copies; recompute has measured its regions
    gc.collect()
    gc.disable()
    try:
        step()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage
                if isinstance(o, torch.Tensor) or type(o).__module__.startswith("accumnorm")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []


@pytest.mark.realtime
@pytest.mark.slow
def test_ctrl_c_ends_a_loss_fn_that_waits():
    """tests/programs/sigint_blocked.py: micro-batch 1 blocks inside the model (an Event, a stalled pipe, a queue, a
    sleep, a join) under each path; once it says it is blocked, one SIGINT ends the step with KeyboardInterrupt and
    nothing changed. The child's lines are read as they come; the timeout only guards against a hang."""
    program = Path(__file__).parents[1] / "programs" / "sigint_blocked.py"
    proc = subprocess.Popen([sys.executable, str(program)], env=cpu_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    results = []
    try:
        while True:
            line = lines.get(timeout=120).strip()
            if line.startswith("blocked "):
                proc.send_signal(signal.SIGINT)
            elif line.startswith(("ok ", "problem ")):
                results.append(line)
            elif line == "done":
                break
    except queue.Empty:
        pytest.fail(f"the child hung after {results}")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert len(results) == 5 * (len(EXACT_SCHEDULES) + 1) and all(r.startswith("ok ") for r in results), results


@pytest.mark.realtime
def test_a_sigint_deferred_right_before_the_users_code_blocks_still_ends_the_wait():
    """A SIGINT that lands in a callback of torch's code the interpreter runs between two lines of the user's (a
    weakref callback during a collection) waits for a safe point; if the user's code then blocks, it reaches none.
    The deferred SIGINT is sent again until one takes it: the wait ends in KeyboardInterrupt, well within a second."""
    import time

    from accumnorm._engine.safety.interrupts import SigintDeferred

    torch_frame = eval("__import__('sys')._getframe()", {"__name__": "torch.fake"})
    deferred = SigintDeferred()
    deferred.start()
    try:
        deferred._record(signal.SIGINT, torch_frame)  # deferred, as in the callback
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            time.sleep(10)  # the user's wait, in the user's code
        assert time.monotonic() - started < 5
        deferred.check()  # taken: nothing is left pending
    finally:
        deferred.close()


@pytest.mark.realtime
def test_a_second_sigint_while_the_first_waits_for_a_safe_point_is_raised_at_once():
    """A SIGINT that lands in torch's code waits for the step's next safe point; a second one before it is raised
    where it lands (code blocked in torch reaches no safe point). In the user's code the first is raised at once."""
    from accumnorm._engine.safety.interrupts import SigintDeferred

    torch_frame = eval("__import__('sys')._getframe()", {"__name__": "torch.fake"})  # a frame of torch's code
    deferred = SigintDeferred()
    deferred.start()
    try:
        deferred._record(signal.SIGINT, torch_frame)  # what the signal calls: recorded only
        with pytest.raises(KeyboardInterrupt):
            deferred._record(signal.SIGINT, torch_frame)
        deferred.check()  # nothing is left pending
        with pytest.raises(KeyboardInterrupt):
            deferred._record(signal.SIGINT, sys._getframe())
    finally:
        deferred.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _resends_the_caller_sees(monkeypatch: pytest.MonkeyPatch, close_at_once: bool) -> list[int]:
    """One deferred SIGINT, taken by a safe point right after the timer looked and found it pending, before its send
    lands; then the step closes (`close_at_once`: while that send is still on its way). Each SIGINT the caller's
    handler got, during the step or after it."""
    import time

    from accumnorm._engine.safety import interrupts

    got: list[int] = []
    caller = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    looked, go = threading.Event(), threading.Event()
    real_kill = signal.pthread_kill

    def kill(ident: int, signum: int) -> None:  # on the timer's thread, once it found the SIGINT still pending
        looked.set()
        if close_at_once:
            time.sleep(0.1)
        else:
            go.wait(10)
        real_kill(ident, signum)

    monkeypatch.setattr(signal, "pthread_kill", kill)
    monkeypatch.setattr(interrupts, "_RESEND_S", 0.01)
    torch_frame = eval("__import__('sys')._getframe()", {"__name__": "torch.fake"})
    deferred = interrupts.SigintDeferred()
    try:
        deferred.start()
        deferred._record(signal.SIGINT, torch_frame)  # deferred: the timer starts
        assert looked.wait(10)
        deferred.check()  # the safe point: the caller's handler, once
        if not close_at_once:
            go.set()
            time.sleep(0.2)  # the send lands, in the step
        deferred.close()
        time.sleep(0.3)  # and anything else the timer sent, after it
    finally:
        go.set()
        deferred.close()
        signal.signal(signal.SIGINT, caller)
    return got


@pytest.mark.realtime
@pytest.mark.parametrize("close_at_once", [False, True], ids=["lands-in-the-step", "lands-as-it-closes"])
def test_a_deferred_sigint_sent_again_as_a_safe_point_takes_it_comes_once(monkeypatch, close_at_once):
    """The timer sends a deferred SIGINT again until a safe point takes it. One that lands after the safe point took
    it, in the step or as the step gives SIGINT back, is the same Ctrl-C: the caller's handler runs once."""
    assert _resends_the_caller_sees(monkeypatch, close_at_once) == [signal.SIGINT]


def test_a_second_sigint_as_the_step_gives_sigint_back_still_gives_it_back(monkeypatch):
    """`signal.signal` runs the handler of a SIGINT the process holds before it sets the new one. A second Ctrl-C held
    as the step gives SIGINT back, while the first waits for a safe point, would be raised at once by the step's
    handler, inside `signal.signal`, which then set nothing: the step's handler would stay, for good. It is raised
    once SIGINT is the caller's again."""
    from accumnorm._engine.safety import interrupts

    torch_frame = eval("__import__('sys')._getframe()", {"__name__": "torch.fake"})
    real_signal = signal.signal

    def signal_with_one_held(signum: int, handler: object) -> object:
        installed = signal.getsignal(signum)
        if callable(installed) and installed is not handler:
            installed(signum, sys._getframe())  # the held SIGINT, landing in the user's code
        return real_signal(signum, handler)

    deferred = interrupts.SigintDeferred()
    deferred.start()
    deferred._record(signal.SIGINT, torch_frame)  # the first, deferred
    monkeypatch.setattr(signal, "signal", signal_with_one_held)
    try:
        with pytest.raises(KeyboardInterrupt):
            deferred.close()
    finally:
        monkeypatch.undo()
        installed = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert installed is signal.default_int_handler


def test_a_sigint_in_a_weakref_callback_during_a_step_waits_for_a_safe_point():
    """A weakref callback (a WeakKeyDictionary's, a WeakSet's), run as a step frees tensors, is where the interpreter
    swallows an exception ("Exception ignored in"): a SIGINT landing there would be lost, so it waits for the step's
    next safe point, as in torch's code."""
    from accumnorm._engine.safety.interrupts import SigintDeferred

    raised_at_once = []
    for module in ("weakref", "_weakrefset"):
        frame = eval("__import__('sys')._getframe()", {"__name__": module})  # a frame of that module's code
        deferred = SigintDeferred()
        deferred.start()
        try:
            try:
                deferred._record(signal.SIGINT, frame)  # what the signal calls there
            except KeyboardInterrupt:
                raised_at_once.append(module)
            else:
                with pytest.raises(KeyboardInterrupt):
                    deferred.check()  # the next safe point
        finally:
            deferred.close()
    assert not raised_at_once, f"a SIGINT in the code of {raised_at_once} was raised where it lands"


def _nested(depth: int) -> nn.Module:
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh())
    for _ in range(depth):
        model = nn.Sequential(model)
    return nn.Sequential(model, nn.Linear(8, 10)).double()


def _deepest_whole_batch_torch_runs() -> int:
    """The deepest `_nested` model whole-batch torch can run here (the recursion limit bounds it)."""
    low, high = 10, 2000
    while high - low > 1:
        mid = (low + high) // 2
        try:
            ce_loss(_nested(mid), data((6,), 4, torch.float64)).backward()
            low = mid
        except RecursionError:
            high = mid
    return low


def _mine_greenlet_exit(m, b):
    import greenlet

    if torch.equal(b[0], _POISONED[0]):
        raise greenlet.GreenletExit("the user's own")
    return ce_loss(m, b)


def _asyncio_forward(m, b):
    import asyncio

    async def forward():
        await asyncio.sleep(0)
        return m(b[0])

    return F.cross_entropy(asyncio.run(forward()), b[1])


def _skips_batch_norm_in(k: int):
    def loss_fn(m, b):
        if torch.equal(b[0], _POISONED[k]):
            return F.cross_entropy(m[5:](m[:4](b[0])), b[1])  # around the second BatchNorm
        return ce_loss(m, b)
    return loss_fn


_POISONED: list[torch.Tensor] = []

# (loss_fn, what comes out: None for an exact step, else (exception type, message pattern))
_MESSAGES = {
    "a GreenletExit of the user's": (_mine_greenlet_exit, (BaseException, "the user's own")),
    "asyncio.run in loss_fn": (_asyncio_forward, None),
    "micro-batch 0 skips a BatchNorm call": (_skips_batch_norm_in(0), (
        ValueError, r"BatchNorm call 1 micro-batch 1 made one \(BatchNorm1d 4 over 8 channels\) where micro-batch 0 "
                    r"made none \(it had ended its forward\)|micro-batch 1 made BatchNorm call 1 .*where micro-batch 0 "
                    r"made 1|micro-batch 0 had ended its forward where micro-batch 1 was at the exit of a region")),
    "micro-batch 1 skips a BatchNorm call": (_skips_batch_norm_in(1), (
        ValueError, r"micro-batch 1 (had ended its forward where micro-batch 0 (made BatchNorm1d 4|was at the exit of "
                    r"a region)|made 1 BatchNorm calls where micro-batch 0 made 2)")),
}


@pytest.mark.parametrize("case", list(_MESSAGES))
def test_errors_say_what_happened(schedule, case):
    """Each case is exact, or ends in an error that names what happened (not a message about something else), with
    nothing changed."""
    loss_fn, outcome = _MESSAGES[case]
    ref = _tiny()
    ours = copy.deepcopy(ref)
    batch = data((6,), 8, torch.float64)
    _POISONED[:] = [batch[0][0:2], batch[0][2:4]]
    if outcome is None:
        accumnorm.backward(ours, batch, loss_fn, micro_batch_size=2, schedule=schedule)
        whole_batch(ref, batch, loss_fn)
        compare(ref, ours, 1e-9)
        return
    snap = snapshot(ours)
    error, message = outcome
    with pytest.raises(error, match=message) as raised:
        accumnorm.backward(ours, batch, loss_fn, micro_batch_size=2, schedule=schedule)
    assert "had ended its forward where micro-batch 0 made none" not in str(raised.value)
    assert_unchanged(ours, snap)


def test_a_model_as_deep_as_whole_batch_torch_runs_runs_in_a_step(schedule):
    depth = _deepest_whole_batch_torch_runs()
    ref, ours = _nested(depth), _nested(depth)  # deepcopy itself recurses too deep
    ours.load_state_dict(ref.state_dict())
    batch = data((6,), 8, torch.float64)
    accumnorm.backward(ours, batch, ce_loss, micro_batch_size=2, schedule=schedule)
    whole_batch(ref, batch)
    compare(ref, ours, 1e-9)


@pytest.fixture
def collector_as_it_was():
    """Python's collector enabled, its thresholds and callbacks, put back after the test; gives the thresholds."""
    enabled, thresholds, callbacks = gc.isenabled(), gc.get_threshold(), list(gc.callbacks)
    yield thresholds
    gc.set_threshold(*thresholds)
    gc.callbacks[:] = callbacks
    gc.enable() if enabled else gc.disable()


@pytest.mark.parametrize("fails", [False, True], ids=["step", "failed step"])
@pytest.mark.parametrize("enabled", [True, False], ids=["collector on", "collector off"])
def test_pythons_collector_is_off_while_a_step_runs_and_as_it_was_after(schedule_any, fails, enabled,
                                                                        collector_as_it_was):
    """No collection runs from the step's first forward to its last gradient, even with the collector's thresholds
    at their lowest; after the step, committed or not, the collector is on or off as the caller had it."""
    model, batch = _tiny(), data((6,), 8, torch.float64)
    events = []  # in order: "loss" (a forward's loss), "grad" (a gradient in the backward), "collection"

    def loss_fn(m, b):
        events.append(("loss", gc.isenabled()))
        x = b[0].detach().requires_grad_()  # its gradient, among the backward's last (a parameter's hook is refused
        x.register_hook(lambda g: events.append("grad"))  # under passes and segments)
        b = (x, b[1])
        garbage = [[] for _ in range(50)]  # objects enough for a collection at the lowest thresholds
        for x, y in zip(garbage, garbage[1:]):
            x.append(y)
            y.append(x)
        if fails and len(events) > 4:
            events.append("grad")  # the step's last moment here
            raise RuntimeError("failure in micro-batch 2")
        return ce_loss(m, b)

    gc.enable() if enabled else gc.disable()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(lambda phase, info: events.append("collection") if phase == "start" else None)
    try:
        accumnorm.backward(model, batch, loss_fn, micro_batch_size=2, schedule=schedule_any)
    except RuntimeError as e:
        assert fails and "failure in micro-batch 2" in str(e)
    enabled_after = gc.isenabled()
    gc.set_threshold(*collector_as_it_was)
    first = next(i for i, e in enumerate(events) if isinstance(e, tuple))
    last = max(i for i, e in enumerate(events) if e == "grad")
    assert [e for e in events[first:last] if isinstance(e, tuple)] == [("loss", False)] * sum(
        isinstance(e, tuple) for e in events)
    assert "collection" not in events[first:last]
    assert enabled_after == enabled


@pytest.mark.parametrize("first_to_end", [0, 1])
def test_steps_overlapping_on_two_threads_leave_the_collector_on_once_the_last_ends(first_to_end,
                                                                                  collector_as_it_was):
    """The first step to start turns the collector off, the last to end puts it back, in either order."""
    gc.enable()
    inside, first_ended = threading.Barrier(2, timeout=60), threading.Event()
    during, after_the_first, errors = [], [], []
    models = [_tiny(), _tiny()]
    batches = [data((6,), 8, torch.float64), data((6,), 8, torch.float64)]

    def run(i: int) -> None:
        waited = []

        def loss_fn(m, b):
            if not waited:  # the step's first micro-batch: wait until both steps run
                waited.append(True)
                during.append(gc.isenabled())
                inside.wait()
                if i != first_to_end:
                    first_ended.wait(timeout=60)
            return ce_loss(m, b)

        try:
            accumnorm.backward(models[i], batches[i], loss_fn, micro_batch_size=2, schedule="layerwise")
        except BaseException as e:  # handed to the test's thread
            errors.append(e)
        if i == first_to_end:
            after_the_first.append(gc.isenabled())
            first_ended.set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert during == [False, False] and after_the_first == [False]
    assert gc.isenabled()
