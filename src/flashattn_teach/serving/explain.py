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
from .._validate.inputs import check_bool, check_scale, check_softcap, check_window
from .._validate.keywords import takes_keywords
from .._validate.sinks import check_sinks
from ..dispatch import Plan, check_backend, planner
from .checks import autocast_inputs, check_cache_inputs, check_decode_alibi, check_num_splits, lengths_on_host
from .page_checks import check_block_table, check_cache_leftpad, check_page_shapes
from .pages import ElementCache, element_caches
from .ranges import DecodeStep, range_plan, visible_keys
from .splitkv import default_num_splits, split_ranges
from .step import check_host_values, route_extras


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
    block_table, cache_seqlens = options["block_table"], options["cache_seqlens"]
    paged = block_table is not None
    q, k_cache, v_cache, k, v = check_cache_inputs(q, k_cache, v_cache, k, v, autocast=autocast, paged=paged)
    B, H_q, N_new, D = q.shape
    table = check_block_table(block_table, B, q.device)
    H_kv = k_cache.shape[1]
    N_max = check_page_shapes(k_cache, table)[1] if table is not None else k_cache.shape[2]
    G, N_new_kv = H_q // H_kv, 0 if k is None else k.shape[2]
    causal = check_bool("causal", options["causal"])
    resolved_scale = check_scale(options["scale"], D)
    window_sizes = check_window(options["window"])
    cap = check_softcap(options["softcap"])
    slopes = check_decode_alibi(options["alibi_slopes"], B, H_q, q.device)
    splits = check_num_splits(options["num_splits"])
    backend = check_backend(options["backend"])
    leftpad = check_cache_leftpad(options["cache_leftpad"], B, q.device)
    sink_logits = check_sinks(options["sinks"], H_q, q.device)
    backend = route_extras(backend, q, k_cache, v_cache, block_table=table, cache_leftpad=leftpad, sinks=sink_logits)
    if planner.plan_decode(backend, q, k_cache, v_cache).backend == "triton":
        n = splits or default_num_splits(q, k_cache, N_max)
        chosen = "chosen from the GPU's SM count and N_max" if splits == 0 else "as given"
        combine = f", then a combine kernel merges the {n} partials per row" if n > 1 else ""
        if all(lengths_on_host(t) for t in (cache_seqlens, table, leftpad)):  # as the call: no device sync
            check_host_values(
                cache_seqlens, table, leftpad, k_cache=k_cache, B=B, N_max=N_max, N_new_kv=N_new_kv, device=q.device
            )
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
    lengths, pads = check_host_values(
        cache_seqlens, table, leftpad, k_cache=k_cache, B=B, N_max=N_max, N_new_kv=N_new_kv, device=q.device
    )
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
    if pads is not None:
        how += f"; cache_leftpad {pads}: element b's keys start at cache_leftpad[b]"
    if sink_logits is not None:
        how += "; sinks merged once per row after the ranges, as a partial (O = 0, lse = sink_h)"
    if table is not None:
        keys = [visible_keys(L_b, N_new, window_sizes, 0 if pads is None else pads[b]) for b, L_b in enumerate(L)]
        walk = page_walk(element_caches(k_cache, v_cache, table), keys, n)
        how += f"; paged, page_size {k_cache.shape[2]}, N_max = {N_max}; page walk: {walk}"
    return Plan(p.backend, f"{p.reason}; {how}")
