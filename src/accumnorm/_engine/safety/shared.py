"""A process-wide setting that steps change while they run, on any thread: `WhileStepsRun`.

Some of what a step needs is process-wide rather than per thread (the recursion limit, a module attribute that
dynamo reads). Steps on several threads may overlap: the first to start changes the setting, the last to end puts
back what the first found, whatever order they end in.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["WhileStepsRun"]


class WhileStepsRun:
    """`get()` and `set(value)` a setting; while steps run, it is `during(value before)` (module doc)."""

    def __init__(self, get: Callable[[], Any], set: Callable[[Any], None],  # noqa: A002 - the pair's names
                 during: Callable[[Any], Any]) -> None:
        self._get, self._set, self._during = get, set, during
        self._lock = threading.Lock()
        self._steps = 0  # running now, on any thread
        self.before: Any = None  # the setting as the first of them found it (kept after they end)

    @contextmanager
    def held(self) -> Iterator[None]:
        """The setting changed for the block, unless another step holds it changed already."""
        with self._lock:
            if self._steps == 0:
                self.before = self._get()
                self._set(self._during(self.before))
            self._steps += 1
        try:
            yield
        finally:
            with self._lock:
                self._steps -= 1
                if self._steps == 0:
                    self._set(self.before)
