"""User functions called as torch calls them: one ``(b, h, q_idx, kv_idx)`` element at a time, by vmap.

torch's eager ``flex_attention`` never hands ``score_mod`` a tile of broadcast indices. It wraps the
function in four nested ``torch.vmap`` levels, one per index, and calls the result on the index vectors
(``torch.nn.attention.flex_attention._vmap_for_bhqkv``)::

    level       maps          score's dim     so inside the function
    outermost   b  (B,)       0               b        0-d int64
                h  (H,)       0               h        0-d int64 (the query head)
                q_idx (Br,)   0               q_idx    0-d int64
    innermost   kv_idx (Bc,)  0               kv_idx   0-d int64, score 0-d

so the function is written for one element, and whatever it does to a 0-d tensor (``bias[b][q_idx]``,
``bias[q_idx][kv_idx]``, ``torch.dot(q_rope[b, h, q_idx], k_rope[b, h // G, kv_idx])``) is batched by vmap
into one tensor operation per tile, not one Python call per element. Every CPU path calls the functions
here, at every size, so a function means the same on the tile of every head at once and on the tile of one
``(b, h)``: the index vectors are then of length 1, the levels are the same.

Two details make per-element indexing work, as in torch:

- ``t[i]`` with a 0-d index tensor ``i`` must be advanced indexing (``aten.index``), which vmap batches and
  autograd differentiates (repeated indices add up in the backward). The installed torch's own ``t[i]``
  does that for a batched ``i``; a torch whose ``t[i]`` calls ``i.item()`` instead (which vmap cannot do)
  gets :class:`IndexByTensors` around the call, as torch's eager flex_attention puts its own. Which one a
  torch needs is found once, by a probe (:func:`native_indexing`): the mode costs tens of microseconds on
  every operation of the function.
- A function's result that does not depend on ``b`` (or ``h``) comes out of vmap expanded along it, with
  stride 0; :func:`compact` keeps size 1 there, so a causal ``mask_mod`` is still one ``(Br, Bc)`` tile
  for every head, and block-mask classification (:mod:`.classify`) classifies it once.

Python control flow on an index (``if q_idx >= kv_idx:``, ``int(b)``, ``.item()``) cannot be batched; torch
fails on it too. Here it is refused by the function's name with the way to write it (``torch.where``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C._functorch import _add_batch_dim, _remove_batch_dim, _vmap_decrement_nesting, _vmap_increment_nesting
from torch._functorch.vmap import lazy_load_decompositions
from torch.overrides import TorchFunctionMode

from ..errors import AttentionTypeError, AttentionValueError

Fn = Callable[..., Any]

# vmap's messages for what cannot be batched: a tensor in an ``if``/``and``/``bool()``, or ``.item()``/``int()``
_CONTROL_FLOW = ("data-dependent control flow", ".item()")


class IndexByTensors(TorchFunctionMode):
    """``t[i, j, ...]`` whose indices are tensors (0-d ones included) and integers, at least one a tensor,
    as advanced indexing ``aten.index(t, [i, j, ...])`` instead of Python's conversion of a 0-d tensor to
    an int. The result is the same for plain tensors; under vmap it is the only form that works."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is Tensor.__getitem__:
            t, index = args
            parts = index if isinstance(index, tuple) else (index,)
            plain = all(isinstance(p, Tensor) or (isinstance(p, int) and not isinstance(p, bool)) for p in parts)
            if plain and any(isinstance(p, Tensor) for p in parts):
                as_tensors = [p if isinstance(p, Tensor) else torch.tensor(p, device=t.device) for p in parts]
                return torch.ops.aten.index(t, as_tensors)
        return func(*args, **(kwargs or {}))


def describe(fn: object) -> str:
    """``name (file:line)`` of a user function, for messages."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    code = getattr(fn, "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def _per_element(fn: Fn, score: Tensor | None, index: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
    """``fn`` of one element, mapped over the index vectors ``(b, h, q_idx, kv_idx)`` (and ``score``, mapped
    along its leading dim at every level): b outermost, kv_idx innermost, as torch nests them.

    Each level is what ``torch.vmap`` does for one call (``torch/_functorch/vmap.py``, ``_flat_vmap``):
    enter a vmap level, wrap the mapped arguments as batched along dim 0, call, unwrap the result along dim 0
    (an unbatched result is expanded, with stride 0), leave the level. ``torch.vmap`` itself would also
    walk and check arbitrary argument trees at every level of every call, some 40 us a level, more than a
    small tile's arithmetic; the arguments here are always these tensors, mapped along dim 0."""
    lazy_load_decompositions()  # the batching rules torch.vmap loads on its first call
    args = [*(() if score is None else (score,)), *index]
    first = len(args) - 4  # where the index vectors start
    levels: list[tuple[int, int]] = []  # (vmap level, its size), outermost first
    try:
        for n, vector in enumerate(index):
            level = _vmap_increment_nesting(len(vector), "error")  # random ops refused, torch.vmap's default
            levels.append((level, len(vector)))
            if score is not None:
                args[0] = _add_batch_dim(args[0], 0, level)
            args[first + n] = _add_batch_dim(args[first + n], 0, level)
        out: Tensor = fn(*args)
        while levels:
            level, size = levels[-1]
            out = _remove_batch_dim(out, level, size, 0)
            levels.pop()
            _vmap_decrement_nesting()
    finally:
        for _ in levels:  # an error inside: leave every level still entered
            _vmap_decrement_nesting()
    return out


