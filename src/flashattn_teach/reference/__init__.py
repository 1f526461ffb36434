"""CPU references: the dense oracle, the tiled online-softmax forwards, and the memory-efficient backward."""

from .backward import flash_backward
from .dense import dense_attention
from .online import key_major_attention, keymajor_attention, online_attention

__all__ = ["dense_attention", "flash_backward", "key_major_attention", "keymajor_attention", "online_attention"]
