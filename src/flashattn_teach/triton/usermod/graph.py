"""The traced form of a user function: a small graph of pointwise operations and captured-tensor lookups.

A ``score_mod(score, b, h, q_idx, kv_idx)`` or ``mask_mod(b, h, q_idx, kv_idx)`` is evaluated once on
stand-ins (``trace.py``); every operation it performs becomes a :class:`Node`. Nodes are interned (the
same operation on the same operands is one node), created in topological order, and carry:

    kind   "f" (computed in fp32), "i" (an integer; int32 or int64 as ``integers.py`` decides) or "b" (int1),
           with torch's type promotion, b < i < f
    dims   which of the tile's axes the value varies along: "m" (query rows, from q_idx or score),
           "n" (key columns, from kv_idx or score); b and h are scalars, so {} is a scalar
    site   the user's ``file:line`` that created it (for errors and for comments in the generated source)

Operations (``op``) and their operands:

    input    params = (name,)                     score, b, h, q_idx, kv_idx
    const    params = (value,)                    a Python bool / int / float
    gather   args = indices, params = (slot,)     captures[slot][i0, i1, ...]; every dimension indexed
    cast     args = (x,), params = (dtype name,)  .to(dtype); "float16"/"bfloat16" round in that dtype
    add sub mul truediv floordiv mod maximum minimum             binary arithmetic
    lt le gt ge eq ne                                             comparisons (kind "b")
    and or xor                                                    logical on "b", bitwise on "i"
    detach not neg abs relu sign exp log exp2 log2 tanh sigmoid sqrt rsqrt sin cos tan floor ceil   unary
    where    args = (cond, x, y)
    clamp    args = (x, lo, hi), lo or hi may be the const None
    pow      args = (x,), params = (exponent,)   x ** c for a Python number c
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KINDS = ("b", "i", "f")  # the promotion order: bool < int < float

#: the inputs of each kind of user function, with their kinds and the tile axes they vary along
INPUTS: dict[str, tuple[tuple[str, str, frozenset[str]], ...]] = {
    "score_mod": (
        ("score", "f", frozenset("mn")),
        ("b", "i", frozenset()),
        ("h", "i", frozenset()),
        ("q_idx", "i", frozenset("m")),
        ("kv_idx", "i", frozenset("n")),
    ),
    "mask_mod": (
        ("b", "i", frozenset()),
        ("h", "i", frozenset()),
        ("q_idx", "i", frozenset("m")),
        ("kv_idx", "i", frozenset("n")),
    ),
}


def promote(*kinds: str) -> str:
    """The kind of an arithmetic result: the widest operand kind (bool < int < float), as torch's type
    promotion does for a tensor op with tensors or Python numbers."""
    return max(kinds, key=KINDS.index)


@dataclass(eq=False)
class Node:
    """One operation of a traced function; see the module docstring for ``op``, ``args`` and ``params``."""

    index: int
    op: str
    args: tuple[Node, ...]
    params: tuple[Any, ...]
    kind: str
    dims: frozenset[str]
    site: str

    @property
    def value(self) -> Any:
        """The Python value of a ``const`` node."""
        return self.params[0]

    def is_const(self, value: float) -> bool:
        """Is this the number ``value`` (not a bool)?"""
        return self.op == "const" and type(self.value) in (int, float) and self.value == value

    @property
    def is_none(self) -> bool:
        """Is this the marker of a missing clamp bound?"""
        return self.op == "const" and self.value is None


@dataclass(frozen=True)
class CaptureLayout:
    """What the generated source bakes in about a captured tensor: its sizes, strides (elements) and dtype
    (``str(torch.dtype)`` without the ``torch.`` prefix)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str


@dataclass
class Graph:
    """A traced user function: its nodes in topological order, the output node and the captures it reads.

    ``slots[k]`` is the position, in the ``captures`` passed to the tracer, of the tensor that the
    generated code reads through pointer ``Ck``; ``layouts[k]`` is that tensor's layout.
    """

    kind: str  # "score_mod" or "mask_mod"
    name: str  # the user function's name, for the generated source's docstring
    where: str  # the user function's file:line
    nodes: list[Node] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    layouts: list[CaptureLayout] = field(default_factory=list)
    output: Node | None = None
    _interned: dict[tuple[Any, ...], Node] = field(default_factory=dict)

    def add(self, op: str, args: tuple[Node, ...], params: tuple[Any, ...], kind: str, site: str) -> Node:
        """The node for ``op(args; params)``: an existing identical one, or a new one appended."""
        # repr keeps 1 / 1.0 / True and 0.0 / -0.0 / nan apart, which == and hash would merge
        key = (op, tuple(a.index for a in args), repr(params), kind)
        node = self._interned.get(key)
        if node is None:
            dims = frozenset().union(*(a.dims for a in args)) if args else frozenset()
            node = Node(len(self.nodes), op, args, params, kind, dims, site)
            self.nodes.append(node)
            self._interned[key] = node
        return node

    def const(self, value: bool | int | float | None, site: str = "") -> Node:
        """The constant ``value``; its kind follows the Python type (``None`` marks a missing clamp bound)."""
        kind = "b" if isinstance(value, bool) else "i" if isinstance(value, int) else "f"
        return self.add("const", (), (value,), kind, site)

    def input(self, name: str) -> Node:
        """The input ``name`` (score, b, h, q_idx, kv_idx)."""
        for input_name, kind, dims in INPUTS[self.kind]:
            if input_name == name:
                node = self.add("input", (), (name,), kind, "")
                node.dims = dims
                return node
        raise KeyError(name)

    def cone(self, root: Node) -> list[Node]:
        """The nodes ``root`` depends on (itself included), in topological order."""
        needed = {root.index}
        for node in reversed(self.nodes[: root.index + 1]):
            if node.index in needed:
                needed.update(a.index for a in node.args)
        return [n for n in self.nodes if n.index in needed]
