"""flashattn_teach as a Hugging Face ``transformers`` attention implementation.

Two lines in a user's code::

    from flashattn_teach.integrations.transformers import register
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register())

:func:`register` puts :func:`attention_forward` into ``transformers.AttentionInterface`` *and* a mask
function into ``AttentionMaskInterface`` under the same name. Both are needed: for an implementation name
it has no mask function for, transformers builds no mask at all, and padding is silently ignored. Names
transformers rewrites or treats as its own ("paged|..." and any "|", "/" for hub kernels, "flash", "sdpa",
"flex_attention", "eager") are refused.

The mask function is transformers' own SDPA one, so every mask a model builds (causal, left padding,
sliding windows, packed sequences, the overlays of multimodal models) arrives exactly as torch's SDPA would
get it: a bool ``(B, 1, N_q, N_k)`` tensor (True: visible), or None when plain causal masking says it all.
A mask the caller built (``test_custom_4d_attention_mask``) arrives as it is, often float. The contract is
transformers' ``sdpa_attention_forward`` (``transformers/integrations/sdpa_attention.py``), argument for
argument; :func:`attention_forward` hands the mask to :func:`flashattn_teach.flash_attention`, which reads it
tile by tile (tiles no query sees are skipped, tiles every query sees run unmasked; see :mod:`flashattn_teach.masks`):

    transformers                 flashattn_teach.flash_attention
    query, key, value            q, k, v: (B, H_q, N_q, D), (B, H_kv, N_k, D); grouped heads as they come
    attention_mask (bool 4-D)    attn_mask (True: visible)
    attention_mask (float 4-D)   attn_mask, added to the scores (finfo.min where masked: such a row gives
                                 an average of the values, as in torch)
    attention_mask None          causal=is_causal for N_q > 1, causal_align="top_left" as torch's
                                 is_causal (a prefill into a static cache: no query sees the empty
                                 slots); one query row sees every key
    is_causal                    the call's, else module.is_causal (default True)
    position_bias (T5 & co.)     added to the scores: attn_mask = where(mask, bias, -inf), or bias + mask
    scaling                      scale
    softcap (Gemma 2)            softcap (transformers' SDPA refuses it)
    dropout (training)           dropout_p (the counter-based dropout of dropout.py, seeded by torch's
                                 generator)
    output_attentions=True       a warning through transformers' logging, once; None for the weights
    IGNORED_KWARGS               nothing: each is listed with why it cannot change the result
    s_aux or sinks (GPT-OSS)     sinks: one logit per query head, (H_q,), in every row's softmax as a key
                                 of value zero (eager's cat([scores, sinks]), softmax, drop the column)
    indices, block_indices       NotImplementedError naming the keyword (sparse attention)
    any other keyword            AttentionTypeError naming it (None is accepted as "not given")
    output (B, N_q, H_q, D_v)    O transposed, as transformers' attention functions return it

On CUDA a decode step (one query row, a mask None or showing each row one run of keys: left padding, a
static cache's empty slots, a sliding window) runs instead as flash_attention_with_kvcache with
cache_leftpad and cache_seqlens read from the mask, on the split-KV decode kernel (:mod:`.transformers_decode`).

A query row that sees no key through a bool mask (a left-padding position) gives 0, where eager attention
and transformers' SDPA give an average of padding values; transformers discards those rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..api.attention import flash_attention
from ..errors import AttentionTypeError, AttentionValueError
from .transformers_decode import decode_step_output

DEFAULT_NAME = "teach"

# Keywords models pass to attention functions that cannot change this call's result, and why. A value of
# None is always accepted (transformers' own "not given").
IGNORED_KWARGS: frozenset[str] = frozenset(
    {
        # Rotary embeddings are applied to query and key before the call; the packed sequences position_ids may
        # mark reach the call in attention_mask, which transformers' mask function builds from them.
        "position_ids",
        # Where the new tokens sit in the cache, and which layer's cache: the cache update before the call and
        # the mask already used them.
        "cache_position",
        "layer_idx",
        # The window is in attention_mask: transformers builds no mask only while every key is inside it.
        "sliding_window",
        # flash-attn's description of packed sequences. For SDPA-style masks the packing reaches the call only
        # through the mask transformers builds from position_ids; sdpa_attention_forward ignores these too.
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",  # Mamba layers' packed-sequence index, read by state-space layers, not by attention
        # key and value were computed from it before the call (BERT-style cross attention).
        "encoder_hidden_states",
        # What the model returns or how its loss is averaged, not how attention is computed.
        "use_cache",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "num_items_in_batch",
    }
)

# Keywords that change the result and are not implemented here: refused by name, with what to use instead.
_NOT_IMPLEMENTED: dict[str, str] = {
    "indices": "sparse attention over selected keys (DeepSeek V3.2-style indexers)",
    "block_indices": "block-sparse attention over selected key blocks",
}


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    is_causal: bool | None = None,
    position_bias: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: ``query (B, H_q, N_q, D)``, ``key (B, H_kv, N_k, D)``,
    ``value (B, H_kv, N_k, D_v)`` -> ``(output (B, N_q, H_q, D_v), None)`` (no attention weights are kept).

    ``attention_mask`` is a bool ``(B, 1, N_q, N_k)`` mask (True: visible; what register()'s mask function
    builds) or an additive float one (0 visible, ``finfo(dtype).min`` or -inf masked; a ready-made 4-D mask),
    or anything broadcastable to ``(B, H_q, N_q, N_k)``. ``position_bias`` (T5 and its relatives: the relative
    position buckets, ``(1 | B, H_q, N_q, N_k)``) is added to the scores.

    Without a mask, causal masking follows ``sdpa_attention_forward``: the call's ``is_causal``, else the
    module's, and only for more than one query row, aligned top-left as torch's ``is_causal``. That is the
    prefill into a static cache (the empty slots after the prompt stay invisible); for a decode step's one
    row, or a chunk against a cache, transformers passes a mask or needs none."""
    if attention_mask is not None and not (
        isinstance(attention_mask, Tensor)
        and (attention_mask.dtype == torch.bool or attention_mask.is_floating_point())
    ):
        what = attention_mask.dtype if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise AttentionTypeError(
            f"attention_mask of {what}: pass a bool mask (True: visible) or an additive float mask (0 visible, "
            "finfo(dtype).min or -inf masked), as torch's SDPA takes; a flex BlockMask needs "
            "attn_implementation='flex_attention'"
        )
    sinks = _sinks(kwargs.pop("s_aux", None), kwargs.pop("sinks", None))
    _refuse_unknown(kwargs)
    if kwargs.get("output_attentions", False):
        _transformers_logger().warning_once(
            "flashattn_teach attention does not support `output_attentions=True` (it never forms the attention "
            "weights; None is returned in their place); load the model with attn_implementation='eager' to get them"
        )
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal) and attention_mask is None and query.shape[-2] > 1
    if position_bias is None:  # a decode step on CUDA: the split-KV decode kernel (transformers_decode.py)
        step = decode_step_output(
            query, key, value, attention_mask, scaling=scaling, softcap=softcap, dropout=dropout, sinks=sinks
        )
        if step is not None:
            return step.transpose(1, 2).contiguous(), None
    mask = attention_mask if position_bias is None else _with_position_bias(position_bias, attention_mask)
    O = flash_attention(
        query,
        key,
        value,
        causal=causal,
        causal_align="top_left",
        scale=scaling,
        softcap=softcap,
        attn_mask=mask,
        dropout_p=dropout,
        sinks=sinks,
        # flash-attn's keyword, as transformers' flash-attention path passes it: a reproducible backward
        deterministic=kwargs.get("deterministic") or False,
    )
    return O.transpose(1, 2).contiguous(), None  # (B, H_q, N_q, D_v) -> (B, N_q, H_q, D_v)


