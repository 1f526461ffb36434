"""Which integers of a traced function the generated code computes in int64, so that they equal torch's.

torch evaluates a user function on int64 ``b, h, q_idx, kv_idx`` (the CPU paths do too); the kernels pass
them as int32. Computing everything in int64 would be exact but doubles the cost of every index comparison
in the inner loop, so each integer node gets what torch would hold and a bound on its value:

    dtype     torch's dtype of the node: ``int64`` for the inputs and arithmetic on them, a capture's dtype
              for a lookup, the target of a cast; ``None`` for a Python number or a bool counted as 0 / 1,
              which take the other operand's dtype (torch's type promotion of scalars)
    interval  [lo, hi] holding the value: inputs are in [0, 2^31 - 1] (int32 positions), arithmetic
              follows interval rules, a result that may wrap in its dtype spans the dtype's range
    wide      computed in int64: torch's dtype is int64 and the value or an operand may leave int32

A node that is wide casts its int32 operands to int64 first; so ``(q_idx + 1) * 2**16 * (kv_idx + 1) * 2**16``
is an int64 product, as in torch, while ``q_idx >= kv_idx`` or ``(q_idx - kv_idx) % 2`` stay int32. A Python
number enters an operation wrapped to the operation's dtype, as torch converts it (``int32_tensor * 2**32``
is ``int32_tensor * 0``); one outside ``[-2^63, 2^64)`` is refused, since torch raises for it, and so is one
outside the dtype in ``torch.where`` or ``clamp`` (torch raises, or treats it in its own way). An int8, int16
or uint8 result wraps to its width as torch's does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .graph import Graph, Node
from .standin import UnsupportedUserFunction

#: the range of each integer dtype the tracer produces
RANGES = {
    "int64": (-(2**63), 2**63 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int8": (-(2**7), 2**7 - 1),
    "uint8": (0, 2**8 - 1),
}
_ORDER = ("uint8", "int8", "int16", "int32", "int64")  # torch.promote_types for these: the later one
_POSITION = (0, 2**31 - 1)  # b, h, q_idx, kv_idx inside the kernels (int32)
# operations whose integer result is computed from integer operands (the others: inputs, constants,
# lookups, casts, detach)
_ARITHMETIC = {"add", "sub", "mul", "floordiv", "mod", "maximum", "minimum", "clamp", "where", "and", "or", "xor",
               "neg", "abs", "relu", "sign", "not", "pow"}  # fmt: skip
_COMPARISONS = {"lt", "le", "gt", "ge", "eq", "ne"}


@dataclass(frozen=True)
class IntegerNode:
    """What the emitter needs about one integer node (or one operation on integers): see the module."""

    dtype: str | None
    interval: tuple[int, int]
    wide: bool
    wraps_to: str | None = None  # int8, int16 or uint8: the int32 result is wrapped to it, as torch's is


def _within(interval: tuple[int, int], dtype: str) -> bool:
    lo, hi = RANGES[dtype]
    return lo <= interval[0] and interval[1] <= hi


def wrap(value: int, dtype: str) -> int:
    """``value`` converted to ``dtype`` as torch converts a Python number: modulo 2^bits."""
    lo, hi = RANGES[dtype]
    return (value - lo) % (hi - lo + 1) + lo


def _promote(dtypes: list[str | None]) -> str:
    known = [d for d in dtypes if d is not None]
    return max(known, key=_ORDER.index) if known else "int64"


def _interval(op: str, xs: list[tuple[int, int]], params: tuple[Any, ...]) -> tuple[int, int]:
    """The exact bound of ``op`` on operands in the intervals ``xs`` (no wrapping)."""
    if op in ("add", "sub", "mul"):
        (a, b), (c, d) = xs
        if op == "add":
            return a + c, b + d
        if op == "sub":
            return a - d, b - c
        corners = (a * c, a * d, b * c, b * d)
        return min(corners), max(corners)
    if op in ("floordiv", "mod"):
        (a, b), (c, d) = xs
        if op == "floordiv" or c <= 0 <= d:  # |x // y| <= |x|; |x % y| < |y|
            m = max(abs(a), abs(b)) if op == "floordiv" else max(abs(c), abs(d))
            return -m, m
        if c > 0:
            return 0, (min(b, d - 1) if a >= 0 else d - 1)
        return c + 1, 0
    if op in ("maximum", "minimum"):
        pick = max if op == "maximum" else min
        return pick(x[0] for x in xs), pick(x[1] for x in xs)
    if op == "clamp":  # min(max(x, lo), hi); params say which bounds are given (absent ones are left out)
        out, *bounds = xs
        if params[0]:
            out = _interval("maximum", [out, bounds[0]], ())
        if params[1]:
            out = _interval("minimum", [out, bounds[-1]], ())
        return out
    if op == "where":
        return min(xs[0][0], xs[1][0]), max(xs[0][1], xs[1][1])
    if op in ("and", "or", "xor"):
        (a, b), (c, d) = xs
        if min(a, c) >= 0:  # bits of non-negative numbers: no more than the wider one has
            return 0, (min(b, d) if op == "and" else 2 ** max(b, d).bit_length() - 1)
        return RANGES["int64"] if not all(_within(x, "int32") for x in xs) else RANGES["int32"]
    (a, b) = xs[0]
    if op == "neg":
        return -b, -a
    if op == "abs":
        return (0 if a <= 0 <= b else min(abs(a), abs(b))), max(abs(a), abs(b))
    if op == "relu":
        return max(a, 0), max(b, 0)
    if op == "sign":
        return -1, 1
    if op == "not":  # ~x = -x - 1
        return -b - 1, -a - 1
    assert op == "pow"
    k = int(params[0])
    corners = (a**k, b**k, *((0,) if a <= 0 <= b else ()))
    return min(corners), max(corners)


class Integers:
    """The :class:`IntegerNode` of every integer node of ``graph``, and of every operation on integers
    (comparisons included), computed for the nodes it holds when asked."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.nodes: dict[int, IntegerNode] = {}

    def __getitem__(self, node: Node) -> IntegerNode:
        for n in self.graph.nodes[len(self.nodes) : node.index + 1]:  # topological: operands come first
            self.nodes[n.index] = self._classify(n)
        return self.nodes[node.index]

    def on_integers(self, n: Node) -> bool:
        """Is ``n`` an operation on integers (its integer constants are wrapped to its dtype)?"""
        return (n.kind == "i" and n.op in _ARITHMETIC) or (n.op in _COMPARISONS and n.args[0].kind == "i")

    def operation_dtype(self, n: Node) -> str:
        """The dtype torch computes ``n`` in from its integer operands (Python numbers take the others')."""
        return _promote([self.nodes[x.index].dtype for x in self._int_operands(n)])

    def constant(self, n: Node, x: Node) -> int:
        """The constant operand ``x`` of ``n`` as the operation sees it: wrapped to its dtype."""
        return wrap(int(x.value), self.operation_dtype(n))

    def _int_operands(self, n: Node) -> list[Node]:
        args = n.args[1:] if n.op == "where" else n.args
        return [x for x in args if x.kind == "i" and not x.is_none]

    def _classify(self, n: Node) -> IntegerNode:
        if n.op == "input":
            return IntegerNode("int64", _POSITION, False)
        if n.op == "const":
            if n.kind != "i":
                return IntegerNode(None, (int(n.value or 0),) * 2, False) if n.kind == "b" else _NOT_INTEGER
            if not -(2**63) <= n.value < 2**64:
                raise UnsupportedUserFunction(
                    f"{self.graph.kind} uses the integer {n.value} ({n.site}), which torch cannot convert to int64 "
                    "(it raises OverflowError) and the Triton translator does not support; the call runs on the "
                    "CPU reference"
                )
            return IntegerNode(None, (n.value, n.value), False)
        if n.op == "gather" and n.kind == "i":
            dtype = self.graph.layouts[n.params[0]].dtype
            return IntegerNode(dtype, RANGES[dtype], dtype == "int64")
        if n.op == "cast" and n.kind == "i":
            return self._cast(n)
        if n.op == "detach" and n.kind == "i":
            return self.nodes[n.args[0].index]
        if self.on_integers(n):
            return self._operation(n)
        return _NOT_INTEGER

    def _cast(self, n: Node) -> IntegerNode:
        target, x = n.params[0], n.args[0]
        if x.kind == "b" and target == "int32":  # a bool counted as 0 / 1: takes the other operand's dtype
            return IntegerNode(None, (0, 1), False)
        interval = self.nodes[x.index].interval if x.kind != "f" else RANGES[target]
        interval = interval if _within(interval, target) else RANGES[target]
        return IntegerNode(target, interval, target == "int64")

    def _operation(self, n: Node) -> IntegerNode:
        dtype = self.operation_dtype(n)
        operands = self._int_operands(n)
        intervals = []
        for x in operands:
            if x.op == "const":
                value = wrap(x.value, dtype)
                if n.op in ("where", "clamp") and value != x.value:  # torch raises, or converts in its own way
                    raise UnsupportedUserFunction(
                        f"{self.graph.kind} passes {x.value} to torch.{n.op} with a {dtype} tensor ({n.site}), a "
                        f"number outside {dtype}, which the Triton translator does not support; the call runs on "
                        "the CPU reference"
                    )
                intervals.append((value, value))
            else:
                intervals.append(self.nodes[x.index].interval)
        pairs = zip(operands, intervals, strict=True)
        wide_operand = any(self.nodes[x.index].wide or not _within(i, "int32") for x, i in pairs)
        if n.op in _COMPARISONS:
            return IntegerNode(None, (0, 1), dtype == "int64" and wide_operand)
        params = tuple(not b.is_none for b in n.args[1:]) if n.op == "clamp" else n.params
        exact = _interval(n.op, intervals, params)
        fits = _within(exact, dtype)
        wide = dtype == "int64" and (wide_operand or not _within(exact, "int32"))
        narrow = dtype in ("int8", "int16", "uint8") and not fits
        return IntegerNode(dtype, exact if fits else RANGES[dtype], wide, dtype if narrow else None)


_NOT_INTEGER = IntegerNode(None, (0, 0), False)
