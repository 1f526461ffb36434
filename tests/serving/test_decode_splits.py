"""The split-KV ranges of ``flash_attention_with_kvcache``: how keys are cut, how many splits, and that each
range is one tiled call over its own keys."""

from __future__ import annotations

import itertools

import torch

import flashattn_teach as fa
from flashattn_teach import dispatch
from flashattn_teach.dispatch import planner, runner
from flashattn_teach.serving import splitkv

from decode_cases import problem, slopes_of


def test_split_ranges_cut_the_keys_into_contiguous_ranges():
    assert splitkv.split_ranges(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert splitkv.split_ranges(3, 5) == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]
    assert splitkv.split_ranges(0, 2) == [(0, 0), (0, 0)]
    for L in range(30):
        for n in range(1, 12):
            ranges = splitkv.split_ranges(L, n)
            assert len(ranges) == n and ranges[0][0] == 0 and ranges[-1][1] == L
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_num_splits_heuristic_fills_the_gpu():
    # A full GPU needs no split.
    assert splitkv.num_splits_heuristic(programs=212, sm_slots=264, n_blocks=100) == 1
    # One sequence, 8 key/value heads, 264 slots (132 SMs): 8 programs per split; 33 splits fill one wave
    # exactly, and 29 is the fewest within 85% of that (29 * 8 / 264 = 0.88), eligible since
    # ceil(256 / 29) = 9 != ceil(256 / 28) = 10.
    assert splitkv.num_splits_heuristic(programs=8, sm_slots=264, n_blocks=256) == 29
    # Never more splits than key blocks.
    assert splitkv.num_splits_heuristic(programs=1, sm_slots=264, n_blocks=4) <= 4
    assert splitkv.cuda_num_splits(B=1, H_kv=8, N_q=1, group=4, N_k=32768, D=128, sm_count=132) == 29
    assert splitkv.cuda_num_splits(B=64, H_kv=8, N_q=1, group=4, N_k=32768, D=128, sm_count=132) == 1


def recorded_partials(monkeypatch):
    """The ``(rows, keys, offset, causal)`` of every partial result a call computes."""
    seen = []
    run = runner.run

    def recording(p, q, k, v, opts):
        seen.append((q.shape[2], k.shape[2], opts.mask.offset, opts.mask.causal))
        return run(p, q, k, v, opts)

    monkeypatch.setattr(runner, "run", recording)
    return seen


def test_each_range_is_one_call_over_its_own_keys(monkeypatch):
    # The split is real: one tiled call per non-empty range, each given only that range's keys.
    seen = recorded_partials(monkeypatch)
    q, k_cache, v_cache, (k, v) = problem(2, 2, 2, 12, 2, 2, seed=1)
    fa.flash_attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([5, 0]), causal=True, num_splits=3
    )
    # L = 7: ranges [0, 3), [3, 6), [6, 7), offsets L - N_new - s0; L = 2: [0, 1), [1, 2) and an empty one.
    assert seen == [(2, 3, 5, True), (2, 3, 2, True), (2, 1, -1, True), (2, 1, 0, True), (2, 1, -1, True)]


def test_one_new_query_runs_its_query_heads_as_rows_of_their_key_value_head(monkeypatch):
    seen = recorded_partials(monkeypatch)
    q, k_cache, v_cache, (k, v) = problem(1, 6, 2, 12, 1, 1, seed=1)
    fa.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([5]), num_splits=2)
    assert [(rows, causal) for rows, _, _, causal in seen] == [(3, False), (3, False)]  # G = 3 rows, no mask
    seen.clear()  # ALiBi has a slope per query head: no folding
    slopes = slopes_of(6, seed=1)
    fa.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=6, causal=True, alibi_slopes=slopes, num_splits=1
    )
    assert [(rows, causal) for rows, _, _, causal in seen] == [(1, True)]  # the 6 heads, one row each


def test_a_window_cuts_only_the_keys_some_row_may_see(monkeypatch):
    seen = recorded_partials(monkeypatch)
    q, k_cache, v_cache, _ = problem(1, 2, 2, 20, 2, 0, seed=1)
    # L = 12, N_new = 2, left = 3: row 0 at position 10 sees keys from 7 on, so [7, 12) is cut in two.
    fa.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=12, window=(3, 0), num_splits=2)
    assert [(keys, offset) for _, keys, offset, _ in seen] == [(3, 10 - 7), (2, 10 - 10)]


def test_a_triton_plan_runs_on_the_query_major_reference_instead(monkeypatch):
    # On CUDA tensors dispatch.plan may pick the prefill kernel, which knows no per-range diagonal offset.
    monkeypatch.setattr(planner, "plan", lambda *args: dispatch.Plan("triton", "CUDA tensors"))
    assert dispatch.plan_ranges(*(None,) * 4, "auto").backend == "query_major"


def test_cpu_default_is_one_split():
    q, k_cache, _, _ = problem(1, 2, 2, 8, 1, 0)
    assert splitkv.default_num_splits(q, k_cache, 8) == 1


def test_a_contiguous_cache_reads_a_range_as_a_view_and_the_whole_cache_as_itself():
    from flashattn_teach.serving.pages import element_caches

    k_cache, v_cache = torch.randn(2, 2, 9, 4), torch.randn(2, 2, 9, 3)
    cache = element_caches(k_cache, v_cache, None)[1]
    k, v = cache.read(2, 7)
    assert torch.equal(k, k_cache[1:2, :, 2:7]) and torch.equal(v, v_cache[1:2, :, 2:7])
    assert k.data_ptr() == k_cache[1, :, 2].data_ptr()  # a view, no copy
    whole = element_caches(k_cache[:1], v_cache[:1], None)[0]
    assert all(a is b for a, b in zip(whole.read(0, 9), (whole.k_cache, whole.v_cache), strict=True))
