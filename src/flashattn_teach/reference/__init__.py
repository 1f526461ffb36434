"""CPU references: the dense oracle, the tiled online-softmax forwards, and the memory-efficient backward;
also, for :mod:`flashattn_teach.flash_attn_interface`, flash-attn's ``S_dmask`` by the definition
(``flash_attn_probs.py``) and the rotary embedding of its decode step (``rotary.py``)."""

from .backward import flash_backward
from .dense import dense_attention
from .online import key_major_attention, keymajor_attention, online_attention

__all__ = ["dense_attention", "flash_backward", "key_major_attention", "keymajor_attention", "online_attention"]
