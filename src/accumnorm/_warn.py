"""Warnings that point at the user's line: the first frame outside accumnorm, however deep inside it they are made.

A fixed `stacklevel` is right for one call path only; the same warning is reached from `accumnorm.backward`,
the Trainer and the integrations, at different depths. (Python 3.12's `skip_file_prefixes` does this for one
package; this works on 3.10 too.)
"""
from __future__ import annotations

import sys
import warnings

__all__ = ["warn_at_caller"]


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """`warnings.warn(message, category)`, attributed to the line outside accumnorm that led here."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "accumnorm":
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
