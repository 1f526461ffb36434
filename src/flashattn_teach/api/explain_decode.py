"""What :func:`flashattn_teach.flash_attention_with_kvcache` would run for given arguments, and why.

:func:`flashattn_teach.explain` answers for one attention call; a decode step adds a choice of path (the
Triton decode kernel or the CPU paths), a number of key ranges (split-KV) and, with one new query, the
folding of a key/value head's ``G`` query heads into ``G`` rows. This says all three without writing the
new keys into the caches; it checks the arguments as the call does and raises the same errors.
"""

from __future__ import annotations

from torch import Tensor

from .._validate.decode import (
    autocast_inputs,
    check_cache_inputs,
    check_cache_seqlens,
    check_decode_alibi,
    check_num_splits,
    lengths_on_host,
)
from .._validate.inputs import check_bool, check_scale, check_softcap, check_window
from ..decode.ranges import DecodeStep, range_plan
from ..dispatch import Plan, check_backend, planner
from ..splitkv import default_num_splits


def explain_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    *,
    cache_seqlens: Tensor | int,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    backend: str = "auto",
) -> Plan:
    """The path, the number of key ranges and the row layout :func:`flash_attention_with_kvcache` would use
    for these arguments (the same signature, without ``return_lse``); the caches are not written.

    >>> import torch, flashattn_teach as fa
    >>> q, cache = torch.randn(2, 8, 1, 16), torch.zeros(2, 2, 64, 16)
    >>> print(fa.explain_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([37, 20])))
    ... # doctest: +ELLIPSIS
    parallel: cpu tensors: ...; 1 key range (num_splits=0 on the CPU: ...) per batch element over L_b = [37, 20] keys...
    """
    q, k, v, autocast = autocast_inputs(q, k_cache, k, v)
    q, k_cache, v_cache, k, v = check_cache_inputs(q, k_cache, v_cache, k, v, autocast=autocast)
    B, H_q, N_new, D = q.shape
    H_kv, N_max = k_cache.shape[1], k_cache.shape[2]
    G, N_new_kv = H_q // H_kv, 0 if k is None else k.shape[2]
    causal = check_bool("causal", causal)
    resolved_scale = check_scale(scale, D)
    window_sizes = check_window(window)
    cap = check_softcap(softcap)
    slopes = check_decode_alibi(alibi_slopes, B, H_q, q.device)
    splits = check_num_splits(num_splits)
    backend = check_backend(backend)
    if planner.plan_decode(backend, q, k_cache, v_cache).backend == "triton":
        n = splits or default_num_splits(q, k_cache, N_max)
        chosen = "chosen from the GPU's SM count and N_max" if splits == 0 else "as given"
        combine = f", then a combine kernel merges the {n} partials per row" if n > 1 else ""
        if lengths_on_host(cache_seqlens):  # as the call: an int or a CPU tensor is checked, no device sync
            check_cache_seqlens(cache_seqlens, B, N_max, q.device, N_new_kv=N_new_kv)
            read = "cache_seqlens checked on the host (no device sync)"
        else:
            read = (
                f"cache_seqlens read on the device and not checked (that would synchronise): each length is "
                f"clamped to [0, N_max - N_new_kv] = [0, {N_max - N_new_kv}], so one that leaves no room makes "
                f"the new entries overwrite the last valid ones"
            )
        return Plan(
            "triton",
            f"the Triton split-KV decode kernel: {B} x {H_kv} x {n} (batch x key/value head x split, {chosen}) "
            f"programs, each over the G x N_new = {G} x {N_new} query rows of one key/value head; {read}{combine}",
        )
    lengths = check_cache_seqlens(cache_seqlens, B, N_max, q.device, N_new_kv=N_new_kv)
    L = [n + N_new_kv for n in lengths]
    n = splits or default_num_splits(q, k_cache, max(L) if L else 0)
    step = DecodeStep(
        causal=causal, scale=resolved_scale, window=window_sizes, softcap=cap, num_splits=n, backend=backend
    )
    p = range_plan(q, k_cache, v_cache, step, alibi_slopes=slopes)  # what every range of the call gets
    folded = N_new == 1 and G > 1 and slopes is None
    _, block_m, block_n = planner.tiles(p.backend, G if folded else N_new) if p.backend != "dense" else ("", 0, 0)
    tiles = "" if p.backend == "dense" else f" at {block_m} x {block_n} tiles"
    why = " (num_splits=0 on the CPU: its paths run the ranges one after another)" if splits == 0 else ""
    merged = ", merged exactly" if n > 1 else ""
    how = f"{n} key range{'s' if n != 1 else ''}{why} per batch element over L_b = {L} keys{tiles}{merged}"
    if folded:
        how += f"; one new query: the G = {G} query heads of each key/value head run as {G} rows of it"
    return Plan(p.backend, f"{p.reason}; {how}")
