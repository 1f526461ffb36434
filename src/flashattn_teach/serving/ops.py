"""One decode step as one torch operator, so a compiled decode loop is one graph for every step.

Traced through as Python, :func:`flashattn_teach.flash_attention_with_kvcache` reads ``cache_seqlens``
into Python ints (a loop over the batch, a split per range), so ``torch.compile`` guards on the cache
lengths and recompiles at every step, when they grow by one. As an op, the lengths stay a tensor that the
graph never looks into: one graph serves every step and every cache length, and the op's outputs have the
shapes of ``q``, whatever the lengths::

    flashattn_teach::attention_with_kvcache(q, k_cache!, v_cache!, <DecodeArgs>) -> (O, lse)

(with ``block_table`` the caches are pools of pages and ``DecodeArgs`` carries the table, ``cache_leftpad``
and ``sinks``: tensors the graph passes through untouched, as the lengths)

``!``: the op writes ``k, v`` into the caches in place (``mutates_args``), as the eager call does, so the
compiled graph knows the caches change and functionalizes the write. Its implementation is the eager call
(whichever backend that picks, the Triton decode kernel included); its fake implementation gives the
output shapes from ``q`` and ``v_cache`` alone, symbolic in every size.

Decoding is inference: the op has no autograd registration (the eager call does not differentiate the
in-place write either). A call being compiled that needs a gradient, into ``q`` or a cache read without
new keys, is put in the graph instead as torch ops (:func:`traced_step`): the new entries put into copies
of the caches, :func:`flashattn_teach.flash_attention`, whose own op is differentiated, over all ``N_max``
keys with a mask built in the graph from the lengths, then the in-place write; that graph too serves every
length.

Both check what the eager call checks while the call is traced, as far as that needs no look at a
tensor's values (so a bad option raises the eager call's error): the options, and an int
``cache_seqlens``. The op checks the rest when it runs, with the eager call's messages; the traced path
checks a tensor's lengths in the graph (``torch._assert_async``: a ``RuntimeError`` naming
``cache_seqlens`` when the graph runs, before the write).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Any, cast

import torch
from torch import Tensor

from .._layout import compute_dtype
from .._options import DecodeKeywords
from .._validate.inputs import check_bool, check_scale, check_softcap, check_window
from .._validate.keywords import keyword_table
from ..errors import AttentionTypeError, AttentionValueError
from ..ops.schema import op_args, op_schema
from .checks import check_length, check_num_splits
from .ops_traced import traced_step
from .step import DecodeCall, decode_step


@dataclass(frozen=True)
class DecodeArgs:
    """The arguments of ``flashattn_teach::attention_with_kvcache`` after ``q, k_cache, v_cache`` (which the
    op writes in place): the new entries, the lengths as a ``(B,)`` tensor, the slopes, the options and the
    dtype the caller's autocast cast ``q`` for (the compiled graph may run without autocast), or None."""

    k: Tensor | None
    v: Tensor | None
    cache_seqlens: Tensor
    alibi_slopes: Tensor | None
    causal: bool
    scale: float | None
    window: list[int] | None
    softcap: float | None
    num_splits: int
    backend: str
    autocast: torch.dtype | None
    block_table: Tensor | None = None  # (B, max_blocks): k_cache and v_cache are pools of pages
    cache_leftpad: Tensor | None = None  # (B,)
    sinks: Tensor | None = None  # (H_q,)

    @classmethod
    def of_call(cls, call: DecodeCall, cache_seqlens: Tensor) -> DecodeArgs:
        """The op's record of a call: each field the keyword of its name, but the new entries, the lengths
        as a ``(B,)`` tensor, the window as a list (the schema's ``SymInt[]``) and the autocast dtype."""
        given = cast(dict[str, Any], call.options)  # read by field name
        window = call.options["window"]
        own: dict[str, Any] = {
            "k": call.k,
            "v": call.v,
            "cache_seqlens": cache_seqlens,
            "window": None if window is None else list(window),
            "autocast": call.autocast,
        }
        return cls(*[own[name] if name in own else given[name] for name in _FIELDS])

    def call(self) -> DecodeCall:
        """The call this record stands for, ``lse`` returned: what the op's body runs."""
        options = {name: getattr(self, name) for name in KEYWORDS}
        options["window"] = None if self.window is None else (self.window[0], self.window[1])
        return DecodeCall(self.k, self.v, cast(DecodeKeywords, options), True, self.autocast)


_FIELDS = tuple(f.name for f in fields(DecodeArgs))
KEYWORDS = tuple(keyword_table(DecodeKeywords))  # each one a field of DecodeArgs


