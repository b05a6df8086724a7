"""torch's per-thread state, taken and put back as the micro-batches take turns on one OS thread.

torch keeps grad mode, autocast, saved-tensor hooks, torch-function and dispatch modes, and the CUDA
device and stream per OS thread, as asyncio keeps its running loop. The layerwise schedule runs the K
micro-batches' forwards as coroutines on the caller's thread, each paused at a BatchNorm call while the
others catch up: what one of them has entered (a `no_grad`, an `autocast`, a checkpointed region's
hooks, an `asyncio.run`, a `torch.compile`d forward) must neither leak into the others nor into the step. Nor must the
process-wide flags a forward enters and leaves (`detect_anomaly`, `torch.backends.*.flags`, the
default dtype: `flags`), kept with the modes.
`ThreadState.capture()` takes all of it and `apply()` puts it back, changing only what differs.
Anything else the dispatcher keeps per thread must be as the step found it: `apply` verifies that, and
refuses rather than run on in a state it cannot restore.
"""
from __future__ import annotations

import gc
from asyncio.events import _get_running_loop as _running_loop
from asyncio.events import _set_running_loop
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from types import GeneratorType
from typing import Any, NamedTuple

import torch

from .flags import GETTERS, set_flags

__all__ = ["ThreadState", "Modes", "autocast_cache_off", "close_checkpoints_left_open", "dispatch_modes_below"]

_C = torch._C
_get_eval_frame = _C._dynamo.eval_frame.get_eval_frame_callback
_set_eval_frame = _C._dynamo.eval_frame.set_eval_frame

# What `Modes.current` reads, in order: the thread's modes, then the process's flags (`flags.GETTERS`).
_READS = (_C.is_grad_enabled, _C._is_fwd_grad_enabled,
          partial(torch.is_autocast_enabled, "cpu"), partial(torch.get_autocast_dtype, "cpu"),
          partial(torch.is_autocast_enabled, "cuda"), partial(torch.get_autocast_dtype, "cuda"),
          torch.is_autocast_cache_enabled, _C._is_multithreading_enabled, _C._is_view_replay_enabled, *GETTERS)
_last_modes: list[Any] = [((), None)]  # the values read last, on any thread, and the Modes made of them


class Modes(NamedTuple):
    """The modes a forward runs in: grad mode, forward-AD mode, autocast (device, enabled, dtype), autograd's
    per-thread switches, and the process-wide flags it may enter and leave like them (`flags`: anomaly mode,
    the default dtype, ...).

    NamedTuples rather than dataclasses: a snapshot is taken at every switch, and tuples are built and compared
    in C.
    """

    grad: bool
    fwd_grad: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    autograd: tuple[bool, bool]  # autograd's multithreading and view replay (`torch.autograd.graph`'s contexts)
    flags: tuple[Any, ...]

    @classmethod
    def current(cls) -> Modes:
        """The thread's modes now. Read at every BatchNorm call, where they rarely change: the same values come as
        the same object, which the comparisons of the calls and the swaps pass at identity. One flat read of every
        value, compared with the last in C, is the cheapest way to tell."""
        values = tuple([read() for read in _READS])
        last, modes = _last_modes[0]
        if values == last:
            return modes
        modes = cls(values[0], values[1], (("cpu", *values[2:4]), ("cuda", *values[4:6])), values[6], values[7:9],
                    values[9:])
        _last_modes[0] = (values, modes)
        return modes

    def apply(self, current: Modes) -> None:
        if self.grad != current.grad:
            _C._set_grad_enabled(self.grad)
        if self.fwd_grad != current.fwd_grad:
            _C._set_fwd_grad_enabled(self.fwd_grad)
        for (device, enabled, dtype), now in zip(self.autocast, current.autocast):
            if (device, enabled, dtype) != now:
                torch.set_autocast_enabled(device, enabled)
                torch.set_autocast_dtype(device, dtype)
        if self.autocast_cache != current.autocast_cache:
            torch.set_autocast_cache_enabled(self.autocast_cache)
        if self.autograd != current.autograd:
            _C._set_multithreading_enabled(self.autograd[0])
            _C._set_view_replay_enabled(self.autograd[1])
        if self.flags != current.flags:
            set_flags(self.flags, current.flags)

    def entered(self, current: Modes) -> AbstractContextManager[None]:
        """Run the block in these modes, then go back to `current`, the modes the thread is in now."""
        return _SAME if current == self else _modes_entered(self, current)


