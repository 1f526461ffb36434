"""The public attention functions: :func:`flash_attention` and the drop-in
:func:`scaled_dot_product_attention`.

Each checks its arguments once (:func:`flashattn_teach._options.make_options`), then asks the planner for a
backend and runs it (:mod:`flashattn_teach.dispatch`); while being compiled it calls its custom op instead
(:mod:`flashattn_teach.ops.attention`), with the same checked arguments. Masks and attention variants
(``window``, ``softcap``, ``alibi_slopes``, ``seqlens_k``, ``attn_mask``; see :mod:`flashattn_teach.masks`)
run tile by tile on every CPU backend and in the "triton" kernels. Dropout is the same on every backend: a
counter-based generator (:mod:`flashattn_teach.dropout`) keyed once per call from torch's generator.
:func:`flashattn_teach.explain` says which backend a call runs, and why.
"""

from __future__ import annotations

from typing import Annotated, Literal, overload

import torch
from torch import Tensor
from typing_extensions import Unpack

from .._autocast import cast_inputs
from .._options import AttentionKeywords, AttentionOptions, make_options
from .._validate.fp8 import Fp8Descale, check_fp8, fp8_call
from .._validate.inputs import check_bool
from .._validate.keywords import Default, collects_keywords
from .._validate.spelling import spelling_hint
from ..dispatch import fp8, planner, runner
from ..ops import attention as ops


class FlashAttentionKeywords(AttentionKeywords, total=False):
    """:func:`flash_attention`'s keywords: the shared ones (:class:`flashattn_teach._options.AttentionKeywords`),
    the backend and FlashAttention-3's FP8 descales."""

    backend: Annotated[str, Default("auto")]
    q_descale: Annotated[Tensor | None, Default(None)]
    k_descale: Annotated[Tensor | None, Default(None)]
    v_descale: Annotated[Tensor | None, Default(None)]


# The one pair of signatures kept written out: return_lse decides the result's type, which mypy reads from them.
@overload
def flash_attention(
    q: Tensor, k: Tensor, v: Tensor, *, return_lse: Literal[False] = False, **options: Unpack[FlashAttentionKeywords]
) -> Tensor: ...
@overload
def flash_attention(
    q: Tensor, k: Tensor, v: Tensor, *, return_lse: Literal[True], **options: Unpack[FlashAttentionKeywords]
) -> tuple[Tensor, Tensor]: ...


