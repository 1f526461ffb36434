"""FlexAttention's programmable attention: user score_mod and mask_mod functions, and block masks."""
