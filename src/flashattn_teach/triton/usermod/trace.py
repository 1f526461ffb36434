"""Trace a user ``score_mod`` / ``mask_mod`` into a :class:`~.graph.Graph`, without torch.compile.

The function is called once with stand-ins (:class:`~.standin.Traced`) for ``score, b, h, q_idx,
kv_idx``; every operation on them reaches :meth:`Tracer.apply`, which checks it, applies torch's type
promotion and adds a graph node. Functions that call other functions (``and_masks``-style closures) trace
through, since only the operations on stand-ins are recorded. Anything the translator cannot express
raises :class:`~.standin.UnsupportedUserFunction` naming the operation and the user's ``file:line``.
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from flashattn_teach.errors import AttentionValueError

from .graph import INPUTS, CaptureLayout, Graph, Node, promote
from .standin import PACKAGE_DIR, TORCH_DIR, PartialGather, Traced, UnsupportedUserFunction, user_site

#: the most captured tensors one user function may read in the Triton kernels (pointers C0..C3)
MAX_CAPTURES = 4


#: torch dtypes of gathered values and casts -> the kind they are computed in ("f" fp32, "i" int32, "b")
_DTYPE_KIND = {
    torch.float32: "f",
    torch.float64: "f",
    torch.float16: "f",
    torch.bfloat16: "f",
    torch.int64: "i",
    torch.int32: "i",
    torch.int16: "i",
    torch.int8: "i",
    torch.uint8: "i",
    torch.bool: "b",
}


def _function_site(fn: Callable[..., Any]) -> str:
    """``file:line`` where ``fn`` (or the function a ``functools.partial`` wraps) is defined."""
    inner = getattr(fn, "func", fn)
    code = getattr(inner, "__code__", None) or getattr(vars(type(inner)).get("__call__"), "__code__", None)
    if code is None:
        return "<unknown>:0"
    return f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"


# torch names (functions, methods, operators) -> the graph op; reflected operators swap their operands
_BINARY = {
    "add": "add", "__add__": "add", "__radd__": "add",
    "sub": "sub", "subtract": "sub", "__sub__": "sub", "__rsub__": "sub", "rsub": "sub",
    "mul": "mul", "multiply": "mul", "__mul__": "mul", "__rmul__": "mul",
    "div": "truediv", "divide": "truediv", "true_divide": "truediv", "__truediv__": "truediv",
    "__rtruediv__": "truediv", "__div__": "truediv", "__rdiv__": "truediv",
    "floor_divide": "floordiv", "__floordiv__": "floordiv", "__rfloordiv__": "floordiv",
    "remainder": "mod", "__mod__": "mod", "__rmod__": "mod",
    "maximum": "maximum", "max": "maximum", "minimum": "minimum", "min": "minimum",
    "lt": "lt", "less": "lt", "__lt__": "lt", "le": "le", "less_equal": "le", "__le__": "le",
    "gt": "gt", "greater": "gt", "__gt__": "gt", "ge": "ge", "greater_equal": "ge", "__ge__": "ge",
    "eq": "eq", "__eq__": "eq", "ne": "ne", "not_equal": "ne", "__ne__": "ne",
    "logical_and": "and", "bitwise_and": "and", "__and__": "and", "__rand__": "and",
    "logical_or": "or", "bitwise_or": "or", "__or__": "or", "__ror__": "or",
    "logical_xor": "xor", "bitwise_xor": "xor", "__xor__": "xor", "__rxor__": "xor",
}  # fmt: skip
_REFLECTED = {"__radd__", "__rsub__", "rsub", "__rmul__", "__rtruediv__", "__rdiv__", "__rfloordiv__",
              "__rmod__", "__rand__", "__ror__", "__rxor__"}  # fmt: skip
_UNARY_FLOAT = {"exp", "log", "exp2", "log2", "tanh", "sigmoid", "sqrt", "rsqrt", "sin", "cos", "tan", "floor", "ceil"}
_UNARY = {"neg": "neg", "negative": "neg", "__neg__": "neg", "abs": "abs", "absolute": "abs",
          "__abs__": "abs", "logical_not": "not", "bitwise_not": "not", "__invert__": "not", "relu": "relu",
          "sign": "sign",
          **{name: name for name in _UNARY_FLOAT}}  # fmt: skip
_CAST_METHODS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                 "bfloat16": torch.bfloat16, "int": torch.int32, "long": torch.int64, "bool": torch.bool}  # fmt: skip
_FILL = {"zeros_like": 0, "ones_like": 1, "new_zeros": 0, "new_ones": 1}


class Tracer:
    """Records the operations a user function applies to its stand-ins into :attr:`graph`."""

    def __init__(self, fn: Callable[..., Any], captures: Sequence[Tensor], kind: str) -> None:
        self.fn = fn
        self.captures = tuple(captures)
        self.kind = kind
        name = getattr(getattr(fn, "func", fn), "__qualname__", type(fn).__name__)
        self.graph = Graph(kind=kind, name=name, where=_function_site(fn))

    # --- errors --------------------------------------------------------------------------------------
    def unsupported(self, what: str, hint: str = "") -> UnsupportedUserFunction:
        """The error for the operation being traced now: ``<kind> <what> (<file:line>), which ...``."""
        hint = f" ({hint})" if hint else ""
        return UnsupportedUserFunction(
            f"{self.kind} {what} ({user_site(sys._getframe(1))}), which the Triton translator does not "
            f"support{hint}; the call runs on the CPU reference"
        )

    # --- operands ------------------------------------------------------------------------------------
    def node(self, x: Any, what: str = "an operand") -> Node:
        """The graph node of an operand: a stand-in, a Python number, or a 0-dim captured tensor."""
        if isinstance(x, Traced):
            return x.node
        if isinstance(x, (bool, int, float)):
            return self.graph.const(x, user_site())
        if isinstance(x, Tensor):
            if x.dim() != 0:
                raise self.unsupported(
                    f"uses a whole captured tensor of shape {tuple(x.shape)} as {what}",
                    hint="index it with b, h, q_idx, kv_idx: cap[h] or cap[b, q_idx]",
                )
            return self.gather(self.slot(x), (), ()).node
        if isinstance(x, PartialGather):
            raise self.unsupported("uses part of a captured tensor as a value", hint="index every dimension")
        raise self.unsupported(f"uses a {type(x).__name__} as {what}")

    def slot(self, tensor: Tensor) -> int:
        """The pointer slot ``Ck`` of a captured tensor, assigned on its first read."""
        position = next((i for i, c in enumerate(self.captures) if c is tensor), None)
        if position is None:
            raise self.unsupported(
                f"reads a tensor of shape {tuple(tensor.shape)} that is not among its captured tensors",
                hint="write constants as Python numbers, or capture the tensor (closure, default, global)",
            )
        if position not in self.graph.slots:
            if len(self.graph.slots) == MAX_CAPTURES:
                raise self.unsupported(
                    f"reads a {len(self.graph.slots) + 1}th captured tensor",
                    hint=f"the kernels take at most MAX_CAPTURES = {MAX_CAPTURES}; concatenate small tables",
                )
            if tensor.dtype not in _DTYPE_KIND:
                raise self.unsupported(f"reads a captured tensor of dtype {tensor.dtype}")
            self.graph.slots.append(position)
            self.graph.layouts.append(
                CaptureLayout(tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype).removeprefix("torch."))
            )
        return self.graph.slots.index(position)

    def gather(self, slot: int, done: tuple[Node, ...], index: Any) -> Traced | PartialGather:
        """``captures[slot][*done, *index]``: a value once every dimension is indexed."""
        layout = self.graph.layouts[slot]
        index = index if isinstance(index, tuple) else (index,)
        nodes = list(done)
        for i in index:
            if isinstance(i, (Traced, int, Tensor)) and not isinstance(i, bool):  # a 0-dim capture too
                node = self.node(i)
                if node.kind != "i":
                    raise self.unsupported(f"indexes a captured tensor with a {_KIND_NAME[node.kind]} tensor")
                nodes.append(node)
            else:
                raise self.unsupported(
                    f"indexes a captured tensor with {type(i).__name__} {i!r}",
                    hint="index with integer expressions of b, h, q_idx, kv_idx; no slices, None or masks",
                )
        if len(nodes) > len(layout.shape):
            raise self.unsupported(f"indexes a captured tensor of shape {layout.shape} with {len(nodes)} indices")
        if len(nodes) < len(layout.shape):
            return PartialGather(self, slot, tuple(nodes))
        kind = _DTYPE_KIND[getattr(torch, layout.dtype)]
        return Traced(self, self.graph.add("gather", tuple(nodes), (slot,), kind, user_site()))

    # --- operations ----------------------------------------------------------------------------------
    def apply(self, func: Any, display: str, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Record torch callable ``func`` (``display`` names it for errors) applied to ``args``."""
        g, site = self.graph, user_site()
        ignored = ("device", "layout", "pin_memory")  # where a value lives means nothing inside a kernel
        kwargs = {k: v for k, v in kwargs.items() if not (k in ignored or v is None or (k == "inplace" and not v))}
        if name == "__getitem__":
            base, index = args
            if isinstance(base, Tensor):
                return self.gather(self.slot(base), (), index)
            raise self.unsupported("indexes a traced value", hint="only captured tensors may be indexed")
        if name in ("max", "min") and not (len(args) == 2 and isinstance(args[1], (Traced, Tensor))):
            raise self.unsupported(f"uses {display} as a reduction", hint=f"torch.{name}imum(a, b) is elementwise")
        if name in _BINARY and len(args) == 2 and not kwargs.get("rounding_mode"):
            a, b = (args[1], args[0]) if name in _REFLECTED else (args[0], args[1])
            if name in ("sub", "add") and "alpha" in kwargs:
                b = self.apply(None, "Tensor.mul", "mul", [b, kwargs.pop("alpha")], {})
            self._no_kwargs(display, kwargs)
            return self.binary(_BINARY[name], a, b)
        if name in ("div", "divide") and len(args) == 2 and kwargs.get("rounding_mode") == "floor":
            return self.binary("floordiv", args[0], args[1])
        if name in _UNARY and len(args) == 1:
            self._no_kwargs(display, kwargs)
            return self.unary(_UNARY[name], args[0])
        if name in ("square",) and len(args) == 1:
            return self.binary("mul", args[0], args[0])
        if name in ("pow", "__pow__", "float_power") and len(args) == 2:
            return self.power(args[0], args[1])
        if name == "__rpow__" and len(args) == 2:
            return self.power(args[1], args[0])
        if name == "where" and len(args) == 3:
            cond, x, y = (self.node(a) for a in args)
            if cond.kind != "b":
                raise self.unsupported(f"uses torch.where with a {_KIND_NAME[cond.kind]} condition")
            kind = promote(x.kind, y.kind)
            return Traced(self, g.add("where", (cond, self.cast(x, kind), self.cast(y, kind)), (), kind, site))
        if name in ("clamp", "clip", "clamp_min", "clamp_max"):
            return self.clamp(name, args, kwargs)
        if name in ("to", "type") or name in _CAST_METHODS:
            return self.to(display, name, args, kwargs)
        if name in ("full_like", "zeros_like", "ones_like", "new_zeros", "new_ones", "new_full"):
            return self.fill(display, name, args, kwargs)
        if name in ("contiguous", "clone") and len(args) == 1:
            return args[0]
        if name == "detach" and len(args) == 1:
            x = self.node(args[0])
            return Traced(self, g.add("detach", (x,), (), x.kind, site))
        raise self.unsupported(f"uses {display}")

    def _no_kwargs(self, display: str, kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise self.unsupported(f"passes {', '.join(kwargs)}= to {display}")

    def cast(self, x: Node, kind: str) -> Node:
        """``x`` converted to ``kind`` (a no-op when it has it)."""
        if x.kind == kind:
            return x
        if x.op == "const" and x.value is not None:
            return self.graph.const({"b": bool, "i": int, "f": float}[kind](x.value), x.site)
        return self.graph.add("cast", (x,), ({"b": "bool", "i": "int32", "f": "float32"}[kind],), kind, x.site)

    def binary(self, op: str, a: Any, b: Any) -> Traced:
        x, y = self.node(a), self.node(b)
        if op in ("and", "or", "xor") and "f" in (x.kind, y.kind):
            raise self.unsupported(f"applies {op} (& | ^) to a floating-point tensor")
        if op in ("and", "or", "xor", "lt", "le", "gt", "ge", "eq", "ne"):
            operand = promote(x.kind, y.kind)
        elif op == "truediv":
            operand = "f"  # torch's true division of integers gives floats
        else:
            operand = promote(x.kind, y.kind, "i")  # arithmetic on bools counts them as 0 / 1
        kind = "b" if op in ("lt", "le", "gt", "ge", "eq", "ne") else operand
        if op in ("and", "or") and kind == "b":  # x & True = x, x | False = x, x & False = False, x | True = True
            for const, other in ((x, y), (y, x)):
                if const.op == "const":
                    keeps = const.value if op == "and" else not const.value
                    return Traced(self, other if keeps else self.graph.const(op == "or", user_site()))
        return Traced(self, self.graph.add(op, (self.cast(x, operand), self.cast(y, operand)), (), kind, user_site()))

    def unary(self, op: str, a: Any) -> Traced:
        x = self.node(a)
        if op in _UNARY_FLOAT:
            x = self.cast(x, "f")
        elif op in ("neg", "abs", "relu", "sign"):
            if x.kind == "b":
                raise self.unsupported(f"applies {op} to a bool tensor")
        return Traced(self, self.graph.add(op, (x,), (), x.kind, user_site()))

    def power(self, base: Any, exponent: Any) -> Traced:
        g, site = self.graph, user_site()
        if isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
            x = self.node(base)
            if x.kind == "b" or isinstance(exponent, float):
                x = self.cast(x, "f" if isinstance(exponent, float) else "i")
            if x.kind == "i" and exponent < 0:
                raise self.unsupported("raises an integer tensor to a negative power")
            return Traced(self, g.add("pow", (x,), (exponent,), x.kind, site))
        if isinstance(base, (int, float)) and not isinstance(base, bool) and base > 0:
            # c ** x = exp2(x * log2(c)), and its derivative c ** x * ln(c) follows from the graph
            x = self.cast(self.node(exponent), "f")
            scaled = g.add("mul", (x, g.const(math.log2(base), site)), (), "f", site)
            return Traced(self, g.add("exp2", (scaled,), (), "f", site))
        raise self.unsupported(
            "uses ** with a traced exponent", hint="the exponent must be a Python number, or the base a positive one"
        )

    def clamp(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> Traced:
        x, *bounds = args
        lo = kwargs.pop("min", bounds[0] if bounds else None)
        hi = kwargs.pop("max", bounds[1] if len(bounds) > 1 else None)
        if name == "clamp_max":
            lo, hi = None, lo
        self._no_kwargs(f"Tensor.{name}", kwargs)
        nodes = [self.node(x)] + [self.graph.const(None) if v is None else self.node(v) for v in (lo, hi)]
        kind = promote(*(n.kind for n in nodes if not n.is_none))
        nodes = [n if n.is_none else self.cast(n, kind) for n in nodes]
        return Traced(self, self.graph.add("clamp", tuple(nodes), (), kind, user_site()))

    def to(self, display: str, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        x, *rest = args
        dtype = _CAST_METHODS.get(name)
        for value in [*rest, kwargs.pop("dtype", None)]:
            if isinstance(value, torch.dtype):
                dtype = value
            elif isinstance(value, Traced):
                dtype = value.dtype
            elif value is not None and not isinstance(value, (str, torch.device)):
                raise self.unsupported(f"passes a {type(value).__name__} to {display}")
        for flag in ("copy", "non_blocking", "memory_format"):
            kwargs.pop(flag, None)
        self._no_kwargs(display, kwargs)
        node = self.node(x)
        if dtype is None:
            return x
        if dtype not in _DTYPE_KIND:
            raise self.unsupported(f"casts to {dtype}")
        kind, target = _DTYPE_KIND[dtype], str(dtype).removeprefix("torch.")
        if dtype in (torch.float16, torch.bfloat16):  # round as torch would, then compute on in fp32
            return Traced(self, self.graph.add("cast", (self.cast(node, "f"),), (target,), "f", user_site()))
        if kind == "i" and node.op != "const":  # the width the user asks for: int64 widens, int16 wraps
            return Traced(self, self.graph.add("cast", (node,), (target,), "i", user_site()))
        return Traced(self, self.cast(node, kind))

    def fill(self, display: str, name: str, args: list[Any], kwargs: dict[str, Any]) -> Traced:
        like, *rest = args
        if name.startswith("new_"):
            size = kwargs.pop("size", rest.pop(0) if rest else None)
            if size is None or any(int(s) != 1 for s in (size if isinstance(size, (tuple, list)) else (size,))):
                raise self.unsupported(f"uses {display} with size {size!r}", hint="only size () broadcasts")
        value = kwargs.pop("fill_value", rest.pop(0) if rest else _FILL.get(name))
        dtype = kwargs.pop("dtype", None)
        kwargs.pop("requires_grad", None)
        kwargs.pop("memory_format", None)
        self._no_kwargs(display, kwargs)
        if rest or not isinstance(value, (bool, int, float)):
            raise self.unsupported(f"uses {display} with a fill value of type {type(value).__name__}")
        kind = _DTYPE_KIND.get(dtype, "?") if dtype is not None else self.node(like).kind
        if kind == "?":
            raise self.unsupported(f"uses {display} with dtype {dtype}")
        return Traced(self, self.cast(self.graph.const(value, user_site()), kind))

    # --- the whole function --------------------------------------------------------------------------
    def run(self) -> Graph:
        """Call the user function on stand-ins and record its output."""
        g = self.graph
        inputs = [Traced(self, g.input(name)) for name, _, _ in INPUTS[self.kind]]
        try:
            out = self.fn(*inputs)
        except UnsupportedUserFunction:
            raise
        except Exception as exc:  # the user's code failed on stand-ins: name where, and what it raised
            frames = traceback.extract_tb(exc.__traceback__)
            mine = [f for f in frames if not os.path.abspath(f.filename).startswith((PACKAGE_DIR, TORCH_DIR))]
            site = f"{os.path.basename(mine[-1].filename)}:{mine[-1].lineno}" if mine else g.where
            raise UnsupportedUserFunction(
                f"{self.kind} raised {type(exc).__name__}: {exc} ({site}) while the Triton translator traced it; "
                "the call runs on the CPU reference"
            ) from exc
        if isinstance(out, Tensor) or not isinstance(out, (Traced, bool, int, float)):
            raise UnsupportedUserFunction(
                f"{self.kind} returns a {type(out).__name__} ({g.where}), which the Triton translator does not "
                "support (return an expression of its arguments); the call runs on the CPU reference"
            )
        node = self.node(out)
        if self.kind == "score_mod" and (node.kind != "f" or not isinstance(out, Traced)):
            # the CPU paths refuse it too (flex.mods), so the two agree
            what = f"{_KIND_NAME[node.kind]} tensor" if isinstance(out, Traced) else type(out).__name__
            raise UnsupportedUserFunction(
                f"score_mod returns a {what} ({g.where}), not a floating-point tensor (the new scores); "
                "the call runs on the CPU reference"
            )
        if self.kind == "mask_mod" and node.kind != "b":
            raise UnsupportedUserFunction(
                f"mask_mod returns a {_KIND_NAME[node.kind]} tensor ({g.where}), not a bool one (compare it, e.g. "
                "x != 0); the call runs on the CPU reference"
            )
        g.output = node
        return g


_KIND_NAME = {"b": "bool", "i": "integer", "f": "floating-point"}


def trace(fn: Callable[..., Any], captures: Sequence[Tensor], kind: str) -> Graph:
    """The graph of ``fn``, a ``score_mod`` (``kind="score_mod"``) or ``mask_mod``, reading ``captures``.

    Raises :class:`UnsupportedUserFunction` naming the operation and ``file:line`` it cannot translate.
    """
    if kind not in INPUTS:
        raise AttentionValueError(f"kind must be 'score_mod' or 'mask_mod', got {kind!r}")
    return Tracer(fn, captures, kind).run()
