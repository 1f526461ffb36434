"""A traced graph -> the Python source of ``@triton.jit`` functions with the kernels' fixed signatures.

    score_mod(score, b, h, q_idx, kv_idx, C0, C1, C2, C3) -> fp32 (BLOCK_M, BLOCK_N)
    score_grad(score, b, h, q_idx, kv_idx, C0, C1, C2, C3) -> d score_mod / d score, fp32 (BLOCK_M, BLOCK_N)
    mask_mod(b, h, q_idx, kv_idx, C0, C1, C2, C3) -> int1, 2-D, broadcastable to (BLOCK_M, BLOCK_N)

``b``, ``h`` are int32 scalars, ``q_idx`` is ``(BLOCK_M, 1)``, ``kv_idx`` is ``(1, BLOCK_N)`` (int32, absolute
positions), ``score`` is fp32 in natural units. ``Ck`` points at the k-th captured tensor the function
reads; its sizes and strides are literals here, and every lookup is ``tl.load(Ck + i0*s0 + ...)`` masked by
the sizes (a negative index counts from the end, as in torch; one out of range reads 0), so a ragged tile
reads nothing out of bounds. Values are computed in fp32 (floats, gathered ones included), int1 (bools)
and int32 or int64 (ints: int64 wherever torch's int64 value may leave int32, :mod:`.integers`, so that
every integer equals torch's; int8 / int16 / uint8 results wrap as torch's). Integer ``//`` and ``%``
follow Python (floor), not C (truncation), as torch does; a division by a constant multiplies by its
reciprocal (within an ulp; the built-in softcap does the same).
"""

from __future__ import annotations

from .graph import CaptureLayout, Graph, Node
from .integers import Integers
from .standin import UnsupportedUserFunction
from .tangent import tangent

#: helper @triton.jit functions the generated code may call, emitted only when used
_HELPERS = {
    "_tanh": '''@triton.jit
def _tanh(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1), as the built-in softcap computes it: +-1, not NaN, at overflow."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
''',
    "_floordiv": '''@triton.jit
def _floordiv(a, b):
    """Python's a // b (rounds down) from Triton's, which truncates toward zero."""
    q = a // b
    return tl.where((a % b != 0) & ((a < 0) != (b < 0)), q - 1, q)
''',
    "_mod": '''@triton.jit
def _mod(a, b):
    """Python's a % b (the sign of b) from Triton's, which has the sign of a (C's fmod)."""
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
''',
}

_FLOAT_LIBRARY = {"exp": "tl.exp", "log": "tl.log", "exp2": "tl.exp2", "log2": "tl.log2", "sin": "tl.sin",
                  "cos": "tl.cos", "sigmoid": "tl.sigmoid", "sqrt": "tl.sqrt_rn", "rsqrt": "tl.rsqrt",
                  "floor": "tl.floor", "ceil": "tl.ceil", "abs": "tl.abs", "tanh": "_tanh"}  # fmt: skip
_INFIX = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!=", "and": "&", "or": "|", "xor": "^"}  # fmt: skip
_NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"  # torch.maximum / minimum / clamp propagate NaN
# what a loaded value is converted to: fp32 for floats, int32 for narrow ints; int32, int64 and bool stay
_LOAD_CAST = {"float32": "", "int32": "", "int64": "", "bool": "", "float64": ".to(tl.float32)",
              "float16": ".to(tl.float32)", "bfloat16": ".to(tl.float32)"}  # fmt: skip
_INT32_MAX = 2**31 - 1
_FP32_NORMAL = 2.0**-126  # the smallest normal fp32: within (2^-126, 2^126) a reciprocal is finite and normal


def literal(value: bool | int | float, kind: str) -> str:
    """A Python literal of ``value`` in ``kind``, readable by Triton's frontend (``float("-inf")``)."""
    if kind == "b":
        return "True" if value else "False"
    if kind == "i":
        return repr(int(value))
    value = float(value)
    if value != value:
        return 'float("nan")'
    if value in (float("inf"), float("-inf")):
        return 'float("inf")' if value > 0 else '-float("inf")'
    return repr(value)


