"""The read-first FlashAttention (being written)."""
