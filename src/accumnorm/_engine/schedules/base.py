"""The one interface every schedule has: `Schedule.run(step, store)`.

A schedule runs a step's micro-batches: their forwards (each micro-batch's `step.forward(k)`), the backward
that adds the whole batch's gradient into the fresh `.grad`s, and in exact mode the meeting of the micro-batches
at each BatchNorm call (`step.meeting`, `step.ledger`). It fills `step.losses`. `store` is where it keeps the
tensors saved for the backward, when that is not where they are made: saved-tensor hooks (`memory.store`, or
"auto"'s `memory.budget.Meter`, which also stops a step that would pass its budget), or None.

Each schedule says what "auto" may make of it (`automatic`, `exact`, `metered`, `remeasured`); `registry` lists
them in the order "auto" tries them, and `decide` chooses.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from ..memory.budget import Meter, schedule_label
from ..memory.store import Store
from ..step.step import Step

__all__ = ["Schedule"]


class Schedule(ABC):
    """A way to run a step's micro-batches (module doc)."""

    name: ClassVar[str]
    #: whether it makes BatchNorm exact for any model (not only for one without batch statistics).
    exact: ClassVar[bool] = True
    #: whether "auto" may choose it at all.
    automatic: ClassVar[bool] = True
    #: whether it keeps its saved tensors through `store`, so that "auto" can meter it and stop it at its budget
    #: and start the step over in the next; the one that is not is "auto"'s last resort, with no next (metered
    #: too, where it can refuse a budget below even its need).
    metered: ClassVar[bool] = True
    #: whether what it keeps depends on the last step's measurements, so that "auto" meters it at every step.
    remeasured: ClassVar[bool] = False
    #: whether it back-propagates each micro-batch once, so that a hook on a parameter's gradient sees the whole
    #: batch's gradient in one call, as in whole-batch torch (`intercept.guards.gradient_hooks`).
    backward_once: ClassVar[bool] = True

    def configured(self, **settings: Any) -> Schedule:
        """The schedule with these settings (the table's own instance, without any)."""
        return type(self)(**settings) if settings else self

    @property
    def settings(self) -> dict[str, Any]:
        """Its settings, as `accumnorm.backward`'s keyword arguments (`last_schedule`): empty for none."""
        return {}

    def setting(self) -> str:
        """Its settings, said after what chose it (`last_schedule`'s reason): "" for none."""
        return ""

    def choices(self) -> list[Schedule]:
        """The settings "auto" tries it at, in order, the fastest first: the table's own instance alone by default."""
        return [self]

    @property
    def label(self) -> str:
        """Its name with its settings, `segments(keep_every=2)`: what "auto"'s reasons name, and what an earlier
        step's figure for it is kept under."""
        return schedule_label(self.name, self.settings)

    @abstractmethod
    def run(self, step: Step, store: Store | Meter | None) -> None:
        """Run `step` (module doc)."""