def _scalar(node: Node) -> bool:
    """Is ``node`` a scalar tensor (a function of b and h only; not a Python constant)?"""
    return not node.dims and node.op != "const"


class _Function:
    """The body of one generated function: a line per node of the root's cone."""

    def __init__(self, graph: Graph, helpers: set[str]) -> None:
        self.graph = graph
        self.helpers = helpers
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.ints = Integers(graph)

    def ref(self, node: Node) -> str:
        """How the body refers to a node: an input's name, a constant's literal, a temporary."""
        if node.op == "const":
            return literal(node.value, node.kind)
        return self.names[node.index]

    def emit(self, root: Node) -> str:
        """Emit the cone of ``root``; the reference to its value."""
        for node in self.graph.cone(root):
            if node.op == "input":
                self.names[node.index] = node.params[0]
            elif node.op != "const" and node.index not in self.names:
                name = f"t{node.index}"
                expression = self.gather(node, name) if node.op == "gather" else self.expression(node)
                self.lines.append(f"{name} = {expression}  # {node.site}")
                self.names[node.index] = name
        return self.ref(root)

    def nonnegative(self, n: Node, x: Node) -> bool:
        """Is the integer operand ``x`` of ``n`` provably >= 0 (then ``//`` and ``%`` need no rounding fix and
        a lookup neither the wrap nor the ``>= 0`` check)? Its interval says, wrapping in int64 included."""
        if x.op == "const":
            return self.ints.constant(n, x) >= 0
        return self.ints[x].interval[0] >= 0

    def operand(self, n: Node, x: Node) -> str:
        """How ``n`` refers to its operand ``x``: an integer widened to int64 where ``n`` is computed in
        int64, a Python integer wrapped to the dtype torch computes ``n`` in (:mod:`.integers`)."""
        if x.is_none:  # clamp's missing bound, which clamp's rule leaves out
            return "None"
        if x.kind != "i" or not self.ints.on_integers(n):
            return self.ref(x)
        if x.op == "const":
            value = self.ints.constant(n, x)
            if self.ints[n].wide and not -(2**31) <= value < 2**31:  # typed: triton would make 2^31 a uint32
                return f"tl.full((), {value}, tl.int64)"
            return literal(value, "i")
        return f"{self.ref(x)}.to(tl.int64)" if self.ints[n].wide and not self.ints[x].wide else self.ref(x)

    def expression(self, n: Node) -> str:
        narrow = self.ints[n].wraps_to
        out = self._expression(n)
        return f"({out}).to(tl.{narrow}).to(tl.int32)" if narrow else out  # wraps as torch's narrow ints do

    def _expression(self, n: Node) -> str:
        a = [self.operand(n, x) for x in n.args]
        float_op = n.args[0].kind == "f"
        if n.op == "truediv" and n.args[1].op == "const" and _FP32_NORMAL < abs(n.args[1].value) < 1 / _FP32_NORMAL:
            # x / c as x * (1 / c), as the built-in softcap scales: a multiply, within an ulp of the quotient
            return f"{a[0]} * {literal(1.0 / n.args[1].value, 'f')}"
        if n.op in ("and", "or", "xor") and n.kind == "b":
            return self.logical(n, a)
        if n.op in _INFIX:
            return f"{a[0]} {_INFIX[n.op]} {a[1]}"
        if n.op == "floordiv":
            if float_op:
                return f"tl.floor({a[0]} / {a[1]})"
            if all(self.nonnegative(n, x) for x in n.args):
                return f"{a[0]} // {a[1]}"
            self.helpers.add("_floordiv")
            return f"_floordiv({a[0]}, {a[1]})"
        if n.op == "mod":
            if not float_op and all(self.nonnegative(n, x) for x in n.args):
                return f"{a[0]} % {a[1]}"
            self.helpers.add("_mod")
            return f"_mod({a[0]}, {a[1]})"
        if n.op in ("maximum", "minimum"):
            return f"tl.{n.op}({a[0]}, {a[1]}{', ' + _NAN_ALL if n.kind == 'f' else ''})"
        if n.op == "clamp":
            nan = f", {_NAN_ALL}" if n.kind == "f" else ""
            out = a[0]
            if not n.args[1].is_none:
                out = f"tl.maximum({out}, {a[1]}{nan})"
            if not n.args[2].is_none:
                out = f"tl.minimum({out}, {a[2]}{nan})"
            return out
        if n.op == "not":
            return f"{a[0]} == 0" if n.kind == "b" else f"~{a[0]}"
        if n.op == "relu":  # max(x, 0), NaN kept as torch.relu keeps it
            zero = literal(0, n.kind)
            return f"tl.maximum({a[0]}, {zero}{', ' + _NAN_ALL if n.kind == 'f' else ''})"
        if n.op == "sign":
            one, zero = literal(1, n.kind), literal(0, n.kind)
            return f"tl.where({a[0]} > {zero}, {one}, tl.where({a[0]} < {zero}, -{one}, {a[0]} * {zero}))"
        if n.op == "detach":
            return a[0]  # the same value; only its derivative is zero
        if n.op == "neg":
            return f"-{a[0]}"
        if n.op == "tan":
            return f"tl.sin({a[0]}) / tl.cos({a[0]})"
        if n.op in _FLOAT_LIBRARY:
            if n.op == "tanh":
                self.helpers.add("_tanh")
            return f"{_FLOAT_LIBRARY[n.op]}({a[0]})"
        if n.op == "where":
            return f"tl.where({a[0]}, {a[1]}, {a[2]})"
        if n.op == "cast":
            target = n.params[0]
            if target == "bool":
                return f"{a[0]} != 0"
            if target in ("float16", "bfloat16"):
                return f"{a[0]}.to(tl.{target}).to(tl.float32)"
            if target in ("int16", "int8", "uint8"):  # wraps as torch's cast does, then computes in int32
                return f"{a[0]}.to(tl.{target}).to(tl.int32)"
            return f"{a[0]}.to(tl.{target})"
        if n.op == "pow":
            return self.power(n, a[0])
        raise AssertionError(f"emit: no rule for {n.op}")  # trace.py creates no other op

    def logical(self, n: Node, a: list[str]) -> str:
        """``& | ^`` of bools; a scalar one (of b, h) with a tile selects with ``tl.where`` instead, which
        compiles alike and which the interpreter gets right (its int1 splat breaks ``&``)."""
        x, y = n.args
        if _scalar(y) and not _scalar(x):
            x, y, a = y, x, [a[1], a[0]]
        if not (_scalar(x) and not _scalar(y)):
            return f"{a[0]} {_INFIX[n.op]} {a[1]}"
        if n.op == "and":
            return f"tl.where({a[0]}, {a[1]}, False)"
        if n.op == "or":
            return f"tl.where({a[0]}, True, {a[1]})"
        return f"tl.where({a[0]}, {a[1]} == 0, {a[1]})"

    def power(self, n: Node, x: str) -> str:
        c = n.params[0]
        if float(c).is_integer() and abs(c) <= 8:
            k = int(abs(c))
            product = " * ".join([x] * k) if k else literal(1, n.kind)
            return f"1.0 / ({product})" if c < 0 else product
        if n.kind == "i":
            raise UnsupportedUserFunction(
                f"{self.graph.kind} raises an integer tensor to the power {c} ({n.site}), which the Triton "
                "translator does not support (exponents up to 8); the call runs on the CPU reference"
            )
        if c == 0.5:
            return f"tl.sqrt_rn({x})"
        return f"tl.exp2({literal(c, 'f')} * tl.log2({x}))"  # x ** c = 2^(c log2 x), NaN for x < 0 as torch

    def gather(self, n: Node, name: str) -> str:
        """``tl.load`` of ``C<slot>[indices]``, masked by the capture's sizes; index prep goes to lines."""
        slot = n.params[0]
        layout: CaptureLayout = self.graph.layouts[slot]
        wide = sum((size - 1) * stride for size, stride in zip(layout.shape, layout.strides, strict=True)) > _INT32_MAX
        terms: list[str] = []
        checks: list[str] = []
        scalar_checks: list[str] = []
        for axis, (index, size, stride) in enumerate(zip(n.args, layout.shape, layout.strides, strict=True)):
            ref = self.ref(index)
            if index.op == "const":
                value = index.value + size if index.value < 0 else index.value
                if not 0 <= value < size:
                    checks.append("False")
                ref = literal(value, "i")
            else:
                if not self.nonnegative(n, index):
                    # torch counts a negative index from the end
                    wrapped = f"{name}_i{axis}"
                    self.lines.append(f"{wrapped} = tl.where({ref} < 0, {ref} + {size}, {ref})")
                    ref = wrapped
                    (scalar_checks if _scalar(index) else checks).append(f"({ref} >= 0)")
                (scalar_checks if _scalar(index) else checks).append(f"({ref} < {size})")
            if wide:
                ref = f"{ref}.to(tl.int64)" if index.op != "const" else ref
            if stride != 0:
                terms.append(ref if stride == 1 else f"{ref} * {stride}")
        pointer = " + ".join([f"C{slot}", *terms])
        mask = " & ".join(checks)
        if scalar_checks:  # see logical(): a scalar condition selects rather than broadcasts into &
            scalar = " & ".join(scalar_checks)
            mask = f"tl.where({scalar}, {mask}, False)" if checks else scalar
        mask = f", mask={mask}, other=0" if mask else ""
        cast = _LOAD_CAST.get(layout.dtype, ".to(tl.int32)")
        return f"tl.load({pointer}{mask}){cast}"


