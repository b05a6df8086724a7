"""Ctrl-C during a step, taken where the step can undo everything: at its own safe points.

Python raises KeyboardInterrupt at whatever bytecode the main thread is running when SIGINT arrives,
and torch's Python-level mode handling (`handle_torch_function`'s `_pop_mode_temporarily`, a generator)
is not safe against that: an interrupt in the wrong few bytecodes leaves a mode off or on the
thread's stack, or pushes it back later, when the interrupted generator is collected. So while a step
runs on the main thread, `SigintDeferred` records a SIGINT instead of raising it, and the step checks
at its safe points (between micro-batches, at every BatchNorm meeting, before it commits), where the
previous handler is called: the KeyboardInterrupt is raised there, and the step rolls back.

Code that waits (a `threading.Event().wait()`, a stalled pipe, a queue) reaches no safe point, so a SIGINT
is not deferred where that danger is not: when the code it interrupts is neither torch's nor accumnorm's
(the user's, or the standard library's waits), it is handled at once; and a second SIGINT while the first
still waits for a safe point is handled at once wherever it lands.

The previous handler comes back when the step ends; a Python handler of the caller's is the one called.
Off the main thread (where no KeyboardInterrupt arrives) and with SIGINT ignored, nothing is changed.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["SigintDeferred"]


# The packages whose code a SIGINT waits for; weakref's callbacks among them, which the interpreter runs as torch's
# tensors and graphs are freed, and where it would print an exception raised in them and go on without it.
_DEFERRED_IN = ("torch", "accumnorm", "contextlib", "greenlet", "weakref", "_weakrefset")


def _in_torch(frame: FrameType | None) -> bool:
    """Whether the interrupted code is torch's or accumnorm's (or a context manager's or coroutine's machinery)."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name.partition(".")[0] in _DEFERRED_IN


class SigintDeferred:
    """Defer SIGINT from `start()` to `close()`, raising it at each `check()` (module doc)."""

    def __init__(self) -> None:
        self.previous: Any = None
        self.pending: tuple[int, FrameType | None] | None = None

    def start(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):  # SIG_IGN / SIG_DFL: nothing is raised in Python, nothing to defer
            self.previous = signal.signal(signal.SIGINT, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.pending is None and _in_torch(frame):
            self.pending = (signum, frame)
            return
        self.pending = None
        self.previous(signum, frame)

    def check(self) -> None:
        """A safe point: a SIGINT that arrived since the last one is handled now, by the previous handler."""
        if self.pending is not None:
            signum, frame = self.pending
            self.pending = None
            self.previous(signum, frame)

    def close(self) -> None:
        """Give SIGINT back to the previous handler, then handle one that arrived meanwhile."""
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.check()
            self.previous = None
