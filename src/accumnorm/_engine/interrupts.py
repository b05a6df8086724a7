"""Ctrl-C during a step, taken where the step can undo everything: at its own safe points.

Python raises KeyboardInterrupt at whatever bytecode the main thread is running when SIGINT arrives,
and torch's Python-level mode handling (`handle_torch_function`'s `_pop_mode_temporarily`, a generator)
is not safe against that: an interrupt in the wrong few bytecodes leaves a mode off or on the
thread's stack, or pushes it back later, when the interrupted generator is collected. So while a step
runs on the main thread, `SigintDeferred` records a SIGINT instead of raising it, and the step checks
at its safe points (between micro-batches, at every BatchNorm meeting, before it commits), where the
previous handler is called: the KeyboardInterrupt is raised there, and the step rolls back.

The previous handler comes back when the step ends; a Python handler of the caller's is the one called.
Off the main thread (where no KeyboardInterrupt arrives) and with SIGINT ignored, nothing is changed.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["SigintDeferred"]


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
        self.pending = (signum, frame)

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
