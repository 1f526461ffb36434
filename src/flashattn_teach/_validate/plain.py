"""Which calls ``make_options`` may keep the options of: a plain call's key.

A plain call has no tensor, function or block mask among its keywords, so its checked options depend only on
its inputs' types, dtypes, devices and shapes and on its keywords' values, which :func:`plain_key` puts in one
tuple (``flashattn_teach._options.make_options`` keeps the options it built under it). A call that fails a
check is never kept, so every refusal still happens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

_NUMBER = (type(None), float, int)  # scale, softcap and dropout_p: float(value) is all make_options reads of them


def plain_key(q: Tensor, k: Tensor, v: Tensor, o: Mapping[str, Any], causal_name: str) -> tuple[object, ...] | None:
    """The key of a plain call's options in ``_options._PLAIN``, None for any other call. Each keyword enters with
    a type that makes equal keys mean equal options: ``True == 1`` as dict keys, so the flags must be bools
    (``causal=1`` then misses and is refused by the checks), and the window a tuple of two ints. Not for
    tensor subclasses (fakes, wrappers), nor while compiling: torch.compile would guard on the cache and
    compile again as it fills. Written out, without generators: every call asks."""
    if (
        o["attn_mask"] is not None
        or o["alibi_slopes"] is not None
        or o["seqlens_k"] is not None
        or o["sinks"] is not None
        or o["score_mod"] is not None
        or o["mask_mod"] is not None
        or o["block_mask"] is not None
    ):
        return None
    causal, gqa, deterministic = o["causal"], o["enable_gqa"], o["deterministic"]
    scale, softcap, dropout_p = o["scale"], o["softcap"], o["dropout_p"]
    window, align = o["window"], o["causal_align"]
    if type(causal) is not bool or type(gqa) is not bool or type(deterministic) is not bool:
        return None
    if type(scale) not in _NUMBER or type(softcap) not in _NUMBER or type(dropout_p) not in _NUMBER:
        return None
    if window is not None and not (
        type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int
    ):
        return None
    if type(align) is not str or type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return None
    if torch.compiler.is_compiling():
        return None
    return (
        *(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device),
        *(causal_name, causal, gqa, deterministic, scale, softcap, dropout_p, window, align),
    )
