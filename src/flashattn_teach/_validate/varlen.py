"""Input checks of :func:`flashattn_teach.flash_attention_varlen` (flash-attn's packed layout).

The packed layout is ``q (total_q, H_q, D)``, ``k (total_k, H_kv, D)``, ``v (total_k, H_kv, D_v)``, with
``cu_seqlens_q``, ``cu_seqlens_k`` the ``(B + 1,)`` sequence bounds on the packed axis. The checks that
depend on that layout, and name its arguments, live here; dtypes, devices and the softmax scale are then
checked by ``_validate.validate_inputs`` on the ``(H, total, D)`` views, as for every other call.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..errors import AttentionTypeError, AttentionValueError
from .inputs import shape_str


class PackedBounds(NamedTuple):
    """Where packed sequences lie on the packed axis, as flash-attn's functions take them: ``cu_seqlens_q,
    cu_seqlens_k`` ``(B + 1,)`` and ``max_seqlen_q, max_seqlen_k``, as given (``make_packed_options``
    checks them with the functions below)."""

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def check_tensor(name: str, t: object, want: str) -> Tensor:
    """``t`` is a tensor, else the error naming ``name`` and the shape ``want`` ed (its rank is the caller's)."""
    if not isinstance(t, Tensor):
        raise AttentionTypeError(f"{name} must be a torch.Tensor of shape {want}, got {type(t).__name__}")
    return t


def check_packed_qkv(q: object, k: object, v: object) -> None:
    """``q (total_q, H_q, D)``, ``k (total_k, H_kv, D)``, ``v (total_k, H_kv, D_v)`` with ``H_kv | H_q``."""
    for name, t, want in (
        ("q", q, "(total_q, H_q, D)"),
        ("k", k, "(total_k, H_kv, D)"),
        ("v", v, "(total_k, H_kv, D_v)"),
    ):
        tensor = check_tensor(name, t, want)
        if tensor.dim() != 3:
            pools = "; page pools (num_blocks, H_kv, page_size, D) need block_table=" if tensor.dim() == 4 else ""
            raise AttentionValueError(
                f"{name} must have shape {want} (packed sequences), got {shape_str(tensor)}{pools}"
            )
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)

    def shapes() -> str:  # built when raising: while compiling, the sizes may be symbols
        return f"q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)}"

    if k.shape[:2] != v.shape[:2]:
        raise AttentionValueError(f"k and v must share total_k and H_kv (dims 0 and 1), got {shapes()}")
    if q.shape[2] != k.shape[2]:
        raise AttentionValueError(f"q and k must have the same head dimension D (dim 2), got {shapes()}")
    check_head_groups(q.shape[1], k.shape[1], shapes)


def check_head_groups(H_q: int, H_kv: int, shapes: Callable[[], str]) -> None:
    """Grouped-query heads: ``H_kv`` divides ``H_q`` (query head h reads key/value head ``h // (H_q //
    H_kv)``), else the error quoting ``shapes()`` (built only to raise)."""
    if H_kv == 0 or H_q % H_kv != 0:
        raise AttentionValueError(
            f"the query heads H_q={H_q} must be a multiple of the key/value heads H_kv={H_kv} ({shapes()})"
        )


def check_cu_seqlens(name: str, cu: object, total: int | None, total_name: str, device: torch.device) -> Tensor:
    """``(B + 1,)`` int32 or int64 on the inputs' device: starts at 0, non-decreasing, ends at ``total``
    (``None``: anywhere, as ``cu_seqlens_k`` with a block table, whose keys are read from pages)."""
    want = f"(B + 1,) holding 0, then each sequence's end on the packed axis, the last equal to {total_name}"
    if not isinstance(cu, Tensor):
        raise AttentionTypeError(f"{name} must be a torch.Tensor of shape {want}, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise AttentionTypeError(f"{name} must be int32 or int64, got {cu.dtype} with shape {shape_str(cu)}")
    if cu.dim() != 1 or cu.numel() == 0:
        raise AttentionValueError(f"{name} must be 1-D of shape {want}, got shape {shape_str(cu)}")
    if cu.device != device:
        raise AttentionValueError(f"{name} is on {cu.device} but q is on {device}")
    values = cu.tolist()
    if values[0] != 0:
        raise AttentionValueError(f"{name} must start at 0, got {name}[0] = {values[0]}")
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            raise AttentionValueError(
                f"{name} must be non-decreasing (sequence lengths >= 0), got {name}[{b}] = {values[b]} > "
                f"{name}[{b + 1}] = {values[b + 1]}"
            )
    if total is not None and values[-1] != total:
        raise AttentionValueError(f"{name} must end at {total_name} = {total}, got {name}[-1] = {values[-1]}")
    return cu


def check_same_batch(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor) -> int:
    """Both bounds describe the same ``B`` sequences; returns ``B``."""
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise AttentionValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{cu_seqlens_q.numel() - 1} (shape {shape_str(cu_seqlens_q)}) and {cu_seqlens_k.numel() - 1} "
            f"(shape {shape_str(cu_seqlens_k)})"
        )
    return cu_seqlens_q.numel() - 1


def check_max_seqlen_type(name: str, value: object) -> None:
    """A non-negative int (a symbol while compiling with dynamic shapes): what can be checked without
    reading the sequence bounds."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise AttentionTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise AttentionValueError(f"{name} must be at least 0 (the longest sequence's length), got {int(value)}")


def check_max_seqlen(name: str, value: object, cu: Tensor, cu_name: str) -> int:
    """An int at least as large as every sequence's length (flash-attn sizes its grid by it)."""
    check_max_seqlen_type(name, value)
    assert isinstance(value, numbers.Integral)
    lengths = (cu[1:] - cu[:-1]).tolist()
    longest = max(lengths, default=0)
    if value < longest:
        b = lengths.index(longest)
        raise AttentionValueError(
            f"{name} = {int(value)} is smaller than sequence {b}'s length {longest} (from {cu_name}); pass "
            f"at least the longest length"
        )
    return int(value)


def check_packed_alibi(
    slopes: object, B: int, H_q: int, device: torch.device, *, rows: str = "sequence"
) -> Tensor | None:
    """ALiBi slopes with a row per ``rows`` (a sequence of a packed call; a batch element of a decode step):
    floating-point ``(H_q,)`` or ``(B, H_q)``, on ``q``'s device."""
    if slopes is None:
        return None
    want = f"({H_q},) or ({B}, {H_q})"
    if not isinstance(slopes, Tensor):
        raise AttentionTypeError(f"alibi_slopes must be a torch.Tensor of shape {want}, got {type(slopes).__name__}")
    if not slopes.is_floating_point():
        raise AttentionTypeError(
            f"alibi_slopes must be floating-point, got {slopes.dtype} with shape {shape_str(slopes)}"
        )
    # compared size by size: under torch.compile(dynamic=True) the sizes are symbols, which a tuple's `in` misreads
    per_head = slopes.dim() == 1 and slopes.shape[0] == H_q
    if not (per_head or (slopes.dim() == 2 and slopes.shape[0] == B and slopes.shape[1] == H_q)):
        raise AttentionValueError(
            f"alibi_slopes must have shape {want} (one slope per query head, optionally per {rows}), "
            f"got {shape_str(slopes)}"
        )
    if slopes.device != device:
        raise AttentionValueError(f"alibi_slopes is on {slopes.device} but q is on {device}")
    return slopes
