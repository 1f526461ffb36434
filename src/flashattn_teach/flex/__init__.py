"""FlexAttention's interface: ``score_mod``, ``mask_mod`` and block masks (issue #24)."""
