"""Input checks of :func:`flashattn_teach.flash_attention_with_kvcache` (decoding against a KV cache).

The layout is the library's ``(B, H, N, D)``: ``q (B, H_q, N_new, D)``, ``k_cache (B, H_kv, N_max, D)``,
``v_cache (B, H_kv, N_max, D_v)``, the new ``k (B, H_kv, N_new_kv, D)`` and ``v (B, H_kv, N_new_kv, D_v)``
or neither, and ``cache_seqlens``, the valid entries per batch element. The checks that depend on that
layout, and name its arguments, live here, with the record they fill: :class:`DecodeStep`, the step's
options checked once (:func:`flashattn_teach.serving.step.check_step`) and read by every layer below.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import Tensor, dtype

from .._autocast import autocast_dtype
from .._validate import inputs
from .._validate.fp8 import is_fp8
from .._validate.inputs import shape_str
from .._validate.varlen import check_head_groups, check_packed_alibi
from ..errors import AttentionTypeError, AttentionValueError


@dataclass(frozen=True)
class DecodeStep:
    """One decode step's options after every check, built once (:func:`~.step.check_step`, from the call's
    :class:`~flashattn_teach._options.DecodeKeywords`) and handed whole to every layer below: each batch
    element and key range of the CPU paths (:mod:`.ranges`), and the Triton decode kernel's launcher
    (``dispatch.runner.run_decode`` -> :func:`.launch.triton_decode`). ``scale`` resolved, ``window`` as
    ``check_window`` returns it (``(-1, -1)``: none), ``num_splits`` 0 to choose (the CPU paths resolve it
    before their ranges, the launcher on CUDA), ``backend`` routed (:func:`~.step.route_extras`). The
    tensors are checked for dtype, shape and device; their values only where they are on the host."""

    causal: bool
    scale: float
    window: tuple[int, int]
    softcap: float | None
    num_splits: int
    backend: str
    cache_seqlens: Tensor | int  # (B,) or one for every batch element: the entries before the step
    alibi_slopes: Tensor | None = None  # (H_q,) or (B, H_q)
    block_table: Tensor | None = None  # (B, max_blocks): the caches are pools of pages
    cache_leftpad: Tensor | None = None  # (B,)
    sinks: Tensor | None = None  # (H_q,)


_WANT = {
    "q": "(B, H_q, N_new, D)",
    "k_cache": "(B, H_kv, N_max, D)",
    "v_cache": "(B, H_kv, N_max, D_v)",
    "k": "(B, H_kv, N_new_kv, D)",
    "v": "(B, H_kv, N_new_kv, D_v)",
}
# with block_table: pools of pages (flash-attn's (num_blocks, page_size, H_kv, D) as .transpose(1, 2))
_WANT_PAGED = {
    **_WANT,
    "k_cache": "(num_blocks, H_kv, page_size, D) with block_table",
    "v_cache": "(num_blocks, H_kv, page_size, D_v) with block_table",
}


def _tensor4(name: str, t: object, want: dict[str, str] = _WANT) -> Tensor:
    if not isinstance(t, Tensor):
        raise AttentionTypeError(f"{name} must be a torch.Tensor of shape {want[name]}, got {type(t).__name__}")
    if not t.is_floating_point():
        raise AttentionTypeError(f"{name} must have a floating-point dtype, got {t.dtype} with shape {shape_str(t)}")
    if is_fp8(t):  # no descales here: e4m3 values without their factors mean nothing (flash_attention's FP8)
        raise AttentionTypeError(
            f"{name} is {t.dtype} with shape {shape_str(t)}: flash_attention_with_kvcache has no FP8 path "
            "(no descales); dequantise the caches and queries to bfloat16 or float16 first"
        )
    if t.dim() != 4:
        raise AttentionValueError(f"{name} must have shape {want[name]}, got {shape_str(t)}")
    return t


def _same(names: tuple[str, ...], tensors: tuple[Tensor, ...], dims: tuple[int, ...], what: str) -> None:
    """The tensors agree on ``dims`` (their ``what``), else an error quoting every shape. Sizes are compared,
    not hashed: under ``torch.compile(dynamic=True)`` they are symbolic, and a symbolic size has no hash."""
    first = tensors[0].shape
    for t in tensors[1:]:
        shape = t.shape
        for d in dims:
            if shape[d] != first[d]:
                shapes = ", ".join(f"{n} {shape_str(t)}" for n, t in zip(names, tensors, strict=True))
                raise AttentionValueError(f"{' and '.join(names)} must have the same {what}, got {shapes}")


def autocast_inputs(
    q: Tensor, k_cache: Tensor, k: Tensor | None, v: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor | None, dtype | None]:
    """``q, k, v`` as a decode step computes from them under ``torch.autocast`` on ``q``'s device type, and
    the autocast dtype (None when autocast is off there). ``q`` is cast to the autocast dtype, float64
    untouched, as torch's SDPA casts its query; ``k, v`` are cast to the caches' dtype, not autocast's,
    since they are written into the caches, which are the caller's storage; the caches themselves are read
    in ``q``'s dtype, a range at a time, as SDPA would cast them (:mod:`flashattn_teach.serving.ranges`)."""
    if not isinstance(q, Tensor) or not isinstance(k_cache, Tensor):
        return q, k, v, None  # check_cache_inputs names the argument that is not a tensor
    cast = autocast_dtype(q.device.type)
    if cast is None:
        return q, k, v, None
    if q.is_floating_point() and q.dtype != torch.float64:
        q = q.to(cast)
    k_new, v_new = (t.to(k_cache.dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for t in (k, v))
    return q, k_new, v_new, cast


def _check_dtypes(names: tuple[str, ...], tensors: tuple[Tensor, ...], autocast: dtype | None) -> None:
    """One dtype for all; under autocast, one for the caches and ``k, v`` (the storage), and ``q`` in the
    dtype the caches are read in (autocast's, float64 untouched)."""
    if autocast is None:
        if any(t.dtype != tensors[0].dtype for t in tensors[1:]):
            dtypes = ", ".join(f"{n} {t.dtype}" for n, t in zip(names, tensors, strict=True))
            raise AttentionTypeError(f"{', '.join(names)} must share one dtype, got {dtypes}")
        return
    _check_dtypes(names[1:], tensors[1:], None)
    q, k_cache = tensors[0], tensors[1]
    read = k_cache.dtype if k_cache.dtype == torch.float64 else autocast
    if q.dtype != read:
        raise AttentionTypeError(
            f"under torch.autocast to {autocast}, q becomes {q.dtype} but the caches ({k_cache.dtype}) are read "
            f"as {read}: they must agree (float64 is not cast); pass q and the caches in one dtype"
        )


def check_cache_inputs(
    q: object,
    k_cache: object,
    v_cache: object,
    k: object,
    v: object,
    *,
    autocast: dtype | None = None,
    paged: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Shapes, dtypes and devices of the queries, the caches and the new keys and values (``autocast``: the
    autocast dtype :func:`autocast_inputs` cast them for, or None). ``paged``: a ``block_table`` was given,
    so the caches are pools of pages ``(num_blocks, H_kv, page_size, D)`` (:mod:`.pages`), whose dim 0 is
    not the batch."""
    want = _WANT_PAGED if paged else _WANT
    q, k_cache, v_cache = _tensor4("q", q), _tensor4("k_cache", k_cache, want), _tensor4("v_cache", v_cache, want)
    if (k is None) != (v is None):
        raise AttentionValueError(
            f"k and v must be given together (new keys and values to append) or both be None, got "
            f"k {'None' if k is None else 'a tensor'} and v {'None' if v is None else 'a tensor'}"
        )
    new = () if k is None else (_tensor4("k", k), _tensor4("v", v))
    names = ("q", "k_cache", "v_cache", *(("k", "v") if new else ()))
    tensors = (q, k_cache, v_cache, *new)
    _check_dtypes(names, tensors, autocast)
    device = q.device
    if any(t.device != device for t in tensors[1:]):
        devices = ", ".join(f"{n} on {t.device}" for n, t in zip(names, tensors, strict=True))
        raise AttentionValueError(f"{', '.join(names)} must be on one device, got {devices}")
    if paged:  # the pools' dim 0 counts pages; q, k and v carry the batch
        batch = [(n, t) for n, t in zip(names, tensors, strict=True) if n not in ("k_cache", "v_cache")]
        _same(tuple(n for n, _ in batch), tuple(t for _, t in batch), (0,), "batch size B (dim 0)")
        _same(("k_cache", "v_cache"), (k_cache, v_cache), (0, 1, 2), "num_blocks, H_kv and page_size (dims 0-2)")
    else:
        _same(names, tensors, (0,), "batch size B (dim 0)")
        _same(("k_cache", "v_cache"), (k_cache, v_cache), (1, 2), "H_kv and N_max (dims 1 and 2)")
    _same(("q", "k_cache"), (q, k_cache), (3,), "head dimension D (dim 3)")
    if new:
        k_new, v_new = new
        _same(("k", "v"), new, (1, 2), "H_kv and N_new_kv (dims 1 and 2)")
        _same(("k", "k_cache"), (k_new, k_cache), (1, 3), "H_kv and D (dims 1 and 3)")
        _same(("v", "v_cache"), (v_new, v_cache), (1, 3), "H_kv and D_v (dims 1 and 3)")
    check_head_groups(q.shape[1], k_cache.shape[1], lambda: f"q {shape_str(q)}, k_cache {shape_str(k_cache)}")
    return q, k_cache, v_cache, (new[0] if new else None), (new[1] if new else None)


def check_cache_seqlens(
    cache_seqlens: object,
    B: int,
    N_max: int,
    device: torch.device,
    *,
    N_new_kv: int = 0,
    capacity: str = "k_cache.shape[2]",
) -> list[int]:
    """The valid cache entries per batch element, read on the host: an int32/int64 tensor ``(B,)`` on
    ``q``'s device, or one Python int for every element, each in ``[0, N_max]`` and leaving room for the
    ``N_new_kv`` new entries (:func:`check_room`), so that no write passes a cache's end. Reading a CUDA
    tensor waits for the GPU; the Triton path does not call this for one. ``capacity`` says where ``N_max``
    comes from in the errors (a paged cache's is ``block_table.shape[1] * page_size``)."""
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        lengths = [int(cache_seqlens)] * B
        labels = [""] * B  # one int: its errors quote it as it was given
    elif isinstance(cache_seqlens, Tensor):
        check_seqlens_tensor(cache_seqlens, B, device)
        lengths = [int(n) for n in cache_seqlens.tolist()]
        labels = [f"[{b}]" for b in range(B)]
    else:
        raise AttentionTypeError(
            f"cache_seqlens must be an int32/int64 torch.Tensor of shape ({B},) or an int, "
            f"got {type(cache_seqlens).__name__} {cache_seqlens!r}"
        )
    for n, at in zip(lengths, labels, strict=True):
        check_length(n, N_new_kv, N_max, at=at, capacity=capacity)
    return lengths


def check_room(lengths: list[int], N_new_kv: int, N_max: int) -> None:
    """The new keys fit: ``cache_seqlens[b] + N_new_kv <= N_max`` for every batch element."""
    for b, n in enumerate(lengths):
        check_length(n, N_new_kv, N_max, at=f"[{b}]")


def check_length(
    n: int | torch.SymInt, N_new_kv: int, N_max: int, *, at: str = "", capacity: str = "k_cache.shape[2]"
) -> None:
    """One cache length ``cache_seqlens{at} = n`` in ``[0, N_max]``, with room for the ``N_new_kv`` new
    entries. Compared, never hashed, and formatted only to raise, so a symbolic int (``torch.compile``
    with ``dynamic=True``) is guarded on rather than specialised."""
    if n < 0 or n > N_max:
        raise AttentionValueError(
            f"cache_seqlens must lie in [0, N_max] = [0, {int(N_max)}] (N_max = {capacity}), got "
            f"cache_seqlens{at} = {int(n)}"
        )
    if n + N_new_kv > N_max:
        raise AttentionValueError(
            f"cache_seqlens{at} = {int(n)} leaves no room for the N_new_kv={int(N_new_kv)} new entries of k and "
            f"v: {int(n)} + {int(N_new_kv)} > N_max = {int(N_max)} ({capacity}); enlarge the caches or "
            "pass fewer"
        )


def check_seqlens_tensor(cache_seqlens: Tensor, B: int, device: torch.device) -> None:
    """A ``cache_seqlens`` tensor's dtype, shape and device, which need no look at its values."""
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise AttentionTypeError(
            f"cache_seqlens must be int32 or int64, got {cache_seqlens.dtype} with shape {shape_str(cache_seqlens)}"
        )
    if tuple(cache_seqlens.shape) != (B,):
        raise AttentionValueError(
            f"cache_seqlens must have shape ({B},) (one length per batch element of q), got {shape_str(cache_seqlens)}"
        )
    if cache_seqlens.device != device:
        raise AttentionValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {device}")


def lengths_on_host(cache_seqlens: object) -> bool:
    """Whether ``cache_seqlens`` can be checked without waiting for a device: an int, or a CPU tensor
    (:func:`~.inputs.values_on_host`)."""
    return inputs.values_on_host(cache_seqlens)


def check_no_grad_through_write(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor) -> None:
    """Appending writes ``k, v`` into the caches in place, which autograd cannot differentiate through
    (decoding is inference): none of the four may require grad while grad mode is on."""
    if not torch.is_grad_enabled():
        return
    needing = [n for n, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)) if t.requires_grad]
    if needing:
        raise AttentionValueError(
            f"{', '.join(needing)} require{'s' if len(needing) == 1 else ''} grad, but k and v are written into "
            "k_cache and v_cache in place, which is not differentiated (decoding is inference); detach them, "
            "run under torch.no_grad(), or append to the caches yourself and call with k=None, v=None (then "
            "gradients flow to q, k_cache and v_cache)"
        )


def check_num_splits(num_splits: object) -> int:
    """``0`` (choose) or a positive number of key ranges."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise AttentionTypeError(f"num_splits must be an int, got {type(num_splits).__name__} {num_splits!r}")
    if num_splits < 0:
        raise AttentionValueError(f"num_splits must be 0 (choose) or at least 1, got {int(num_splits)}")
    return int(num_splits)


def check_decode_alibi(slopes: object, B: int, H_q: int, device: torch.device) -> Tensor | None:
    """ALiBi slopes ``(H_q,)`` or ``(B, H_q)`` (one row per batch element), floating point, on ``q``'s device:
    the packed call's check (a row per sequence there)."""
    return check_packed_alibi(slopes, B, H_q, device, rows="batch element")