def _sinks(s_aux: Tensor | None, sinks: Tensor | None) -> Tensor | None:
    """The call's attention sinks: GPT-OSS passes ``s_aux=module.sinks``; ``sinks`` is the same under the
    name flash-attn and this library use. Both, unless they are the same tensor, is ambiguous: refused."""
    if s_aux is not None and sinks is not None and s_aux is not sinks:
        raise AttentionValueError(
            f"s_aux {tuple(s_aux.shape)} and sinks {tuple(sinks.shape)} are both given: pass the attention sinks "
            "under one of the two names"
        )
    return s_aux if s_aux is not None else sinks


def _transformers_logger() -> Any:
    """A logger under transformers' own, so that its verbosity settings (``TRANSFORMERS_VERBOSITY``,
    ``transformers.logging.set_verbosity_error()``) and its ``warning_once`` apply, as to its SDPA's warnings."""
    from transformers.utils import logging

    return logging.get_logger("transformers.integrations.flashattn_teach")


def _refuse_unknown(kwargs: dict[str, Any]) -> None:
    """Refuse, by name, every keyword that is not None and not known to leave the result unchanged: dropping
    it could silently compute something else than the model asks for."""
    for name, value in kwargs.items():
        if value is None or name in IGNORED_KWARGS or name in ("output_attentions", "deterministic"):
            continue
        if name in _NOT_IMPLEMENTED:
            raise NotImplementedError(
                f"{name}: {_NOT_IMPLEMENTED[name]} is not implemented in flashattn_teach; load the model with "
                "attn_implementation='eager' (or another implementation that supports it)"
            )
        shown = f"tensor {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)
        raise AttentionTypeError(
            f"{name}={shown}: flashattn_teach's attention does not know this keyword and will not drop what "
            "it may change; load the model with attn_implementation='sdpa' or 'eager'"
        )


