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

from typing import Any

from torch import Tensor

from .._validate.inputs import check_bool
from ..errors import AttentionValueError, BackendUnavailableError
from ..flex.mods import BlockMask, ScoreMod
from .attention import flash_attention


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
        kernel_options: torch's tuning hints for its generated kernel; this library picks its own tiles,
            so any option given is refused by name (pass None).
        return_aux: torch's ``AuxRequest``: ``lse=True`` returns ``(out, AuxOutput(lse=lse))``;
            ``max_scores`` is refused.

    Returns:
        ``out (B, H_q, N_q, D_v)`` in the query's dtype, with ``lse`` as asked. A row that sees no key
        gives 0 and ``lse = -inf``, as torch's.
    """
    if kernel_options:
        raise BackendUnavailableError(
            f"kernel_options {sorted(kernel_options)} are torch's tuning hints for its generated kernel; this "
            "library chooses its own tiles (flashattn_teach.explain tells which): pass kernel_options=None"
        )
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
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput

        return out, AuxOutput(lse=lse if aux_lse else None, max_scores=None)
    return (out, lse) if lse_asked else out
