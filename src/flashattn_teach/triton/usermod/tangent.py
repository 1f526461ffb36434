"""``d score_mod / d score`` by forward-mode differentiation of the traced graph.

The backward needs ``dS_raw = dS * d score_mod(S) / dS`` element by element. Since ``score_mod`` is
pointwise in ``score``, one forward-mode pass does it: every node gets a tangent ``dx = d x / d score``
(``None`` where it does not depend on ``score``), built from its operands' tangents by the rules below,
which are torch's autograd formulas so that the kernels' gradients agree with autograd's on the CPU:

    x + y: dx + dy           x * y: dx y + x dy        x / y: dx / y - dy (x / y) / y
    x % y: dx - dy floor(x / y)                        x // y, floor, ceil, sign, detach, casts to int/bool, lookups: 0
    exp: dx e^x   exp2: dx 2^x ln2   log: dx / x   log2: dx / (x ln2)   tanh: dx (1 - t^2)
    sigmoid: dx s (1 - s)   sqrt: dx / (2 r)   rsqrt: -dx r^3 / 2   sin: dx cos   cos: -dx sin   tan: dx (1 + t^2)
    abs: dx sign(x)          relu: dx where x > 0     x ** c: dx c x^(c-1) (0 for c = 0)
    where(c, x, y): where(c, dx, dy)
    maximum(x, y): dx where x > y, dy where x < y, (dx + dy) / 2 at ties (torch splits ties evenly)
    clamp(x, lo, hi): dx where lo <= x <= hi, dlo where x < lo, dhi where x > hi
"""

from __future__ import annotations

import math

from .graph import Graph, Node

# ops whose result is piecewise constant in score (or no float at all): a zero tangent
_ZERO_TANGENT = {"const", "gather", "detach", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "xor", "not",
                 "floordiv", "floor", "ceil", "sign"}  # fmt: skip


class _Builder:
    """Float-valued graph nodes with the algebra a tangent needs; ``None`` is the zero tangent."""

    def __init__(self, graph: Graph, site: str) -> None:
        self.g = graph
        self.site = site

    def c(self, value: float) -> Node:
        return self.g.const(float(value), self.site)

    def op(self, op: str, *args: Node) -> Node:
        return self.g.add(op, args, (), "f", self.site)

    def add(self, a: Node | None, b: Node | None) -> Node | None:
        if a is None or b is None:
            return a if b is None else b
        if a.op == b.op == "const":
            return self.c(a.value + b.value)
        return self.op("add", a, b)

    def neg(self, a: Node | None) -> Node | None:
        return None if a is None else self.op("neg", a)

    def mul(self, a: Node | None, b: Node | None) -> Node | None:
        if a is None or b is None:
            return None
        if a.is_const(1):
            return b
        if b.is_const(1):
            return a
        if a.op == b.op == "const":
            return self.c(a.value * b.value)
        return self.op("mul", a, b)

    def div(self, a: Node | None, b: Node) -> Node | None:
        if a is not None and a.op == b.op == "const" and b.value != 0:
            return self.c(a.value / b.value)
        return None if a is None else self.op("truediv", a, b)

    def where(self, cond: Node, a: Node | None, b: Node | None) -> Node | None:
        if a is None and b is None:
            return None
        return self.g.add("where", (cond, a or self.c(0.0), b or self.c(0.0)), (), "f", self.site)

    def cmp(self, op: str, a: Node, b: Node) -> Node:
        return self.g.add(op, (a, b), (), "b", self.site)


def tangent(graph: Graph, root: Node) -> Node | None:
    """The node of ``d root / d score`` (added to ``graph``), or ``None`` where ``root`` ignores ``score``."""
    dots: dict[int, Node | None] = {}
    for node in graph.cone(root):
        dots[node.index] = _rule(_Builder(graph, node.site), node, [dots[a.index] for a in node.args])
    return dots[root.index]


