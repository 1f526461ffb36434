"""An op's schema from its argument record: the record's fields, in order, are the op's arguments after
its tensors, so the names and types are written once (the record) and read by the op, its fake, its
backward and the public function that calls it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# torch.library's schema type for each field annotation the records use (``from __future__ import
# annotations`` keeps them as strings).
_TYPES = {
    "Tensor": "Tensor",
    "Tensor | None": "Tensor?",
    "bool": "bool",
    "str": "str",
    "float": "float",
    "float | None": "float?",
    "int": "SymInt",
    "list[int] | None": "SymInt[]?",
    "torch.dtype | None": "ScalarType?",
}


def _default(value: object) -> str:
    return "None" if value is None else repr(value)


def op_schema(record: type, leading: str, returns: str) -> str:
    """``(<leading>, <the record's fields>) -> <returns>``, e.g. ``leading = "Tensor q, Tensor k, Tensor v"``."""
    args = [leading]
    for f in dataclasses.fields(record):
        arg = f"{_TYPES[str(f.type)]} {f.name}"
        if f.default is not dataclasses.MISSING:
            arg += f"={_default(f.default)}"
        args.append(arg)
    return f"({', '.join(args)}) -> {returns}"


def op_args(record: Any) -> tuple[Any, ...]:
    """The record's fields, in the op's order."""
    return tuple(getattr(record, f.name) for f in dataclasses.fields(record))


def unused(record: type) -> tuple[None, ...]:
    """No gradient for any field of the record (masks, lengths, options, seeds)."""
    return (None,) * len(dataclasses.fields(record))