@functools.cache
def native_indexing() -> bool:
    """Whether this torch's ``t[i]``, ``t[i, j]`` with batched 0-d index tensors inside vmap index as
    ``aten.index`` does (else :class:`IndexByTensors` is needed): checked once on a small table."""
    table = torch.arange(12).view(3, 4)
    b, h, q_idx, kv_idx = (torch.arange(n) for n in (3, 4, 3, 4))
    want = table[:, :, None, None] + table[None, None]  # (3, 4, 3, 4): table[b, h] + table[q_idx][kv_idx]
    try:
        got = _per_element(lambda b, h, q_idx, kv_idx: table[b, h] + table[q_idx][kv_idx], None, (b, h, q_idx, kv_idx))
    except RuntimeError:
        return False
    return torch.equal(got, want)


def _run(kind: str, fn: object, one: Fn, score: Tensor | None, index: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
    try:
        with contextlib.nullcontext() if native_indexing() else IndexByTensors():
            return _per_element(one, score, index)
    except RuntimeError as err:
        message = str(err)
        if not message.startswith("vmap"):
            raise
        args_named = "(score, b, h, q_idx, kv_idx)" if kind == "score_mod" else "(b, h, q_idx, kv_idx)"
        hint = (
            " Python control flow on them (if, and/or, bool(), int(), .item()) cannot be batched: write it with "
            "tensor operations, e.g. torch.where(q_idx >= kv_idx, score, -float('inf')) instead of "
            "`if q_idx >= kv_idx:`, and (a & b) instead of (a and b)."
            if any(words in message for words in _CONTROL_FLOW)
            else ""
        )
        raise AttentionValueError(
            f"{kind} {describe(fn)} cannot be called per element: {message.splitlines()[0]} As in torch's "
            f"flex_attention, it is called as by torch.vmap, once per element {args_named}, each a 0-d "
            f"tensor.{hint}"
        ) from err


def scores(score_mod: Fn, S: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``score_mod`` of every element of ``S`` ``(B, H, Br, Bc)``, at the index vectors ``b (B,)``, ``h (H,)``,
    ``q_idx (Br,)``, ``kv_idx (Bc,)``: a ``(B, H, Br, Bc)`` tensor (possibly expanded)."""

    def one(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = score_mod(score, b, h, q_idx, kv_idx)
        if not isinstance(out, Tensor) or not out.is_floating_point():
            what = f"a {out.dtype} tensor" if isinstance(out, Tensor) else type(out).__name__
            raise AttentionTypeError(
                f"score_mod {describe(score_mod)} must return a floating-point tensor (the new score), got {what}"
            )
        _check_one("score_mod", score_mod, out)
        return out

    if S.numel() == 0:  # no element to call it on (vmap cannot map a dim of size 0)
        return S.clone()
    return _run("score_mod", score_mod, one, S, (b, h, q_idx, kv_idx))


def visible(mask_mod: Fn, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``mask_mod`` at every element of the index vectors: bool ``(B, H, Br, Bc)``, compact (size 1 along
    ``b`` or ``h`` where it does not read them, :func:`compact`)."""

    def one(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = mask_mod(b, h, q_idx, kv_idx)
        if isinstance(out, bool):  # a constant mask (torch's noop_mask returns a tensor; accept both)
            return torch.tensor(out, device=q_idx.device)
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            what = f"a {out.dtype} tensor" if isinstance(out, Tensor) else type(out).__name__
            raise AttentionTypeError(
                f"mask_mod {describe(mask_mod)} must return a bool tensor (True where query q_idx may see key "
                f"kv_idx), got {what}: return a comparison such as q_idx >= kv_idx; a function of (score, b, h, "
                "q_idx, kv_idx) is a score_mod, which flex_attention takes as score_mod="
            )
        _check_one("mask_mod", mask_mod, out)
        return out

    shape = (len(b), len(h), len(q_idx), len(kv_idx))
    if 0 in shape:  # no element to call it on (vmap cannot map a dim of size 0)
        return torch.ones(shape, dtype=torch.bool, device=q_idx.device)
    return compact(_run("mask_mod", mask_mod, one, None, (b, h, q_idx, kv_idx)))


def _check_one(kind: str, fn: object, out: Tensor) -> None:
    if out.dim() != 0:
        raise AttentionValueError(
            f"{kind} {describe(fn)} returned shape {tuple(out.shape)} for one element; it is called once per "
            "(b, h, q_idx, kv_idx), each a 0-d tensor (as torch's flex_attention calls it), and must return one "
            "value: index captured tensors down to one element, e.g. bias[h, q_idx, kv_idx]"
        )


def compact(t: Tensor) -> Tensor:
    """``(B, H, Br, Bc)`` with size 1 along ``B`` and ``H`` where vmap expanded a result that does not depend
    on them (stride 0: every entry along that dim is the same memory, so the same value)."""
    for dim in (0, 1):
        if t.shape[dim] > 1 and t.stride(dim) == 0:
            t = t.narrow(dim, 0, 1)
    return t


def probe_args(dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
    """One element's ``(score, b, h, q_idx, kv_idx)``, 0-d tensors, for a probe call outside vmap."""
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return (torch.zeros((), dtype=dtype, device=device), zero, zero.clone(), zero.clone(), zero.clone())
