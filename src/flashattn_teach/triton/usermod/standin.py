"""The tracer's stand-ins for the tensors a user function receives, and where its operations come from.

A stand-in (:class:`Traced`) is not a tensor: it implements ``__torch_function__`` and the Python operators,
so every torch function, tensor method and operator the user's code applies to it, and every lookup
``cap[idx, ...]`` into a captured tensor with stand-in indices, reaches :meth:`.trace.Tracer.apply`, which
records it. Python control flow on a stand-in (``if``, ``and``, ``or``, ``int()``) raises
:class:`UnsupportedUserFunction`, since its outcome would differ element by element. :func:`user_site`
names the user's ``file:line`` being traced, for every error.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any, Protocol

import torch

from flashattn_teach.errors import AttentionValueError

from .graph import Node


class Tracer(Protocol):
    """What the stand-ins call on the tracer (:class:`.trace.Tracer` is the one implementation; this module
    does not import it, so the two never import each other)."""

    def apply(self, func: Any, display: str, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any: ...

    def unsupported(self, what: str, hint: str = "") -> UnsupportedUserFunction: ...

    def gather(self, slot: int, done: tuple[Node, ...], index: Any) -> Any: ...


# frames in these folders are the tracer's or torch's, not the user's (the separator keeps torchvision out)
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

KIND_DTYPE = {"f": torch.float32, "i": torch.int64, "b": torch.bool}  # what torch's eager call would hold


class UnsupportedUserFunction(AttentionValueError):
    """A ``score_mod`` / ``mask_mod`` uses something the Triton translator cannot express; the message names
    the operation and the user's ``file:line``. Such a call runs on the CPU reference."""


def user_site(frame: FrameType | None = None) -> str:
    """``file:line`` of the innermost frame outside this package and torch: the user's line being traced."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(PACKAGE_DIR) or path.startswith(TORCH_DIR)):
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>:0"


def op_name(func: Any) -> str:
    """A reader's name for a torch callable: ``torch.softmax``, ``Tensor.softmax``, ``torch.nn.functional.relu``."""
    name = getattr(func, "__name__", repr(func))
    if getattr(func, "__objclass__", None) is not None or getattr(torch.Tensor, name, None) is func:
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or "torch"
    module = "torch" if module.startswith("torch._C") else module
    return f"{module}.{name}"