def _with_position_bias(position_bias: Tensor, attention_mask: Tensor | None) -> Tensor:
    """One additive mask, broadcast to ``(B, H_q, N_q, N_k)``, carrying ``position_bias`` and the call's mask, as
    transformers' ``create_position_bias_mask``: the bias where a bool mask is True and -inf elsewhere (so a
    row that sees no key gives 0, as with a bool mask; transformers' finfo.min gives an average there), or the
    sum with an additive mask. Causal masking without a mask stays flash_attention's, which skips tiles."""
    if attention_mask is None:
        return position_bias
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, position_bias, float("-inf"))
    return position_bias + attention_mask


def register(name: str = DEFAULT_NAME) -> str:
    """Register flashattn_teach with transformers under ``name`` and return the name to pass as
    ``attn_implementation``. Names transformers rewrites or treats as its own are refused (see
    :func:`_reserved_because`)."""
    if not isinstance(name, str):
        raise AttentionTypeError(f"name must be a str, got {type(name).__name__}; e.g. {DEFAULT_NAME!r}")
    reason = _reserved_because(name)
    if reason is not None:
        raise AttentionValueError(f"name={name!r}: {reason}; use another name, e.g. {DEFAULT_NAME!r}")
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _reserved_because(name: str) -> str | None:
    """Why transformers 5.x would not run ``name`` as registered (``modeling_utils``:
    ``_check_and_adjust_attn_implementation``, ``get_correct_attn_implementation``, ``AttentionInterface``;
    ``hub_kernels.is_kernel``), or None for a name it takes as it is."""
    if not name:
        return "transformers needs a non-empty name"
    if "|" in name:
        return "transformers strips a 'paged|' prefix and splits hub-kernel names at '|'"
    if "/" in name:
        return "transformers loads a name with '/' as a hub kernel repository"
    for word in ("flash", "sdpa", "flex_attention"):
        if word in name:
            return f"transformers runs its own {word} checks and code paths for every name containing {word!r}"
    if name == "eager":
        return "'eager' is transformers' own implementation (and mask function)"
    return None
