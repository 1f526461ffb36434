"""flashattn_teach: exact attention without storing the N x N score matrix.

Public API:
    scaled_dot_product_attention  drop-in for ``torch.nn.functional.scaled_dot_product_attention``
    flash_attention               the same with FlashAttention's options (causal alignment, lse, backend)
    flash_attention_varlen        packed variable-length sequences, flash-attn's varlen layout
    flash_attention_with_kvcache  a decode step against a KV cache, split-KV (Flash-Decoding)
    flex_attention                FlexAttention's function (score_mod, block masks) without torch.compile
    flash_attn_interface          flash-attn 2's functions (flash_attn_func, ...) in flash-attn's (B, N, H, D) layout
    create_block_mask, BlockMask  FlexAttention's block masks, classified tile by tile (never N_q x N_k),
    and_masks, or_masks, noop_mask  and its mask combinators
    explain                       which backend would run for given inputs, and why
    explain_with_kvcache          which path, how many key ranges and which row layout a decode step would use
    reference                     dense oracle, online-softmax references, memory-efficient backward
    merge_attention_states        attention over two disjoint key sets from each one's (O, lse)
    distributed                   ring attention over torch.distributed (imported on its own)
    AttentionError                base of the errors raised for bad input (each also a RuntimeError)
    AttentionSchedules            the teaching example's module (dense and tiled side by side)

Papers: Dao et al. 2022, "FlashAttention" (arXiv:2205.14135); Dao 2023, "FlashAttention-2"
(arXiv:2307.08691); Milakov & Gimelshein 2018, "Online normalizer calculation for softmax".
"""

from . import _moved, flash_attn_interface, reference
from .api import (
    create_block_mask,
    explain,
    explain_with_kvcache,
    flash_attention,
    flash_attention_varlen,
    flash_attention_with_kvcache,
    flex_attention,
    scaled_dot_product_attention,
)
from .dispatch import BACKENDS, Plan
from .errors import AttentionError, AttentionTypeError, AttentionValueError
from .flex import BlockMask, and_masks, noop_mask, or_masks
from .merge import merge_attention_states
from .reference import dense_attention, flash_backward, key_major_attention, keymajor_attention, online_attention
from .schedules import AttentionSchedules

_moved.install()  # the 0.1 module paths (flashattn_teach.trace, ...) import for one more release


def __getattr__(name: str) -> object:
    """``flashattn_teach.trace`` and the other moved top-level modules as attributes, with the warning."""
    if f"{__name__}.{name}" in _moved.TOP_LEVEL:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "AttentionError",
    "AttentionSchedules",
    "AttentionTypeError",
    "AttentionValueError",
    "BlockMask",
    "Plan",
    "and_masks",
    "create_block_mask",
    "dense_attention",
    "explain",
    "explain_with_kvcache",
    "flash_attention",
    "flash_attention_varlen",
    "flash_attention_with_kvcache",
    "flash_attn_interface",
    "flash_backward",
    "flex_attention",
    "key_major_attention",
    "keymajor_attention",
    "merge_attention_states",
    "noop_mask",
    "online_attention",
    "or_masks",
    "reference",
    "scaled_dot_product_attention",
]
__version__ = "0.1.0"