def _docstring(graph: Graph, what: str) -> str:
    reads = [
        f"    C{k} = captures[{p}]: shape {lay.shape}, strides {lay.strides}, {lay.dtype}"
        for k, (p, lay) in enumerate(zip(graph.slots, graph.layouts, strict=True))
    ]
    if not reads:
        return f'    """{what} of {graph.name} ({graph.where}); reads no captured tensor."""'
    return "\n".join([f'    """{what} of {graph.name} ({graph.where}).', "", *reads, '    """'])


def _function(graph: Graph, name: str, root: Node | None, helpers: set[str], what: str) -> str:
    """One ``@triton.jit`` function returning ``root`` (``None``: zero), shaped as its signature promises."""
    body = _Function(graph, helpers)
    args = "b, h, q_idx, kv_idx, C0, C1, C2, C3"
    if graph.kind == "score_mod":
        args = "score, " + args
        if root is None:
            out = "tl.zeros_like(score)"
        else:
            out = body.emit(root)
            out = out if root.kind == "f" else f"{out}.to(tl.float32)"
            out = out if root.dims == frozenset("mn") else f"{out} + tl.zeros_like(score)"  # broadcast
    else:
        assert root is not None
        out = body.emit(root)
        if root.op == "const":
            out = f"tl.full((1, 1), {out}, tl.int1)"
        elif not root.dims:  # a scalar (of b, h): (1, 1), so that a kernel may combine it with & safely
            out = f"tl.broadcast_to({out}, (1, 1))"
    lines = [f"@triton.jit\ndef {name}({args}):", _docstring(graph, what), *(f"    {ln}" for ln in body.lines)]
    return "\n".join([*lines, f"    return {out}\n"])


def emit_source(graph: Graph) -> str:
    """The module source: ``score_mod`` and ``score_grad``, or ``mask_mod``, with the helpers they call."""
    assert graph.output is not None
    helpers: set[str] = set()
    if graph.kind == "score_mod":
        functions = [
            _function(graph, "score_mod", graph.output, helpers, "score_mod"),
            _function(graph, "score_grad", tangent(graph, graph.output), helpers, "d score_mod / d score"),
        ]
    else:
        functions = [_function(graph, "mask_mod", graph.output, helpers, "mask_mod")]
    header = (
        f'"""Generated by flashattn_teach.triton.usermod from {graph.kind} {graph.name} ({graph.where})."""\n\n'
        "import triton\nimport triton.language as tl\n"
    )
    return "\n\n".join([header, *(_HELPERS[h] for h in sorted(helpers)), *functions])
