"""What :func:`flashattn_teach.flash_attention_with_kvcache` would run for given arguments, and why.

:func:`flashattn_teach.explain` answers for one attention call; a decode step adds a choice of path (the
Triton decode kernel or the CPU paths), a number of key ranges (split-KV) and, with one new query, the
folding of a key/value head's ``G`` query heads into ``G`` rows. This says all three without writing the
new keys into the caches; it checks the arguments as the call does and raises the same errors. For a paged
cache (``block_table``) on the CPU paths it also gives the page walk: which pages of the pool each key range
of each batch element reads, and whether they are read as a view (consecutive, adjacent pages) or gathered.
"""

from __future__ import annotations

from torch import Tensor
from typing_extensions import Unpack

from .._options import DecodeKeywords
from .._validate.keywords import takes_keywords
from ..dispatch import Plan, planner
from .checks import autocast_inputs
from .pages import ElementCache, element_caches
from .ranges import visible_keys
from .splitkv import default_num_splits, split_ranges
from .step import DecodeCall, check_step


def page_walk(caches: list[ElementCache], keys: list[tuple[int, int]], num_splits: int) -> str:
    """``b=0: [0, 7) pages 5 2 7 (gathered), [7, 14) pages 8 9 (view); b=1: ...``: the pages each non-empty
    key range ``[s0, s1)`` of each batch element reads (its keys ``keys[b] = [lo, L)``)."""
    elements = []
    for b, (cache, (lo, L)) in enumerate(zip(caches, keys, strict=True)):
        ranges = []
        for a, e in split_ranges(L - lo, num_splits):
            if a == e:
                continue
            p0, p1 = cache.page_span(lo + a, lo + e)
            run = cache.pages[p0:p1]
            how = "view" if cache.reads_a_view(lo + a, lo + e) else "gathered"
            ranges.append(f"[{lo + a}, {lo + e}) pages {' '.join(str(i) for i in run)} ({how})")
        elements.append(f"b={b}: {', '.join(ranges) if ranges else 'no key'}")
    return "; ".join(elements)


@takes_keywords()
def explain_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    **options: Unpack[DecodeKeywords],
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
    c = check_step(q, k_cache, v_cache, DecodeCall(k, v, options, False, autocast))  # as the call checks
    step, table, pads = c.step, c.step.block_table, c.pads
    B, H_q, N_new, _ = c.q.shape
    H_kv, N_max = c.k_cache.shape[1], c.N_max
    G, N_new_kv = H_q // H_kv, 0 if c.k is None else c.k.shape[2]
    if c.plan is None:  # the Triton decode kernel
        n = step.num_splits or default_num_splits(c.q, c.k_cache, N_max)
        given = options["num_splits"] != 0
        chosen = "as given" if given else "chosen from the GPU's SM count and N_max"
        combine = f", then a combine kernel merges the {n} partials per row" if n > 1 else ""
        if c.lengths is not None:  # as the call: read on the host only where they are there (no device sync)
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
    p, n = c.plan, step.num_splits
    L = [m + N_new_kv for m in c.lengths or []]
    folded = N_new == 1 and G > 1 and step.alibi_slopes is None
    _, block_m, block_n = planner.tiles(p.backend, G if folded else N_new) if p.backend != "dense" else ("", 0, 0)
    tiles = "" if p.backend == "dense" else f" at {block_m} x {block_n} tiles"
    why = " (num_splits=0 on the CPU: its paths run the ranges one after another)" if options["num_splits"] == 0 else ""
    merged = ", merged exactly" if n > 1 else ""
    how = f"{n} key range{'s' if n != 1 else ''}{why} per batch element over L_b = {L} keys{tiles}{merged}"
    if folded:
        how += f"; one new query: the G = {G} query heads of each key/value head run as {G} rows of it"
    if pads is not None:
        how += f"; cache_leftpad {pads}: element b's keys start at cache_leftpad[b]"
    if step.sinks is not None:
        how += "; sinks merged once per row after the ranges, as a partial (O = 0, lse = sink_h)"
    if table is not None:
        keys = [visible_keys(L_b, N_new, step.window, 0 if pads is None else pads[b]) for b, L_b in enumerate(L)]
        walk = page_walk(element_caches(c.k_cache, c.v_cache, table), keys, n)
        how += f"; paged, page_size {c.k_cache.shape[2]}, N_max = {N_max}; page walk: {walk}"
    return Plan(p.backend, f"{p.reason}; {how}")