_SAME = nullcontext()  # a block already in the modes it wants: a check per BatchNorm call, so no generator


@contextmanager
def _modes_entered(modes: Modes, before: Modes) -> Iterator[None]:
    modes.apply(before)
    try:
        yield
    finally:
        before.apply(modes)


class ThreadState(NamedTuple):
    """A snapshot of the calling thread's torch state (see the module doc)."""

    modes: Modes
    function_modes: tuple[Any, ...]
    function_state: Any  # torch._C._TorchFunctionState
    dispatch_modes: tuple[Any, ...]
    saved_tensor_hooks: tuple[tuple[Any, Any], ...]  # bottom to top
    hooks_disabled: str | None  # the error message of disable_saved_tensors_hooks, None when enabled
    cuda: tuple[int, Any] | None  # current device and stream, once CUDA is initialized
    keys: tuple[int, int]  # the dispatcher's thread-local included and excluded keys, as raw bits
    event_loop: Any  # asyncio's running loop, also kept per thread: a forward may run inside asyncio.run
    # torch.compile's frame-evaluation callback, set per thread while a compiled module's forward runs: a
    # micro-batch paused inside one must not leave it to the step's own code (which it would compile)
    eval_frame: Any

    @classmethod
    def capture(cls, modes: Modes | None = None) -> ThreadState:
        """The thread's state now; `modes`: its modes, when the caller has just read them."""
        cuda = None
        if torch.cuda.is_initialized():
            cuda = (torch.cuda.current_device(), torch.cuda.current_stream())
        function_modes = _C._len_torch_function_stack()
        dispatch_modes = _C._len_torch_dispatch_stack()
        return cls(
            Modes.current() if modes is None else modes,
            tuple(map(_C._get_function_stack_at, range(function_modes))) if function_modes else (),
            _C._get_torch_function_state(),
            tuple(map(_C._get_dispatch_stack_at, range(dispatch_modes))) if dispatch_modes else (),
            saved_tensor_hooks(),
            None if _C._autograd._saved_tensors_hooks_is_enabled()
            else _C._autograd._saved_tensors_hooks_get_disabled_error_message(),
            cuda,
            _keys(),
            _running_loop(),
            _get_eval_frame(),
        )

    def apply(self, current: ThreadState) -> None:
        """Make this the thread's state; `current` is the state the thread is in now (a fresh capture, or one it
        was made to be since).

        An interrupt (Ctrl-C) in the middle does not leave the thread half-switched: the switch is finished, from
        wherever it stopped, before the interrupt goes on.
        """
        if self == current:
            return
        try:
            self._apply(current)
        except BaseException:
            self._apply(ThreadState.capture())
            raise

    def _apply(self, current: ThreadState) -> None:
        self.modes.apply(current.modes)
        if self.function_modes != current.function_modes:
            while _C._len_torch_function_stack():
                _C._pop_torch_function_stack()
            for mode in self.function_modes:
                _C._push_on_torch_function_stack(mode)
        if self.function_state != current.function_state:
            _C._set_torch_function_state(self.function_state)
        if self.dispatch_modes != current.dispatch_modes:
            while _C._len_torch_dispatch_stack():
                _C._pop_torch_dispatch_stack(None)
            for mode in self.dispatch_modes:
                _C._push_on_torch_dispatch_stack(mode)
        if self.saved_tensor_hooks != current.saved_tensor_hooks:
            for _ in current.saved_tensor_hooks:
                _C._autograd._pop_saved_tensors_default_hooks()
            for pack, unpack in self.saved_tensor_hooks:
                _C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        if self.hooks_disabled != current.hooks_disabled:
            if self.hooks_disabled is None:
                _C._autograd._saved_tensors_hooks_enable()
            else:
                _C._autograd._saved_tensors_hooks_disable(self.hooks_disabled)
        if self.cuda is not None and self.cuda != current.cuda:
            torch.cuda.set_device(self.cuda[0])
            torch.cuda.set_stream(self.cuda[1])
        if self.event_loop is not current.event_loop:
            _set_running_loop(self.event_loop)
        if self.eval_frame is not current.eval_frame:
            _set_eval_frame(self.eval_frame)
        if _keys() != self.keys:
            raise RuntimeError(
                "accumnorm cannot switch between micro-batches here: torch's dispatcher state of this thread differs "
                "from the one the step began in, beyond grad mode, autocast and modes (inference mode, a torch.func "
                "transform, or a dispatch-key guard is active at a BatchNorm call)")


