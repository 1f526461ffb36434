"""Attention over packed sequences as one torch operator, so one compiled graph serves every packing.

Traced through as Python, :func:`flashattn_teach.flash_attention_varlen` reads ``cu_seqlens`` into Python
ints (to check them and to build the mask contract's per-sequence tiles), so ``torch.compile`` guards on
every sequence bound and recompiles for each new packing. As an op, the bounds stay tensors that the graph
never looks into, ``max_seqlen_q, max_seqlen_k`` stay symbolic ints (nothing in the graph branches on
them), and the outputs' shapes come from ``q`` and ``v`` alone::

    flashattn_teach::attention_varlen(q, k, v, <VarlenArgs>) -> (O (total_q, H_q, D_v), lse (H_q, total_q))
    flashattn_teach::attention_varlen_backward(dO, dlse, q, k, v, <VarlenArgs>) -> (dq, dk, dv)

The implementation checks the bounds' values, builds the packed options and runs the dispatcher (the
Triton varlen kernels for CUDA tensors they can run, the CPU paths otherwise); the backward recomputes the
forward under autograd and differentiates it (``grads.py``). Slopes that need a gradient (only the dense
path gives one) are traced through instead. Dropout is keyed as in :mod:`flashattn_teach.ops.attention`:
the caller draws the seed as a tensor (:func:`flashattn_teach.ops.attention.dropout_seed`) and the op and
its backward build the same ``DropoutKey`` from it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, cast

import torch
from torch import Tensor

from .._layout import compute_dtype
from .._options import AttentionOptions, PackedKeywords, make_packed_options
from .._validate.keywords import keyword_table
from .._validate.varlen import PackedBounds, check_packed_qkv
from ..dispatch import planner, runner
from ..dispatch.carry import Carries, always, uncarried, unset
from ..dropout import DropoutKey
from ..errors import AttentionTypeError, AttentionValueError
from .attention import dropout_seed
from .grads import recomputed_grads
from .schema import op_args, op_schema, unused


@dataclass(frozen=True)
class VarlenArgs:
    """The arguments of ``flashattn_teach::attention_varlen`` after ``q, k, v``: the sequence bounds as
    given (checked when the op runs), the slopes, the checked options, dropout's probability and seed, and
    ``deterministic`` (last, with its default, so call sites from before it still work)."""

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    alibi_slopes: Tensor | None
    causal: bool
    causal_align: str
    scale: float | None
    window: list[int] | None
    softcap: float | None
    backend: str
    dropout_p: float = 0.0
    dropout_seed: Tensor | None = None
    deterministic: bool = False

    def keywords(self) -> PackedKeywords:
        """The packed call's keywords this record holds (:data:`KEYWORDS`), by name; ``window`` a pair again."""
        options = {name: getattr(self, name) for name in KEYWORDS}
        options["window"] = None if self.window is None else (self.window[0], self.window[1])
        return cast(PackedKeywords, options)


# The keywords of a packed call that the op's record holds, by name: every one but sinks, which the schema
# has not (of_call declines a call with them).
KEYWORDS = tuple(name for name in keyword_table(PackedKeywords) if name in {f.name for f in fields(VarlenArgs)})


# What the op carries of the options of the (H, total, D) views (dispatch/carry.py); the op's body
# rebuilds them with make_packed_options. of_call declines anything else: the call then runs eagerly.
OP_OPTIONS: Carries = {
    "shapes": always,  # rebuilt from q, k, v; the scale below
    "mask": always,  # OP_MASK
    "causal_align": always,
    "enable_gqa": lambda o: o.enable_gqa,  # make_packed_options sets it
    "dropout_p": always,
    "dropout_key": unset("dropout_key"),  # the op draws its own seed (of_call); a key drawn before would be lost
    "deterministic": always,
    "descale": unset("descale"),  # the schema has no descales
    "sinks": unset("sinks"),  # nor sinks
}
OP_MASK: Carries = {
    "shapes": always,
    "offset": always,  # causal_align's (make_options without an offset), which the op carries
    "causal": always,
    "left": always,  # window
    "right": always,
    "softcap": always,
    "alibi_slopes": unset("alibi_slopes"),  # the op takes the caller's slopes, per sequence, as its own argument
    "seqlens_k": unset("seqlens_k"),
    "attn_mask": unset("attn_mask"),
    "packed": unset("packed"),  # the op packs from its bounds
    "per_element": lambda spec: not spec.per_element,
    "dtype": always,  # the compute dtype of q's, which the op gets
    "mods": unset("mods"),
    "_tilings": always,  # a cache
}


def of_call(
    bounds: PackedBounds,
    alibi_slopes: Tensor | None,
    opts: AttentionOptions,
    backend: str,
    *,
    scale_given: bool,
) -> VarlenArgs | None:
    """The op's arguments for a call's ``bounds = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k)`` and checked scalar options (of the ``(H, total, D)`` views); the seed is drawn here.
    None when the options hold something the op does not carry (:data:`OP_OPTIONS`, :data:`OP_MASK`)."""
    spec = opts.mask
    if uncarried(opts, OP_OPTIONS) or uncarried(spec, OP_MASK):
        return None
    return VarlenArgs(
        *bounds,
        alibi_slopes=alibi_slopes,
        causal=opts.causal,
        causal_align=opts.causal_align,
        scale=opts.scale if scale_given else None,  # None: the op takes 1 / sqrt(D), no square root in the graph
        window=None if spec.left == spec.right == -1 else [spec.left, spec.right],
        softcap=spec.softcap,
        backend=backend,
        dropout_p=opts.dropout_p,
        dropout_seed=dropout_seed(opts.dropout_p),
        deterministic=opts.deterministic,
    )