@torch.library.custom_op(
    "flashattn_teach::attention_with_kvcache",
    mutates_args=("k_cache", "v_cache"),
    schema=op_schema(DecodeArgs, "Tensor q, Tensor(a1!) k_cache, Tensor(a2!) v_cache", "(Tensor, Tensor)"),
)
def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of :func:`flashattn_teach.flash_attention_with_kvcache` for the arguments
    :class:`DecodeArgs` names; ``k, v`` written into ``k_cache, v_cache`` in place."""
    with torch.no_grad():
        O, lse = decode_step(q, k_cache, v_cache, DecodeArgs(*args).call())
    return O, lse


@attention_with_kvcache.register_fake
def _attention_with_kvcache_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    """``O (B, H_q, N_new, D_v)`` in ``q``'s dtype and ``lse (B, H_q, N_new)`` in the compute dtype, from
    the shapes alone. ``cache_seqlens`` is checked here, at trace time, as far as it can be without reading
    it (here rather than in the traced caller, where some torch versions replace an error's message by
    their own); the rest, the shapes of ``q`` and the caches included, is checked by the eager call when
    the op runs, with its messages."""
    cache_seqlens = DecodeArgs(*args).cache_seqlens
    B, H_q, N_new, _ = q.shape
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise AttentionTypeError(f"cache_seqlens must be int32 or int64, got {cache_seqlens.dtype}")
    if cache_seqlens.shape != (B,):
        raise AttentionValueError(f"cache_seqlens must have shape ({B},), got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise AttentionValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
    return q.new_empty(B, H_q, N_new, v_cache.shape[3]), q.new_empty(B, H_q, N_new, dtype=compute_dtype(q.dtype))


def _int_or_tensor(cache_seqlens: object, B: int) -> Tensor | int | torch.SymInt:
    """``cache_seqlens`` as a tensor, an int (a numpy int becomes one) or a symbolic int (``dynamic=True``),
    else the eager call's error."""
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        return int(cache_seqlens)
    if isinstance(cache_seqlens, Tensor | torch.SymInt):
        return cache_seqlens
    raise AttentionTypeError(
        f"cache_seqlens must be an int32/int64 torch.Tensor of shape ({int(B)},) or an int, "
        f"got {type(cache_seqlens).__name__} {cache_seqlens!r}"
    )


def _seqlens_tensor(cache_seqlens: Tensor | int | torch.SymInt, B: int, device: torch.device) -> Tensor:
    """``cache_seqlens`` as the op takes it, a ``(B,)`` tensor: one int (symbolic under ``dynamic=True``)
    becomes one."""
    if isinstance(cache_seqlens, Tensor):
        return cache_seqlens
    return torch.full((B,), cast(int, cache_seqlens), dtype=torch.int64, device=device)  # (B,): one length each


def traceable(*tensors: object) -> bool:
    """Whether a call being compiled can be this op: not when grad mode is on and an input requires grad
    (the op is not differentiated; such calls are built from torch ops instead: ``decode_traced.py``)."""
    return not (torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors))


def compiled_step(q: Tensor, k_cache: Tensor, v_cache: Tensor, call: DecodeCall) -> Tensor | tuple[Tensor, Tensor]:
    """One call of ``flash_attention_with_kvcache`` while it is compiled or exported: the op, or with a
    gradient wanted :func:`traced_step`; a tensor or an int ``cache_seqlens`` both give one graph for every
    length."""
    o = call.options
    check_bool("causal", o["causal"])
    lse_wanted = check_bool("return_lse", call.return_lse)
    check_window(o["window"])
    check_softcap(o["softcap"])
    check_num_splits(o["num_splits"])
    if o["scale"] is not None:
        check_scale(o["scale"], 1)  # the default depends on D alone, which the op's checks see
    k, block_table = call.k, o["block_table"]
    lengths = _int_or_tensor(o["cache_seqlens"], q.shape[0])
    shapes_known = isinstance(k_cache, Tensor) and (k is None or isinstance(k, Tensor))  # else checked later
    if not isinstance(lengths, Tensor) and shapes_known:
        paged = isinstance(block_table, Tensor) and block_table.dim() == 2
        pages = block_table.shape[1] if isinstance(block_table, Tensor) and paged else 1
        N_max = pages * k_cache.shape[2]  # paged: max_blocks pages of page_size slots
        capacity = "block_table.shape[1] * page_size" if paged else "k_cache.shape[2]"
        check_length(lengths, 0 if k is None else k.shape[2], N_max, capacity=capacity)
    if not traceable(q, k_cache, v_cache, k, call.v, o["alibi_slopes"], o["sinks"]):
        O, lse = traced_step(q, k_cache, v_cache, call, lengths)
        return (O, lse) if lse_wanted else O
    args = DecodeArgs.of_call(call, _seqlens_tensor(lengths, q.shape[0], q.device))
    O, lse = attention_with_kvcache(q, k_cache, v_cache, *op_args(args))
    return (O, lse) if lse_wanted else O