def _rule(f: _Builder, n: Node, d: list[Node | None]) -> Node | None:
    """The tangent of node ``n`` from its operands' tangents ``d`` (the table in the module docstring)."""
    if n.op == "input":
        return f.c(1.0) if n.params == ("score",) else None
    if n.op in _ZERO_TANGENT or n.kind != "f" or all(t is None for t in d):
        return None
    x = n.args[0]
    y = n.args[1] if len(n.args) > 1 else None
    if n.op == "cast":
        return d[0]
    if n.op == "add":
        return f.add(d[0], d[1])
    if n.op == "sub":
        return f.add(d[0], f.neg(d[1]))
    if n.op == "mul":
        assert y is not None
        return f.add(f.mul(d[0], y), f.mul(x, d[1]))
    if n.op == "truediv":
        assert y is not None
        return f.add(f.div(d[0], y), f.neg(f.div(f.mul(d[1], n), y)))
    if n.op == "mod":
        assert y is not None
        return f.add(d[0], f.neg(f.mul(d[1], f.op("floor", f.op("truediv", x, y)))))
    if n.op == "neg":
        return f.neg(d[0])
    if n.op == "abs":
        zero = f.c(0.0)
        return f.where(f.cmp("gt", x, zero), d[0], f.where(f.cmp("lt", x, zero), f.neg(d[0]), None))
    if n.op == "relu":
        return f.where(f.cmp("gt", x, f.c(0.0)), d[0], None)
    if n.op == "exp":
        return f.mul(d[0], n)
    if n.op == "exp2":
        return f.mul(d[0], f.mul(n, f.c(math.log(2.0))))
    if n.op == "log":
        return f.div(d[0], x)
    if n.op == "log2":
        return f.div(d[0], f.op("mul", x, f.c(math.log(2.0))))
    if n.op == "tanh":
        return f.mul(d[0], f.op("sub", f.c(1.0), f.op("mul", n, n)))
    if n.op == "sigmoid":
        return f.mul(d[0], f.op("mul", n, f.op("sub", f.c(1.0), n)))
    if n.op == "sqrt":
        return f.div(d[0], f.op("mul", f.c(2.0), n))
    if n.op == "rsqrt":
        return f.mul(d[0], f.mul(f.c(-0.5), f.op("mul", n, f.op("mul", n, n))))
    if n.op == "sin":
        return f.mul(d[0], f.op("cos", x))
    if n.op == "tan":
        return f.mul(d[0], f.op("add", f.c(1.0), f.op("mul", n, n)))
    if n.op == "cos":
        return f.neg(f.mul(d[0], f.op("sin", x)))
    if n.op == "pow":
        c = n.params[0]
        if c == 0:
            return None
        if c == 1:
            return d[0]
        power = x if c == 2 else f.g.add("pow", (x,), (c - 1,), "f", f.site)
        return f.mul(d[0], f.mul(f.c(c), power))
    if n.op == "where":
        return f.where(x, d[1], d[2])
    if n.op in ("maximum", "minimum"):
        assert y is not None
        wins = "gt" if n.op == "maximum" else "lt"
        loses = "lt" if n.op == "maximum" else "gt"
        tie = f.mul(f.c(0.5), f.add(d[0], d[1]) or f.c(0.0))
        return f.where(f.cmp(wins, x, y), d[0], f.where(f.cmp(loses, x, y), d[1], tie))
    if n.op == "clamp":
        lo, hi = n.args[1], n.args[2]
        inside: Node | None = None
        for bound, op in ((lo, "ge"), (hi, "le")):
            if not bound.is_none:
                check = f.cmp(op, x, bound)
                inside = check if inside is None else f.g.add("and", (inside, check), (), "b", f.site)
        out = d[0] if inside is None else f.where(inside, d[0], None)
        if d[1] is not None:
            out = f.add(out, f.where(f.cmp("lt", x, lo), d[1], None))
        if d[2] is not None:
            out = f.add(out, f.where(f.cmp("gt", x, hi), d[2], None))
        return out
    raise NotImplementedError(f"no derivative rule for {n.op}")  # every float op of graph.py has one above
