"""``flex_attention``: PyTorch FlexAttention's function, run by this library's kernels and CPU paths.

Code written for ``torch.nn.attention.flex_attention`` runs with the import changed::

    from flashattn_teach import create_block_mask, flex_attention

    def document(b, h, q_idx, kv_idx):
        return doc_id[b, q_idx] == doc_id[b, kv_idx]

    block_mask = create_block_mask(document, B, None, N, N, device=q.device)
    out = flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + bias[h], block_mask=block_mask)

It is :func:`flashattn_teach.flash_attention` with ``score_mod`` and ``block_mask`` (and FlexAttention's
defaults: no GQA unless asked, no causal flag: causality is a ``mask_mod``), so every backend runs it:
the Triton kernels with the functions translated into ``@triton.jit`` code (no ``torch.compile``), and
every CPU path with the functions evaluated tile by tile, forward and backward. Differences from torch's
are listed in the README ("Programmable attention").
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from .._validate.inputs import check_bool
from ..errors import AttentionTypeError, AttentionValueError, BackendUnavailableError
from ..flex.mods import BlockMask, ScoreMod
from .attention import flash_attention

# torch's kernel_options (``FlexKernelOptions`` and the inductor templates that read them), sorted by what
# they do to the numbers. Tuning knobs pick the generated kernel's tiles, warps, pipelining, TMA, where dQ is
# scattered, or which kernel runs: never a value, so they are accepted and ignored (this library picks its
# own tiles). A "fwd_"/"bwd_" prefix aims one at one pass.
TUNING_OPTIONS = frozenset(
    "num_warps num_stages BLOCK_M BLOCK_N BLOCK_M1 BLOCK_N1 BLOCK_M2 BLOCK_N2 WRITE_DQ USE_TMA "
    "FORCE_USE_FLEX_ATTENTION BACKEND kpack matrix_instr_nonkdim waves_per_eu".split()
)
# Promises about the mask (every row sees a key; the blocks are contiguous) that let torch's kernel skip a
# check: the value is the same whenever the promise holds (torch's is undefined when it does not), and this
# library keeps its checks, so they are accepted.
PROMISE_OPTIONS = frozenset({"ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS"})
# PRESCALE_QK=True multiplies q by scale / ln 2 before the product (templates/common.py.jinja), so score_mod
# is called on the score in log2 units and its result read in them: f(s / ln 2) ln 2 instead of f(s), a
# different value for all but linear functions. Accepted without a score_mod (the same value, rounded
# differently), refused with one. OUTPUT_LOGSUMEXP and OUTPUT_MAX torch sets itself and refuses from callers.
TORCH_BACKENDS = ("AUTO", "TRITON", "FLASH", "TRITON_DECODE")


def check_kernel_options(kernel_options: object, score_mod: object) -> None:
    """Accept torch's ``kernel_options`` that change no value; refuse by name the ones that would."""
    if kernel_options is None:
        return
    if not isinstance(kernel_options, Mapping):
        raise AttentionTypeError(
            f"kernel_options must be a dict of torch's FlexKernelOptions or None, got {type(kernel_options).__name__}"
        )
    for name, value in kernel_options.items():
        base = name.removeprefix("fwd_").removeprefix("bwd_") if isinstance(name, str) else name
        if base in TUNING_OPTIONS or name in PROMISE_OPTIONS:
            continue
        if name == "PRESCALE_QK":
            if value and score_mod is not None:
                raise BackendUnavailableError(
                    "kernel_options PRESCALE_QK=True makes torch call score_mod on scores in log2 units (q "
                    "pre-scaled by scale / ln 2), which changes its value for any score_mod that is not linear; "
                    "this library calls score_mod on the scaled score: drop PRESCALE_QK (torch's default, False)"
                )
            continue
        if name in ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX"):
            raise AttentionValueError(
                f"kernel_options {name} is set by flex_attention itself, as in torch: ask for the log-sum-exp "
                "with return_aux=AuxRequest(lse=True)"
            )
        raise AttentionValueError(
            f"kernel_options {name!r} is not one of torch's FlexKernelOptions this library knows; the accepted "
            f"ones change no value: {sorted(TUNING_OPTIONS | PROMISE_OPTIONS | {'PRESCALE_QK'})}"
        )
    backend = kernel_options.get("BACKEND")
    if backend is not None and backend not in TORCH_BACKENDS:
        raise AttentionValueError(f"kernel_options BACKEND must be one of {TORCH_BACKENDS}, got {backend!r}")
    if backend is not None and kernel_options.get("FORCE_USE_FLEX_ATTENTION"):
        raise AttentionValueError(
            "kernel_options BACKEND cannot be combined with FORCE_USE_FLEX_ATTENTION (as in torch): keep BACKEND"
        )


