"""The public attention functions: each checks its arguments once, builds one options object and hands it
to the dispatcher (:mod:`flashattn_teach.dispatch`), or, while compiled, to its custom op
(:mod:`flashattn_teach.ops`).

    attention.py       flash_attention, scaled_dot_product_attention
    varlen.py          flash_attention_varlen (packed sequences)
    explain_call.py    explain: the plan a call would run, without running it (not `explain.py`: the
                       package exports the function `explain`, which would hide a module of that name)
    flex.py            flex_attention (FlexAttention's function: score_mod and a block mask)
    block_mask.py      create_block_mask (FlexAttention's: mask_mod classified tile by tile)
    flash_attn_layout.py  flash-attn's (B, N, H, D) layout and options onto the functions above, for
                       flashattn_teach.flash_attn_interface (flash-attn's function names)

flash_attention_with_kvcache and explain_with_kvcache (a decode step) live with the rest of serving, in
:mod:`flashattn_teach.serving`, and are re-exported here.
"""

from ..serving.api import flash_attention_with_kvcache
from ..serving.explain import explain_with_kvcache
from .attention import flash_attention, scaled_dot_product_attention
from .block_mask import create_block_mask
from .explain_call import explain
from .flex import flex_attention
from .varlen import flash_attention_varlen

__all__ = [
    "create_block_mask",
    "explain",
    "explain_with_kvcache",
    "flash_attention",
    "flash_attention_varlen",
    "flash_attention_with_kvcache",
    "flex_attention",
    "scaled_dot_product_attention",
]
