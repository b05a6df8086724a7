"""`memory.objects.object_bytes`, what "auto"'s meter counts of a region call's record beside its tensors: each
object once, records opened, everything else counted as the one object it is (never the model behind it)."""
from __future__ import annotations

import functools
import sys
import weakref

import torch
import torch.nn as nn

from accumnorm._engine.memory.objects import object_bytes


class Record:
    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a, b) -> None:
        self.a, self.b = a, b


def test_an_object_two_containers_hold_is_counted_once():
    shared = [1.5, 2.5]
    outer = [shared, (shared,)]
    expected = sum(sys.getsizeof(o) for o in (outer, outer[1], shared, 1.5, 2.5))
    assert object_bytes(outer, ()) == expected


def test_a_module_a_tensor_and_an_unlisted_object_count_as_themselves_alone():
    """A walk from a record must not reach the model: a module is one object; so is a tensor (its storage is the
    meter's business), and an object of a type not listed as a record."""
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    t = torch.zeros(10**6)
    other = Record(payload=list(range(1000)))
    root = [model, t, other]
    expected = sum(sys.getsizeof(o) for o in root) + sys.getsizeof(root)
    assert object_bytes(root, ()) == expected
    assert object_bytes(t, ()) < 1000  # not the 4 MB it names


def test_records_dicts_slots_closures_and_callbacks_are_opened():
    payload = list(range(100))
    closure_held = [0.25] * 50

    def made_for_the_record():
        return closure_held

    target = Record()
    ref = weakref.ref(target, functools.partial(print, payload))
    record = Record(payload=payload, fn=made_for_the_record, ref=ref, slotted=Slotted(closure_held, None))
    alone = object_bytes(record, ())
    opened = object_bytes(record, (Record, Slotted))
    assert alone == sys.getsizeof(record)
    expected_inside = sys.getsizeof(vars(record)) + sys.getsizeof(payload) + sys.getsizeof(closure_held)
    assert opened > alone + expected_inside, (opened, alone, expected_inside)
    without_closure = object_bytes(Record(payload=payload, fn=made_for_the_record), (Record,))
    without_list = object_bytes(Record(payload=payload, fn=lambda: None), (Record,))
    assert without_closure - without_list >= sys.getsizeof(closure_held)