def in_query_layout(out: Tensor, query: Tensor) -> Tensor:
    """``out`` with its dims laid out in memory in the order the query's are, as torch's eager flex_attention
    returns it: dims ordered by the query's strides (on a tie the later dim inner, as torch), with the last
    dim moved innermost when its stride would not be 1."""
    if out.dim() != query.dim():
        return out
    order = sorted(range(query.dim()), key=lambda d: (query.stride(d), -d))  # innermost first
    strides = _strides(out.shape, order)
    if strides[-1] != 1:
        order.remove(out.dim() - 1)
        strides = _strides(out.shape, [out.dim() - 1, *order])
    if tuple(strides) == out.stride():
        return out
    return out.new_empty_strided(out.shape, strides).copy_(out)


def _strides(shape: tuple[int, ...] | Any, order: list[int]) -> list[int]:
    """The strides of a dense tensor of ``shape`` whose dims are laid out ``order[0]`` innermost."""
    strides, step = [0] * len(shape), 1
    for d in order:
        strides[d], step = step, step * shape[d]
    return strides


def _refuse_sliced_mask_mod(block_mask: object) -> None:
    """An indexed block mask's ``mask_mod`` is a stub until one is assigned: refused here before any tile,
    as torch's flex_attention refuses it."""
    mask_mod = getattr(block_mask, "mask_mod", None)
    if getattr(mask_mod, "__name__", None) == "_sliced_mask_mod_error":
        raise AttentionValueError(
            "Cannot use mask_mod from a sliced BlockMask: block_mask was indexed (block_mask[...]), which "
            "resets its mask_mod, as torch's does: assign one "
            "from the original mask before the call, sliced.mask_mod = original.mask_mod (offset by the "
            "indices the slice starts at when the function reads b, h or q_idx)"
        )


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict[str, Any] | None = None,
    *,
    return_aux: Any = None,
) -> Tensor | tuple[Tensor, Any]:
    """Drop-in for ``torch.nn.attention.flex_attention.flex_attention``.

    Args:
        query: ``(B, H_q, N_q, D)``; key: ``(B, H_kv, N_k, D)``; value: ``(B, H_kv, N_k, D_v)`` (other
            ranks broadcast as in :func:`flashattn_teach.flash_attention`).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, on the scaled scores; tensors it
            captures that require grad get gradients.
        block_mask: from :func:`flashattn_teach.create_block_mask`; its ``mask_mod`` runs on its partial
            blocks only, its empty blocks are skipped.
        scale: default ``1 / sqrt(D)``.
        enable_gqa: allow ``H_kv`` to divide ``H_q`` (query head ``h`` reads key/value head
            ``h // (H_q // H_kv)``).
        return_lse: also return ``lse`` (natural log, ``(B, H_q, N_q)``, float32; float64 for float64).
            Deprecated in torch: a ``FutureWarning`` says to use ``return_aux``, as torch's does.
        kernel_options: torch's options for its generated kernel: those that change no value (tile sizes,
            warps, stages, FORCE_USE_FLEX_ATTENTION, BACKEND, the mask promises ROWS_GUARANTEED_SAFE and
            BLOCKS_ARE_CONTIGUOUS, PRESCALE_QK without a score_mod) are accepted and ignored; the others are
            refused by name (:func:`check_kernel_options`).
        return_aux: torch's ``AuxRequest``: ``lse=True`` returns ``(out, AuxOutput(lse=lse))``;
            ``max_scores`` is refused.

    Returns:
        ``out (B, H_q, N_q, D_v)`` in the query's dtype and memory layout (its dims in the query's stride
        order, as torch's), with ``lse`` as asked. A row that sees no key gives 0 and ``lse = -inf``, as
        torch's.
    """
    check_kernel_options(kernel_options, score_mod)
    _refuse_sliced_mask_mod(block_mask)
    lse_asked = check_bool("return_lse", return_lse)
    aux_lse = False
    if return_aux is not None:
        if lse_asked:
            raise AttentionValueError("pass return_lse or return_aux, not both (return_aux=AuxRequest(lse=True))")
        if getattr(return_aux, "max_scores", False):
            raise BackendUnavailableError(
                "return_aux=AuxRequest(max_scores=True) is not supported: the kernels keep the running maximum "
                "only inside lse; ask for lse instead"
            )
        aux_lse = bool(getattr(return_aux, "lse", False))
    elif lse_asked:
        warnings.warn(
            "flex_attention: return_lse is deprecated in torch's FlexAttention; ask for the log-sum-exp with "
            "return_aux=AuxRequest(lse=True) (torch.nn.attention.flex_attention.AuxRequest)",
            FutureWarning,
            stacklevel=2,
        )
    out, lse = flash_attention(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=enable_gqa,
        return_lse=True,
    )
    out = in_query_layout(out, query)
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput

        return out, AuxOutput(lse=lse if aux_lse else None, max_scores=None)
    return (out, lse) if lse_asked else out
