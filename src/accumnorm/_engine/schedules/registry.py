"""The one table of schedules: plain accumulation, then the exact ones in the order "auto" tries them, the fastest
first, the leanest last (each at its `choices()` of settings).

Adding a schedule is one module with a `Schedule` subclass and one entry here.
"""
from __future__ import annotations

from .base import Schedule
from .layerwise import Layerwise
from .passes import Passes
from .plain import Plain
from .recompute import Recompute
from .segments import Segments

__all__ = ["SCHEDULES"]

SCHEDULES: dict[str, Schedule] = {s.name: s for s in (Plain(), Layerwise(), Recompute(), Segments(), Passes())}
