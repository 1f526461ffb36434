"""flashattn_teach: exact attention without storing the N x N score matrix.

Public API:
    scaled_dot_product_attention  drop-in for ``torch.nn.functional.scaled_dot_product_attention``
    flash_attention               the same with FlashAttention's options (causal alignment, lse, backend)
    explain                       which backend would run for given inputs, and why
    reference                     dense oracle, online-softmax references, memory-efficient backward
    AttentionSchedules            the teaching example's module (dense and tiled side by side)
"""

from . import reference
from .reference import dense_attention, flash_backward, keymajor_attention, online_attention

__all__ = [
    "dense_attention",
    "flash_backward",
    "keymajor_attention",
    "online_attention",
    "reference",
]
__version__ = "0.1.0"