@contextmanager
def autocast_cache_off() -> Iterator[None]:
    """No autocast weight cache for the block: for schedules that run forwards without grad and then with grad in
    the caller's autocast region. torch 2.8 caches the low-precision copy of a weight cast under no_grad, and the
    forward with grad then reuses that copy, which has no graph back to the weight: its gradient would be lost."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


@contextmanager
def dispatch_modes_below(depth: int) -> Iterator[None]:
    """The block under the bottom `depth` of the thread's dispatch modes alone, the others off until it ends: for a
    call that gives again, inside a checkpointed region's recomputation, what a call made under those modes alone (a
    met BatchNorm call, made by the driver) in the forward. The modes the recomputation entered above them (selective
    checkpointing's cache, which checks that the recomputation makes the calls its forward made) see neither."""
    above = []
    try:
        while _C._len_torch_dispatch_stack() > depth:
            above.append(_C._pop_torch_dispatch_stack(None))
        yield
    finally:
        for mode in reversed(above):
            _C._push_on_torch_dispatch_stack(mode)


def close_checkpoints_left_open(error: BaseException) -> None:
    """Close each torch checkpoint that `error`, raised inside its function, left open in the frames it went through.

    torch's `checkpoint(use_reentrant=False)` pushes its saved-tensor hooks in a generator that it resumes only once
    the function returns; torch 2.8 leaves it suspended when the function raises, its hooks on the thread's stack,
    and they are popped only when the error is collected: after the step has put the caller's state back, so the
    pop takes one of the caller's hooks (or fails, on an empty stack). Closed here, while the thread is still in the
    failed forward's state, each pops its own, as newer torch does at once.
    """
    left_open, tb = [], error.__traceback__
    while tb is not None:
        # the frame's references, not its f_locals: a dict of those, cached on a running frame, would hold `error`
        left_open += [value for value in gc.get_referents(tb.tb_frame) if _open_checkpoint(value)]
        tb = tb.tb_next
    for generator in reversed(left_open):  # the innermost first, its hooks on top
        try:
            generator.close()
        except Exception:  # noqa: S110 - the step's error is the one raised
            pass


# torch's generator of a non-reentrant checkpoint's forward, by version (2.8, and newer)
_CHECKPOINT_GENERATORS = ("_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl")


def _open_checkpoint(value: object) -> bool:
    return (isinstance(value, GeneratorType) and value.gi_frame is not None
            and value.gi_code.co_name in _CHECKPOINT_GENERATORS
            and value.gi_frame.f_globals.get("__name__") == "torch.utils.checkpoint")


def saved_tensor_hooks() -> tuple[tuple[Any, Any], ...]:
    """The thread's stack of default saved-tensor hooks, bottom to top (torch exposes only its top: the stack is
    read by popping it, and pushed back whatever interrupts the reading)."""
    top = _C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:  # the usual case, read at every switch
        return ()
    popped = []
    try:
        while top is not None:
            _C._autograd._pop_saved_tensors_default_hooks()
            popped.append(top)
            top = _C._autograd._top_saved_tensors_default_hooks(False)
    finally:
        for pack, unpack in reversed(popped):
            _C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    return tuple(reversed(popped))


def _keys() -> tuple[int, int]:
    return _C._dispatch_tls_local_include_set().raw_repr(), _C._dispatch_tls_local_exclude_set().raw_repr()
