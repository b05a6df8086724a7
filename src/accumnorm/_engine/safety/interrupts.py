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
still waits for a safe point is handled at once wherever it lands. A deferred SIGINT is also sent again every
quarter second until a safe point takes it: one that landed in a callback the interpreter ran between two lines
of the user's (a weakref callback during a collection) and was deferred there, right before the user's code
blocks, then reaches the wait, where it is handled at once. A SIGINT sent again after a safe point took it (the
timer looked in the instant before) is that one, already raised: it is dropped, and the step waits for the timer
before it gives SIGINT back, so that nothing sent again arrives after the step.

The previous handler comes back when the step ends; a Python handler of the caller's is the one called.
Off the main thread (where no KeyboardInterrupt arrives) and with SIGINT ignored, nothing is changed.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from . import untraced

__all__ = ["SigintDeferred"]


_RESEND_S = 0.25  # how soon a deferred SIGINT is sent again, while no safe point has taken it

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
        # The deferred SIGINT the timer sent again (`_resend`): the SIGINT arriving next is that one
        self.resent_for: tuple[int, FrameType | None] | None = None
        self.timer: threading.Timer | None = None
        self.closing = False  # `close` runs: a SIGINT is only recorded, and raised at its end

    def start(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):  # SIG_IGN / SIG_DFL: nothing is raised in Python, nothing to defer
            # Kept before the handler is set: a SIGINT landing right after (still inside `signal.signal`) calls it,
            # and `close` puts it back whatever stopped `start`.
            self.previous = handler
            signal.signal(signal.SIGINT, untraced.wrap(self._record))

    def _record(self, signum: int, frame: FrameType | None) -> None:
        resent_for, self.resent_for = self.resent_for, None
        if resent_for is not None and resent_for is not self.pending:
            return  # a safe point took the deferred SIGINT while the timer sent it again: it was raised there
        if self.closing or ((self.pending is None or resent_for is not None) and _in_torch(frame)):
            self.pending = (signum, frame)
            if not self.closing:
                self._send_again_soon()
            return
        self.pending = None
        self.previous(signum, frame)

    def _send_again_soon(self) -> None:
        self.timer = threading.Timer(_RESEND_S, self._resend)
        self.timer.daemon = True
        self.timer.start()

    def _resend(self) -> None:
        """On the timer's thread: the deferred SIGINT to the main thread again, if no safe point took it yet."""
        pending = self.pending
        if pending is not None and self.previous is not None:
            self.resent_for = pending
            if hasattr(signal, "pthread_kill"):  # to the main thread itself, so that a wait there is interrupted
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            else:
                signal.raise_signal(signal.SIGINT)

    def check(self) -> None:
        """A safe point: a SIGINT that arrived since the last one is handled now, by the previous handler."""
        if self.pending is not None:
            signum, frame = self.pending
            self.pending = None
            self.previous(signum, frame)

    def close(self) -> None:
        """Give SIGINT back to the previous handler, then handle one that arrived meanwhile.

        Until the handler is given back a SIGINT is only recorded, so that nothing raised stops the giving back: the
        timer is stopped and waited for (what it sent arrives now, not after the step), and `signal.signal` runs a
        SIGINT the process still holds before it sets the handler."""
        if self.previous is None:
            return
        self.closing = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer.join()
            self.timer = None
        signal.signal(signal.SIGINT, self.previous)
        try:
            self.check()
        finally:
            self.previous = None
