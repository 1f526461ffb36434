"""What a rewrite of a call carries: an allow-list per record it rebuilds, checked field by field.

Several places run a call as another call: the query heads of a one-query call folded into rows
(``rows.py``), a decode step's key ranges (:mod:`flashattn_teach.serving.ranges`), a ring's blocks
(:mod:`flashattn_teach.distributed`), a call handed to a compiled op and rebuilt there
(:mod:`flashattn_teach.ops`). Each names the fields of the records it rebuilds that it carries, each with
the condition under which it carries that field exactly; :func:`uncarried` lists the fields that are on
no list or whose condition fails, and the rewrite then declines (the call runs as it is) or refuses by
name. A field added to a record later is on no list, so every rewrite declines it until someone writes
down how it is carried: an option cannot be dropped silently. ``tests/dispatch/test_rewrites_carry_options.py``
holds every list against the records' ``dataclasses.fields``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

import torch

Condition = Callable[[Any], bool]  # of the whole record: True where the rewrite carries the field exactly
Carries = Mapping[str, Condition]


def always(_: Any) -> bool:
    """The field is carried whatever its value (copied, or rebuilt from it)."""
    return True


def unset(name: str) -> Condition:
    """The field is carried only while it is None (the rewrite has no way to carry a value)."""
    return lambda record: getattr(record, name) is None


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(record: Any) -> tuple[str, ...]:
    """The field names of the dataclass instance ``record``, read once per class (a call asks on every step).
    While compiling the cache is not read or written: a cache that fills between two traced calls would make
    torch.compile guard on it and compile again (and ``fields`` is traced on an instance, not a class)."""
    if torch.compiler.is_compiling():
        return tuple(f.name for f in fields(record))
    names = _FIELD_NAMES.get(type(record))
    if names is None:
        names = _FIELD_NAMES[type(record)] = tuple(f.name for f in fields(record))
    return names


def uncarried(record: Any, carries: Carries) -> list[str]:
    """The fields of the dataclass ``record`` that ``carries`` does not carry with their values: those it
    does not name, and those whose condition fails. A condition shared by several fields is evaluated once."""
    held: dict[int, bool] = {}
    names = []
    for name in _field_names(record):
        condition = carries.get(name)
        if condition is always:
            continue
        if condition is not None and id(condition) not in held:
            held[id(condition)] = bool(condition(record))
        if condition is None or not held[id(condition)]:
            names.append(name)
    return names
