"""User ``score_mod`` / ``mask_mod`` functions compiled into ``@triton.jit`` functions, without torch.compile.

FlexAttention (torch) traces these functions with torch.compile and inlines them into its Triton
templates. Here a function is traced once per (function, captured tensors' shapes, strides and dtypes)
into a graph of pointwise operations and lookups (``trace.py``, ``graph.py``), differentiated in ``score``
by forward mode for the backward (``tangent.py``), and written out as Triton source (``emit.py``). The
source is compiled from memory and registered with ``linecache``, where ``triton.jit`` reads it
(``inspect.getsource``) both compiled and in the interpreter; no file is written or read (:func:`_load`).

    compiled = compile_score_mod(fn, captures)    # CompiledScoreMod(jit, grad, source, captures)
    print(compiled.source)                        # what the kernel runs; also generated_source(fn)

The kernels pass ``compiled.captures`` (the tensors the function reads, in slot order) as ``C0..C3``.
Supported inside a function: ``+ - * / // % ** (by a number)``, unary ``-``, ``abs``, comparisons,
``& | ^ ~``, ``torch.where``, ``exp log exp2 log2 tanh sigmoid sqrt rsqrt sin cos tan floor ceil sign
relu``, ``maximum``, ``minimum`` (and two-tensor ``max`` / ``min``), ``clamp``, ``.to(dtype)`` and the cast
methods, ``detach``, ``full_like / zeros_like / ones_like`` and ``new_full / new_zeros / new_ones`` of
size ``()``, Python numbers, and lookups ``cap[i, j, ...]`` into captured tensors with integer expressions
of ``b, h, q_idx, kv_idx`` (results of lookups included; ``cap[i][j]`` too). Not translated, refused by
name and line: reductions, Python control flow on tensors, slices, shapes, integers torch cannot convert
(outside ``[-2^63, 2^64)``). Integers hold torch's values: int64 where torch's are int64 and a value may
leave int32 (``integers.py``; index comparisons stay int32), a capture's width where torch keeps it.
Caveats: floats are fp32 (``.double()`` included); a number read from a captured tensor at trace time
(``.item()``) would be baked into the source, so do not.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import linecache
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import Tensor

from flashattn_teach.errors import AttentionValueError

from .emit import emit_source
from .trace import MAX_CAPTURES, UnsupportedUserFunction, trace

__all__ = [
    "MAX_CAPTURES",
    "CompiledMaskMod",
    "CompiledScoreMod",
    "UnsupportedUserFunction",
    "compile_mask_mod",
    "compile_score_mod",
    "generated_source",
    "unsupported_reason",
]


@dataclass(frozen=True)
class CompiledScoreMod:
    """A translated ``score_mod``: ``jit`` and ``grad`` (``d score_mod / d score``) are ``@triton.jit``
    functions ``(score, b, h, q_idx, kv_idx, C0, C1, C2, C3) -> fp32 (BLOCK_M, BLOCK_N)``; pass
    ``captures`` (the tensors it reads, at most MAX_CAPTURES) as ``C0..``; ``source`` is their code."""

    jit: Any
    grad: Any
    source: str
    captures: tuple[Tensor, ...]


@dataclass(frozen=True)
class CompiledMaskMod:
    """A translated ``mask_mod``: ``jit`` is a ``@triton.jit`` function ``(b, h, q_idx, kv_idx, C0, C1, C2,
    C3) -> int1``, 2-D, broadcastable to ``(BLOCK_M, BLOCK_N)``; pass ``captures`` as ``C0..``; ``source`` is
    its code."""

    jit: Any
    source: str
    captures: tuple[Tensor, ...]


@dataclass(frozen=True)
class _Translation:
    """What is cached per (function, capture layouts): the source, its module, the capture positions read."""

    source: str
    module: ModuleType | None
    slots: tuple[int, ...]


_KINDS = ("score_mod", "mask_mod")
_BY_FUNCTION: weakref.WeakKeyDictionary[Any, dict[Any, _Translation | UnsupportedUserFunction]] = (
    weakref.WeakKeyDictionary()
)
_UNWEAKABLE: dict[Any, _Translation | UnsupportedUserFunction] = {}  # callables without weak references


def _constants(fn: Any, depth: int = 0) -> tuple[Any, ...]:
    """The Python numbers a function reads besides its arguments (closure cells, defaults, globals it names,
    ``functools.partial`` arguments), through the functions it closes over: they are baked into the
    source, so they are part of the cache key."""
    if isinstance(fn, functools.partial):
        values = [fn.func, *fn.args, *fn.keywords.values()]
    else:
        values = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _filled(c)]
        values += list(getattr(fn, "__defaults__", None) or ())
        code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
        values += [scope[n] for n in (code.co_names if code else ()) if n in scope]
    return tuple(_constant(v, depth) for v in values)


def _constant(value: Any, depth: int) -> Any:
    if isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)) and depth < 4:
        return tuple(_constant(v, depth + 1) for v in value)
    if (inspect.isfunction(value) or isinstance(value, functools.partial)) and depth < 4:
        return _constants(value, depth + 1)
    return None


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell: a closure variable not yet assigned
        return False
    return True


def _key(captures: Sequence[Tensor], kind: str, fn: Any) -> tuple[Any, ...]:
    layouts = tuple((tuple(c.shape), tuple(c.stride()), c.dtype) for c in captures)
    return (kind, layouts, _constants(fn))


def _load(source: str) -> ModuleType:
    """``source`` as a module compiled from memory: no file is written, and none is read.

    ``triton.jit`` reads a function's source with ``inspect.getsourcelines``, which finds it in ``linecache``
    under the code's file name; a name in angle brackets is one ``linecache`` never looks up on disk, so
    nothing another user can write (a shared temp folder, the working directory) is ever read as the
    kernel's source. The entry is registered again on every load, since ``linecache.clearcache()`` (torch's
    inductor calls it) drops it and the interpreter reads the source at a kernel's first launch.
    """
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    name = f"flashattn_teach_usermod_{digest}"
    filename = f"<{name}>"
    # (size, mtime, lines, name); an mtime of None tells linecache.checkcache there is no file to compare
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = sys.modules.get(name)
    if module is not None:
        return module
    module = ModuleType(name, f"Generated by flashattn_teach.triton.usermod ({filename})")
    code = compile(source, filename, "exec")
    sys.modules[name] = module  # triton.jit and inspect find a function's module by its __module__
    try:
        exec(code, module.__dict__)  # the source is emit_source's, built from the traced graph
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _translate(fn: Callable[..., Any], captures: Sequence[Tensor], kind: str, load: bool) -> _Translation:
    """The cached translation of ``fn``; raises the cached :class:`UnsupportedUserFunction` if it has none."""
    if kind not in _KINDS:
        raise AttentionValueError(f"kind must be 'score_mod' or 'mask_mod', got {kind!r}")
    key: Any = _key(captures, kind, fn)
    table: dict[Any, _Translation | UnsupportedUserFunction]
    try:
        table = _BY_FUNCTION.setdefault(fn, {})
    except TypeError:  # no weak reference (an instance of a slotted class): held strongly, by value
        table, key = _UNWEAKABLE, (fn, *key)
    try:
        cached = table.get(key)
    except TypeError:  # unhashable: translated on every call
        table, key, cached = {}, None, None
    if cached is None:
        try:
            graph = trace(fn, captures, kind)
            cached = _Translation(emit_source(graph), None, tuple(graph.slots))
        except UnsupportedUserFunction as exc:
            cached = exc
        table[key] = cached
    if isinstance(cached, UnsupportedUserFunction):
        raise UnsupportedUserFunction(str(cached))
    if load:  # on every call: _load registers the source with linecache again
        module = _load(cached.source)
        if cached.module is not module:
            cached = _Translation(cached.source, module, cached.slots)
            table[key] = cached
    return cached


def compile_score_mod(fn: Callable[..., Any], captures: Sequence[Tensor] = ()) -> CompiledScoreMod:
    """``fn(score, b, h, q_idx, kv_idx) -> score`` as ``@triton.jit`` functions for the kernels.

    ``captures``: the tensors ``fn`` reads (``flex.captures.captured_tensors(fn)``), matched by identity.
    Cached per (function, captures' shapes, strides and dtypes, the numbers it closes over).
    Raises :class:`UnsupportedUserFunction` naming the operation and ``file:line`` it cannot translate.
    """
    t = _translate(fn, captures, "score_mod", load=True)
    assert t.module is not None
    return CompiledScoreMod(t.module.score_mod, t.module.score_grad, t.source, tuple(captures[p] for p in t.slots))


def compile_mask_mod(fn: Callable[..., Any], captures: Sequence[Tensor] = ()) -> CompiledMaskMod:
    """``fn(b, h, q_idx, kv_idx) -> bool`` as a ``@triton.jit`` function; see :func:`compile_score_mod`."""
    t = _translate(fn, captures, "mask_mod", load=True)
    assert t.module is not None
    return CompiledMaskMod(t.module.mask_mod, t.source, tuple(captures[p] for p in t.slots))


def unsupported_reason(fn: Callable[..., Any], captures: Sequence[Tensor], kind: str) -> str | None:
    """Why ``fn`` (a ``kind``: "score_mod" or "mask_mod") cannot run in the Triton kernels, or ``None``.

    For the planner: cached, imports no triton, and never raises for anything the function does.
    """
    try:
        _translate(fn, captures, kind, load=False)
    except UnsupportedUserFunction as exc:
        return str(exc)
    except Exception as exc:  # the contract: a reason, never an exception
        return f"{kind} could not be translated for the Triton kernels: {type(exc).__name__}: {exc}"
    return None


def generated_source(fn: Callable[..., Any], captures: Sequence[Tensor] = (), kind: str | None = None) -> str:
    """The Triton source the kernels run for ``fn``, for a reader: ``print(generated_source(my_mod))``.

    ``kind`` defaults by arity: 5 parameters without defaults is a score_mod, 4 a mask_mod.
    """
    if kind is None:
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        parameters = inspect.signature(fn).parameters.values()
        arity = sum(p.kind in positional and p.default is inspect.Parameter.empty for p in parameters)
        if arity not in (4, 5):
            raise AttentionValueError(
                f"generated_source: {getattr(fn, '__name__', fn)!r} takes {arity} parameters without defaults; a "
                "score_mod takes 5 (score, b, h, q_idx, kv_idx), a mask_mod 4 (b, h, q_idx, kv_idx); "
                "pass kind= to say which"
            )
        kind = "score_mod" if arity == 5 else "mask_mod"
    return _translate(fn, captures, kind, load=False).source
