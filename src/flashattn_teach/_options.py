"""One call's options, validated once and handed to whichever backend runs it.

The public functions keep flat, typed signatures (torch's for the drop-in); :func:`make_options` checks
every argument there, once, and every backend reads the frozen :class:`AttentionOptions` it returns, so
no backend validates again or receives an untyped ``**dict``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from ._validate import (
    AttentionShapes,
    check_alibi_slopes,
    check_bool,
    check_dropout,
    check_seqlens_k,
    check_softcap,
    check_window,
    validate_inputs,
)
from .dropout import DropoutKey, draw
from .masks import MaskSpec


@dataclass(frozen=True)
class AttentionOptions:
    """Everything about a call except ``q, k, v`` themselves.

    ``shapes`` carries the broadcast sizes and the resolved ``scale``; ``mask`` is the call's mask contract
    (causal, window, softcap, ALiBi, ``seqlens_k``, ``attn_mask``; see ``masks.py``), which every backend
    reads; ``attn_mask`` is the user's mask, already checked to broadcast to the scores. ``dropout_key`` is
    the call's dropout (``dropout.py``): drawn by :meth:`with_dropout` where the call runs (not by
    ``explain``, which draws nothing), and kept for the backward, which regenerates the mask from it.
    """

    shapes: AttentionShapes
    mask: MaskSpec
    causal: bool = False
    causal_align: str = "top_left"
    enable_gqa: bool = False
    attn_mask: Tensor | None = None
    dropout_p: float = 0.0
    dropout_key: DropoutKey | None = None

    @property
    def scale(self) -> float:
        return self.shapes.scale

    @property
    def dropout(self) -> DropoutKey:
        """The dropout every path applies: the drawn key, or ``DropoutKey()`` (none) when ``dropout_p = 0``."""
        if self.dropout_key is not None:
            return self.dropout_key
        if self.dropout_p > 0.0:
            raise RuntimeError("dropout_p > 0 but no dropout key was drawn: run the call on opts.with_dropout()")
        return DropoutKey()

    def with_dropout(self, key: DropoutKey | None = None) -> AttentionOptions:
        """These options with the call's dropout key: ``key`` if given (tests fix one), the one already
        drawn, or one drawn now from torch's default generator (:func:`flashattn_teach.dropout.draw`, which
        consumes nothing when ``dropout_p = 0``), so ``torch.manual_seed`` makes calls repeatable."""
        if key is None:
            if self.dropout_key is not None:
                return self
            key = draw(self.dropout_p)
        return replace(self, dropout_p=key.p, dropout_key=key)


def make_options(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: object = False,
    causal_align: str = "top_left",
    scale: object = None,
    enable_gqa: object = False,
    attn_mask: Tensor | None = None,
    dropout_p: object = 0.0,
    window: object = None,
    softcap: object = None,
    alibi_slopes: object = None,
    seqlens_k: object = None,
    causal_name: str = "causal",
) -> AttentionOptions:
    """Validate a call's arguments (naming them as the caller's signature does) and freeze them."""
    causal = check_bool(causal_name, causal)
    gqa = check_bool("enable_gqa", enable_gqa)
    shapes = validate_inputs(q, k, v, scale=scale, causal_align=causal_align, enable_gqa=gqa, attn_mask=attn_mask)
    mask = MaskSpec.build(
        shapes,
        q.dtype,
        causal=causal,
        causal_align=causal_align,
        window=check_window(window),
        softcap=check_softcap(softcap),
        alibi_slopes=check_alibi_slopes(alibi_slopes, q, shapes),
        seqlens_k=check_seqlens_k(seqlens_k, q, shapes),
        attn_mask=attn_mask,
    )
    return AttentionOptions(
        shapes=shapes,
        mask=mask,
        causal=causal,
        causal_align=causal_align,
        enable_gqa=gqa,
        attn_mask=attn_mask,
        dropout_p=check_dropout(dropout_p),
    )