class Traced:
    """The tracer's stand-in for a tensor in the user's function: one graph node."""

    __slots__ = ("node", "tracer")

    def __init__(self, tracer: Tracer, node: Node) -> None:
        self.tracer = tracer
        self.node = node

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        tracer = next(a.tracer for a in flat_args(args, kwargs) if isinstance(a, (Traced, PartialGather)))
        return tracer.apply(func, op_name(func), getattr(func, "__name__", ""), list(args), dict(kwargs or {}))

    # --- Python's operators, each the torch function it stands for --------------------------------------
    def _op(self, name: str, *args: Any) -> Any:
        return self.tracer.apply(None, f"Tensor.{name}", name, [self, *args], {})

    def __add__(self, o: Any) -> Any: return self._op("__add__", o)  # fmt: skip

    def __radd__(self, o: Any) -> Any: return self._op("__radd__", o)  # fmt: skip

    def __sub__(self, o: Any) -> Any: return self._op("__sub__", o)  # fmt: skip

    def __rsub__(self, o: Any) -> Any: return self._op("__rsub__", o)  # fmt: skip

    def __mul__(self, o: Any) -> Any: return self._op("__mul__", o)  # fmt: skip

    def __rmul__(self, o: Any) -> Any: return self._op("__rmul__", o)  # fmt: skip

    def __truediv__(self, o: Any) -> Any: return self._op("__truediv__", o)  # fmt: skip

    def __rtruediv__(self, o: Any) -> Any: return self._op("__rtruediv__", o)  # fmt: skip

    def __floordiv__(self, o: Any) -> Any: return self._op("__floordiv__", o)  # fmt: skip

    def __rfloordiv__(self, o: Any) -> Any: return self._op("__rfloordiv__", o)  # fmt: skip

    def __mod__(self, o: Any) -> Any: return self._op("__mod__", o)  # fmt: skip

    def __rmod__(self, o: Any) -> Any: return self._op("__rmod__", o)  # fmt: skip

    def __pow__(self, o: Any) -> Any: return self._op("__pow__", o)  # fmt: skip

    def __rpow__(self, o: Any) -> Any: return self._op("__rpow__", o)  # fmt: skip

    def __and__(self, o: Any) -> Any: return self._op("__and__", o)  # fmt: skip

    def __rand__(self, o: Any) -> Any: return self._op("__rand__", o)  # fmt: skip

    def __or__(self, o: Any) -> Any: return self._op("__or__", o)  # fmt: skip

    def __ror__(self, o: Any) -> Any: return self._op("__ror__", o)  # fmt: skip

    def __xor__(self, o: Any) -> Any: return self._op("__xor__", o)  # fmt: skip

    def __rxor__(self, o: Any) -> Any: return self._op("__rxor__", o)  # fmt: skip

    def __lt__(self, o: Any) -> Any: return self._op("__lt__", o)  # fmt: skip

    def __le__(self, o: Any) -> Any: return self._op("__le__", o)  # fmt: skip

    def __gt__(self, o: Any) -> Any: return self._op("__gt__", o)  # fmt: skip

    def __ge__(self, o: Any) -> Any: return self._op("__ge__", o)  # fmt: skip

    def __eq__(self, o: Any) -> Any: return self._op("__eq__", o)  # type: ignore[override]  # fmt: skip

    def __ne__(self, o: Any) -> Any: return self._op("__ne__", o)  # type: ignore[override]  # fmt: skip

    def __neg__(self) -> Any: return self._op("__neg__")  # fmt: skip

    def __pos__(self) -> Any: return self  # fmt: skip

    def __abs__(self) -> Any: return self._op("__abs__")  # fmt: skip

    def __invert__(self) -> Any: return self._op("__invert__")  # fmt: skip

    def __getitem__(self, index: Any) -> Any: return self._op("__getitem__", index)  # fmt: skip

    __hash__ = object.__hash__

    # --- Python control flow on a value that differs element by element ----------------------------------
    def _control_flow(self, what: str) -> UnsupportedUserFunction:
        return self.tracer.unsupported(
            f"uses a tensor in Python control flow ({what})",
            hint="the value differs element by element; write torch.where(cond, a, b) or & | ~ instead",
        )

    def __bool__(self) -> bool:
        raise self._control_flow("`if`, `and`, `or`, `not` or bool()")

    def __int__(self) -> int:
        raise self._control_flow("int()")

    def __float__(self) -> float:
        raise self._control_flow("float() or a math.* function")

    def __index__(self) -> int:
        raise self._control_flow("a Python index or range()")

    def __len__(self) -> int:
        raise self._control_flow("len()")

    def __iter__(self) -> Any:
        raise self._control_flow("iteration")

    # --- attributes: the few a pointwise function reads, and the tensor methods ---------------------------
    @property
    def dtype(self) -> torch.dtype:
        return KIND_DTYPE[self.node.kind]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # never used: the generated code runs where the kernel runs

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        method = getattr(torch.Tensor, name, None)
        if method is None:
            raise AttributeError(name)
        if not callable(method):  # .shape, .ndim, .T, ...: the tile's shape differs from path to path
            raise self.tracer.unsupported(f"reads Tensor.{name}", hint="write the function elementwise")
        return lambda *args, **kwargs: self.tracer.apply(method, f"Tensor.{name}", name, [self, *args], kwargs)


class PartialGather:
    """``cap[i0]`` of a captured tensor with more dimensions: only further indexing may follow."""

    __slots__ = ("indices", "slot", "tracer")

    def __init__(self, tracer: Tracer, slot: int, indices: tuple[Node, ...]) -> None:
        self.tracer = tracer
        self.slot = slot
        self.indices = indices

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        tracer = next(a.tracer for a in flat_args(args, kwargs) if isinstance(a, (Traced, PartialGather)))
        raise tracer.unsupported(
            f"uses {op_name(func)} on part of a captured tensor", hint="index every dimension: cap[i, j]"
        )

    def __getitem__(self, index: Any) -> Any:
        return self.tracer.gather(self.slot, self.indices, index)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise self.tracer.unsupported(f"uses .{name} of part of a captured tensor", hint="index every dimension")


def flat_args(args: Sequence[Any], kwargs: Any) -> list[Any]:
    """Arguments with tuples and lists (of indices, of clamp bounds) opened one level."""
    out: list[Any] = []
    for a in [*args, *(kwargs or {}).values()]:
        if isinstance(a, (tuple, list)):
            out.extend(a)
        else:
            out.append(a)
    return out