def _eager(q: Tensor, k: Tensor, v: Tensor, a: VarlenArgs) -> tuple[Tensor, Tensor]:
    """The eager call the op stands for (the bounds' values checked), with the dropout key of the seed."""
    if a.dropout_p > 0.0 and a.dropout_seed is None:
        raise AttentionValueError(f"dropout_p={a.dropout_p} needs a dropout_seed (an int64 tensor)")
    bounds = PackedBounds(a.cu_seqlens_q, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k)
    qh, kh, vh, opts = make_packed_options(q, k, v, bounds, a.keywords())
    if a.dropout_seed is not None and opts.dropout_p > 0.0:
        opts = opts.with_dropout(DropoutKey(opts.dropout_p, seed=int(a.dropout_seed)))
    O, lse = runner.run(planner.plan(qh, kh, vh, opts, a.backend), qh, kh, vh, opts)
    return O.transpose(0, 1).contiguous(), lse  # (H_q, total_q, D_v) -> (total_q, H_q, D_v)


_LEADING = "Tensor q, Tensor k, Tensor v"


@torch.library.custom_op(
    "flashattn_teach::attention_varlen",
    mutates_args=(),
    schema=op_schema(VarlenArgs, _LEADING, "(Tensor, Tensor)"),
)
def attention_varlen(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of :func:`flashattn_teach.flash_attention_varlen` for the arguments :class:`VarlenArgs`
    names, dropout keyed by ``dropout_seed`` (needed when ``dropout_p > 0``)."""
    with torch.no_grad():
        return _eager(q, k, v, VarlenArgs(*args))


@attention_varlen.register_fake
def _attention_varlen_fake(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    """``O (total_q, H_q, D_v)`` in ``q``'s dtype and ``lse (H_q, total_q)`` in the compute dtype, from the
    shapes alone, which are checked here, at trace time, as the eager call checks them (here rather than
    in the traced caller, where some torch versions replace an error's message by their own)."""
    a = VarlenArgs(*args)
    check_packed_qkv(q, k, v)
    _check_bounds("cu_seqlens_q", a.cu_seqlens_q, q.device)
    _check_bounds("cu_seqlens_k", a.cu_seqlens_k, q.device)
    total_q, H_q, _ = q.shape
    return q.new_empty(total_q, H_q, v.shape[2]), q.new_empty(H_q, total_q, dtype=compute_dtype(q.dtype))


@torch.library.custom_op(
    "flashattn_teach::attention_varlen_backward",
    mutates_args=(),
    schema=op_schema(VarlenArgs, "Tensor dO, Tensor dlse, " + _LEADING, "(Tensor, Tensor, Tensor)"),
)
def attention_varlen_backward(
    dO: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor, *args: Any
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` for the gradients ``dO`` of ``O`` and ``dlse`` of ``lse``, in the inputs' shapes; the
    forward's dropout mask drawn again from the same ``dropout_seed``."""
    a = VarlenArgs(*args)
    return recomputed_grads(lambda q, k, v: _eager(q, k, v, a), q, k, v, dO, dlse)


@attention_varlen_backward.register_fake
def _attention_varlen_backward_fake(
    dO: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor, *_: Any
) -> tuple[Tensor, ...]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, *args = inputs
    a = VarlenArgs(*args)
    ctx.save_for_backward(q, k, v, a.cu_seqlens_q, a.cu_seqlens_k, a.alibi_slopes, a.dropout_seed)
    ctx.args = a


def _backward(ctx: Any, dO: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, seed = ctx.saved_tensors
    saved = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "alibi_slopes": alibi_slopes}
    a = VarlenArgs(**{**ctx.args.__dict__, **saved, "dropout_seed": seed})
    grads = attention_varlen_backward(dO, dlse, q, k, v, *op_args(a))
    return (*grads, *unused(VarlenArgs))  # no gradient into the bounds, slopes, options or the seed


attention_varlen.register_autograd(_backward, setup_context=_setup_context)


def _check_bounds(name: str, cu: Tensor, device: torch.device) -> None:
    """What can be checked of ``cu_seqlens`` without reading it: a 1-D int32/int64 tensor on ``q``'s device
    (its values are checked by the eager call, when the op runs)."""
    if cu.dtype not in (torch.int32, torch.int64):
        raise AttentionTypeError(f"{name} must be int32 or int64, got {cu.dtype} with shape {tuple(cu.shape)}")
    if cu.dim() != 1:
        raise AttentionValueError(f"{name} must be 1-D of shape (B + 1,), got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise AttentionValueError(f"{name} is on {cu.device} but q is on {device}")


def call(q: Tensor, k: Tensor, v: Tensor, a: VarlenArgs) -> tuple[Tensor, Tensor]:
    """The op, called with a record: what ``flash_attention_varlen`` being compiled runs."""
    O, lse = attention_varlen(q, k, v, *op_args(a))
    return O, lse