@collects_keywords(hints={"is_causal": ("causal", "torch's scaled_dot_product_attention's spelling")}, enable_gqa=True)
def flash_attention(
    q: Tensor, k: Tensor, v: Tensor, *, options: FlashAttentionKeywords, return_lse: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention without storing the ``N_q x N_k`` score matrix, in torch's layout: ``q`` is
    ``(B, H, N, D)`` (heads before tokens), as torch's SDPA, though the name and the keywords are flash-attn's.
    flash-attn's ``(B, N, H, D)`` layout, with its functions' names, arguments and return values, is
    :mod:`flashattn_teach.flash_attn_interface` (``flash_attn_func`` and the rest); a ``(B, N, H, D)`` tensor
    passed here is read as N heads of H tokens, a result of the right shape and the wrong values.

    Args:
        q: ``(..., H_q, N_q, D)``; k: ``(..., H_kv, N_k, D)``; v: ``(..., H_kv, N_k, D_v)``.
        causal: causal masking; ``causal_align`` is ``"top_left"`` (torch: query i sees keys j <= i) or
            ``"bottom_right"`` (flash-attn: j <= i + N_k - N_q, as in a decode step against a KV cache;
            ``N_k`` is ``seqlens_k[b]`` when given).
        scale: softmax scale, default ``1 / sqrt(D)``.
        enable_gqa: allow fewer key/value heads than query heads (on by default, as in flash-attn).
        window: ``(left, right)``, flash-attn's sliding window: query i sees keys
            ``i + off - left <= j <= i + off + right`` (``off`` = 0 for ``top_left``, ``N_k - N_q`` for
            ``bottom_right``, and with ``seqlens_k`` each batch element's own ``seqlens_k[b] - N_q``, as
            flash-attn aligns; -1: unbounded on that side). ``causal=True`` is ``right = 0``.
        softcap: scores become ``softcap * tanh(score / softcap)``, after scaling, before any bias or mask.
        alibi_slopes: ``(H_q,)`` or ``(*batch, H_q)``: ``-slope * |i + off - j|`` added to the scores.
        seqlens_k: integer tensor of the batch shape (``(B,)`` for 4-D inputs): keys
            ``j >= seqlens_k[b]`` are invisible (right padding).
        attn_mask: bool (True = visible) or additive, broadcast to ``(..., H_q, N_q, N_k)`` as torch's SDPA.
            See :mod:`flashattn_teach.masks` for how these compose and how tiles are skipped.
        dropout_p: zero each attention weight with this probability and scale the rest by
            ``1 / (1 - dropout_p)`` (``lse`` stays undropped), tile by tile inside the online update. The
            mask comes from a counter-based generator (:mod:`flashattn_teach.dropout`) keyed once per call
            from torch's default generator, so ``torch.manual_seed`` makes calls repeatable; the backward
            draws it again rather than storing it.
        deterministic: a bitwise reproducible backward (flash-attn's argument). The Triton backward by
            default adds dQ by fp32 atomic adds in one kernel, whose rounding varies from run to run; this
            runs its two-kernel backward instead, as ``torch.use_deterministic_algorithms(True)`` does (read
            when the backward runs). The CPU backends are deterministic either way.
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied after the
            scale, the softcap and the built-in biases (ALiBi, an additive ``attn_mask``), before every mask;
            ``b`` is the flat batch index, ``h`` the query head. Run on each tile's broadcast index tensors
            (``q_idx (Br, 1)``, ``kv_idx (1, Bc)``; :mod:`flashattn_teach.flex.mods`); the backward
            differentiates through it, and tensors it captures that require grad get their gradients.
        mask_mod: FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True: visible), combined with
            the other masks; its tiles are classified first (:func:`flashattn_teach.create_block_mask`), so
            tiles it hides are skipped and tiles it shows whole run without it.
        block_mask: a :class:`flashattn_teach.BlockMask` instead of ``mask_mod`` (it carries its own).
        sinks: attention sinks (GPT-OSS's ``s_aux``), ``(H_q,)``: one learned logit per query head that
            every row's softmax counts as one more key, of value zero: ``lse_i = log(sum_j exp(S_ij) +
            exp(sink_h))``, ``O_i = sum_j exp(S_ij - lse_i) V_j``. ``S_ij`` is the scaled, capped and biased
            score; the sink itself is neither scaled, capped, biased nor masked. A row that sees no key gives
            ``O = 0``, ``lse = sink_h``. Differentiable (``dsink`` in ``sinks``' dtype).
        backend: one of ``"auto", "triton", "parallel", "query_major", "key_major", "dense"``; see
            :func:`explain`.
        return_lse: also return ``lse`` of shape ``(..., H_q, N_q)`` (float32, float64 for float64 inputs).
        q_descale, k_descale, v_descale: FlashAttention-3's FP8 forward: with ``q, k, v`` in
            ``torch.float8_e4m3fn`` (4-D ``(B, H, N, D)``), float32 ``(B, H_kv)`` factors (None: 1) such that
            the inputs meant are ``q * q_descale[b, h // G]`` and likewise for k and v. The output is then
            bfloat16, forward only (gradients are refused), without dropout, ``attn_mask`` or user functions;
            the kernel runs on sm_90, and every CPU backend runs its emulation
            (:mod:`flashattn_teach.reference.fp8`; :mod:`flashattn_teach._validate.fp8` has the convention).

    Returns:
        ``O`` of shape ``(..., H_q, N_q, D_v)`` in ``q``'s dtype (the autocast dtype under
        ``torch.autocast``, as torch's SDPA) and, with ``return_lse``, ``lse``. Differentiable on every
        backend, also under the torch.func transforms on the CPU backends; a query row that sees no key
        gives 0 (and ``lse = -inf``).
    """
    descale = check_descales(q, k, v, options)
    if descale is None:  # e4m3 inputs stay e4m3 under torch.autocast (their descales define them)
        q, k, v = cast_inputs(q, k, v)
    opts = make_options(q, k, v, options, descale=descale)
    lse_wanted = check_bool("return_lse", return_lse)
    backend = planner.public_backend(options["backend"])
    if descale is not None:
        O, lse = _run_fp8(backend, q, k, v, opts)
    elif opts.mask.mods is not None:
        # user functions cannot be arguments of the custom op: the call runs eagerly, also under torch.compile
        O, lse = _run_eagerly(planner.plan(q, k, v, opts, backend), q, k, v, opts)
    elif torch.compiler.is_compiling() and ops.traceable(options["attn_mask"], options["alibi_slopes"]):
        # one opaque op in the graph instead of the traced tile loops, called with the checked arguments
        scale_given, alibi_slopes, seqlens_k = (
            options["scale"] is not None,
            options["alibi_slopes"],
            options["seqlens_k"],
        )
        args = ops.AttentionArgs.of_call(
            opts, backend, scale_given=scale_given, alibi_slopes=alibi_slopes, seqlens_k=seqlens_k
        )
        O, lse = ops.call(q, k, v, args)
    else:
        O, lse = runner.run(planner.plan(q, k, v, opts, backend), q, k, v, opts, lse_wanted)
    return (O, lse) if lse_wanted else O


def check_descales(q: Tensor, k: Tensor, v: Tensor, options: FlashAttentionKeywords) -> Fp8Descale | None:
    """An FP8 call's descales, checked (:func:`flashattn_teach._validate.fp8.check_fp8`), refusing by name what
    the FP8 forward does not take; None for any other call (asked first, before the refusals are gathered)."""
    descales = (options["q_descale"], options["k_descale"], options["v_descale"])
    if not fp8_call(q, k, v, descales):
        return None
    refused = {
        "dropout_p": options["dropout_p"] != 0.0,
        "attn_mask": options["attn_mask"] is not None,
        "score_mod": options["score_mod"] is not None,
        "mask_mod": options["mask_mod"] is not None,
        "block_mask": options["block_mask"] is not None,
    }
    return check_fp8(q, k, v, descales, refused=refused)


def _run_eagerly(p: planner.Plan, q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions) -> tuple[Tensor, Tensor]:
    """``runner.run``, outside the graph while compiling (disabling at import would import dynamo, and
    with it triton, for every user of the package)."""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(runner.run)(p, q, k, v, opts)
    return runner.run(p, q, k, v, opts)


def _run_fp8(backend: str, q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions) -> tuple[Tensor, Tensor]:
    """An FP8 call by its own plan (:mod:`flashattn_teach.dispatch.fp8`), outside the graph while compiling
    (the custom op's schema carries no descales)."""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_run_fp8)(backend, q, k, v, opts)
    return fp8.run_fp8(fp8.plan_fp8(q, opts, backend), q, k, v, opts)


@spelling_hint("causal", "is_causal", whose="flash-attn's and flashattn_teach.flash_attention's spelling")
def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``: same signature and behaviour.

    ``query (..., H_q, L, E)``, ``key (..., H_kv, S, E)``, ``value (..., H_kv, S, E_v)`` ->
    ``(..., H_q, L, E_v)``. ``attn_mask`` is bool (True = take part) or additive (the query's dtype or
    float32), broadcast to ``(..., L, S)``; with ``is_causal=True`` as well, both apply, as in torch's CPU
    SDPA. Heads broadcast as in torch. ``dropout_p`` applies whenever it is above 0, as in torch (SDPA has
    no training flag: pass 0 in eval), from this library's counter-based generator, so the mask differs from
    torch's for the same seed. Calls with a mask that requires grad run on the dense path; the rest, masks
    and dropout included, run on a path that never stores the score matrix, a mask read tile by tile
    (:func:`explain` tells which). torch's signature has no ``deterministic``: as in torch, the global
    ``torch.use_deterministic_algorithms(True)`` makes the Triton backward the bitwise reproducible one
    (:func:`flash_attention`'s ``deterministic``). Errors are both
    ``RuntimeError`` (as torch raises) and ``ValueError``/``TypeError``; the README lists where this
    function deliberately differs from torch.
    """
    query, key, value = cast_inputs(query, key, value)
    opts = make_options(
        query,
        key,
        value,
        causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        causal_name="is_causal",
    )
    if torch.compiler.is_compiling() and ops.traceable(attn_mask, None):
        args = ops.AttentionArgs.of_call(opts, "auto", scale_given=scale is not None, alibi_slopes=None, seqlens_k=None)
        O, _ = ops.call(query, key, value, args)
    else:
        O, _ = runner.run(planner.plan(query, key, value, opts), query, key, value, opts, False)  # lse unread
    return O
