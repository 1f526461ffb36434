"""Decoding against a KV cache: ``flash_attention_with_kvcache`` and its split-KV ranges.

The oracle is built here from the definition, in float64, one batch element at a time: dense attention of
``q[b]`` over the first ``L_b`` keys of the updated cache, with the bottom-right mask and ALiBi distance
written out from query positions ``L_b - N_new + i``. It shares no code with the mask contract, the tiled
paths or the merge.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flashattn_teach as fa
from flashattn_teach import dispatch, splitkv
from flashattn_teach.dispatch import planner
from flashattn_teach.reference import parallel

NEG_INF = float("-inf")
CPU_BACKENDS = ["parallel", "online", "key_major", "dense"]


def randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def slopes_of(*shape, seed):
    return torch.rand(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def oracle(q, k_cache, v_cache, L, *, causal=True, window=None, softcap=None, alibi_slopes=None, scale=None):
    """``(O, lse)`` of one batch element, ``q (H_q, N_new, D)`` over keys ``[0, L)`` of ``k_cache (H_kv, N_max, D)``."""
    H_q, N_new, D = q.shape
    G = H_q // k_cache.shape[0]
    k = k_cache[:, :L].double().repeat_interleave(G, dim=0)  # (H_q, L, D): query head h reads kv head h // G
    v = v_cache[:, :L].double().repeat_interleave(G, dim=0)
    scale = 1 / math.sqrt(D) if scale is None else scale
    S = scale * q.double() @ k.transpose(1, 2)  # (H_q, N_new, D) @ (H_q, D, L) -> (H_q, N_new, L)
    if softcap is not None:
        S = softcap * torch.tanh(S / softcap)
    pos = (L - N_new + torch.arange(N_new))[:, None]  # (N_new, 1): query row i's position in the sequence
    j = torch.arange(L)[None, :]  # (1, L)
    if alibi_slopes is not None:
        S = S - alibi_slopes.double()[:, None, None] * (pos - j).abs()
    visible = torch.ones(N_new, L, dtype=torch.bool)
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    if left >= 0:
        visible &= j >= pos - left
    if right >= 0:
        visible &= j <= pos + right
    S = S.masked_fill(~visible, NEG_INF)
    lse = torch.logsumexp(S, dim=-1)  # (H_q, N_new); -inf for a row that sees nothing
    P = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(S - lse[..., None]))
    return P @ v, lse  # (H_q, N_new, L) @ (H_q, L, D_v) -> (H_q, N_new, D_v)


def batch_oracle(q, k_cache, v_cache, lengths, *, alibi_slopes=None, **opts):
    parts = [
        oracle(
            q[b],
            k_cache[b],
            v_cache[b],
            L,
            alibi_slopes=None if alibi_slopes is None else alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b],
            **opts,
        )
        for b, L in enumerate(lengths)
    ]
    return torch.stack([O for O, _ in parts]), torch.stack([lse for _, lse in parts])


def assert_matches(O, lse, O_ref, lse_ref, atol=1e-12):
    torch.testing.assert_close(O, O_ref, atol=atol, rtol=atol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    finite = ~torch.isneginf(lse_ref)
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=atol, rtol=atol)


@contextlib.contextmanager
def tiles(block_m: int, block_n: int):
    """Every tiled backend at ``block_m x block_n``, and the parallel one on its pool even for tiny calls."""
    saved, few_rows = dict(planner.TILED), planner.FEW_ROWS
    smallest = parallel.MIN_PARALLEL_SCORES
    planner.TILED.update({name: (order, block_m, block_n) for name, (order, _, _) in saved.items()})
    planner.FEW_ROWS = 0  # the tiles asked for, not the wide ones of a few-row call
    parallel.MIN_PARALLEL_SCORES = 0
    try:
        yield
    finally:
        planner.TILED.update(saved)
        planner.FEW_ROWS = few_rows
        parallel.MIN_PARALLEL_SCORES = smallest


def problem(B, H_q, H_kv, N_max, N_new, N_new_kv, *, D=8, D_v=6, seed=0):
    q = randn(B, H_q, N_new, D, seed=seed)
    k_cache, v_cache = randn(B, H_kv, N_max, D, seed=seed + 1), randn(B, H_kv, N_max, D_v, seed=seed + 2)
    new = (randn(B, H_kv, N_new_kv, D, seed=seed + 3), randn(B, H_kv, N_new_kv, D_v, seed=seed + 4))
    return q, k_cache, v_cache, (new if N_new_kv else (None, None))


# Cache lengths before the step: nothing old (the new entries only), one entry, lengths that are no
# multiple of the 3 x 5 tiles, ragged across the batch, and a cache that the new entries fill exactly.
N_MAX = 24
CACHES = {
    "empty": [0, 0],
    "one": [1, 1],
    "ragged": [13, 0, 7],
    "awkward": [11, 17],
    "full": [N_MAX - 4, N_MAX - 4],  # N_new_kv = 4 fills it; with N_new_kv = 1 one slot stays free
}


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("N_new", [1, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_decode_matches_the_dense_oracle_for_every_cache_length_and_split_count(num_splits, cache, N_new, causal):
    lengths = CACHES[cache]
    q, k_cache, v_cache, (k, v) = problem(len(lengths), 4, 2, N_MAX, N_new, N_new, seed=N_new)
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32)
    with tiles(3, 5):
        O, lse = fa.flash_attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens=cache_seqlens,
            causal=causal,
            num_splits=num_splits,
            return_lse=True,
        )
    L = [n + N_new for n in lengths]
    assert_matches(O, lse, *batch_oracle(q, k_cache, v_cache, L, causal=causal))


VARIANTS = {
    "window": {"window": (3, 0), "causal": True},
    "window both sides, not causal": {"window": (2, 1), "causal": False},
    "window left unbounded, not causal": {"window": (-1, 2), "causal": False},
    "softcap": {"softcap": 1.5, "scale": 2.0, "causal": True},
    "alibi per head": {"alibi": (4,), "causal": True},
    "alibi per batch element": {"alibi": (3, 4), "causal": True},
    "all at once": {"window": (4, 0), "softcap": 2.0, "alibi": (3, 4), "causal": True},
}


@pytest.mark.parametrize("num_splits", [1, 3, 7])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("N_new", "H_kv"), [(1, 1), (4, 2), (4, 4)])
def test_decode_variants_match_the_oracle(num_splits, variant, N_new, H_kv):
    opts = dict(VARIANTS[variant])
    lengths = [9, 0, 16]
    q, k_cache, v_cache, (k, v) = problem(3, 4, H_kv, 20, N_new, N_new, seed=7)
    shape = opts.pop("alibi", None)
    slopes = None if shape is None else slopes_of(*shape, seed=3)
    with tiles(2, 3):
        O, lse = fa.flash_attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens=torch.tensor(lengths),
            num_splits=num_splits,
            alibi_slopes=slopes,
            return_lse=True,
            **opts,
        )
    L = [n + N_new for n in lengths]
    assert_matches(O, lse, *batch_oracle(q, k_cache, v_cache, L, alibi_slopes=slopes, **opts))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_every_cpu_backend_at_its_own_tiles_on_a_long_cache(backend, num_splits):
    # Ranges longer than the backends' key tiles (256 and 512) and not multiples of them.
    lengths = [700, 257, 1]
    q, k_cache, v_cache, (k, v) = problem(3, 4, 2, 800, 1, 1, D=16, D_v=16, seed=11)
    O, lse = fa.flash_attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lengths), num_splits=num_splits, backend=backend,
        window=(300, 0), return_lse=True,
    )  # fmt: skip
    assert_matches(O, lse, *batch_oracle(q, k_cache, v_cache, [n + 1 for n in lengths], window=(300, 0)), atol=1e-10)


@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=3),
    N_new=st.sampled_from([1, 2, 4]),
    N_new_kv=st.sampled_from([0, 1, 3, 4]),
    num_splits=st.integers(1, 9),
    causal=st.booleans(),
    window=st.sampled_from([None, (0, 0), (2, -1), (1, 3), (5, 0)]),
    softcap=st.sampled_from([None, 0.7]),
    alibi=st.booleans(),
    G=st.sampled_from([1, 3]),
    blocks=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    seed=st.integers(0, 2**16),
)
def test_decode_matches_the_oracle_for_any_cache_split_and_tiling(
    lengths, N_new, N_new_kv, num_splits, causal, window, softcap, alibi, G, blocks, seed
):
    B, H_kv, N_max = len(lengths), 2, 16
    q, k_cache, v_cache, (k, v) = problem(B, H_kv * G, H_kv, N_max, N_new, N_new_kv, D=4, D_v=3, seed=seed)
    slopes = slopes_of(B, H_kv * G, seed=seed) if alibi else None
    opts = {"causal": causal, "window": window, "softcap": softcap}
    with tiles(*blocks):
        O, lse = fa.flash_attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lengths), num_splits=num_splits,
            alibi_slopes=slopes, return_lse=True, **opts,
        )  # fmt: skip
    L = [n + N_new_kv for n in lengths]
    assert_matches(O, lse, *batch_oracle(q, k_cache, v_cache, L, alibi_slopes=slopes, **opts))


def test_a_python_int_cache_length_serves_every_batch_element():
    q, k_cache, v_cache, (k, v) = problem(2, 2, 2, 10, 1, 1, seed=5)
    O = fa.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=6, num_splits=2)
    torch.testing.assert_close(O, batch_oracle(q, k_cache, v_cache, [7, 7])[0], atol=1e-12, rtol=1e-12)


def test_the_new_entries_are_written_in_place_and_nothing_else_changes():
    lengths = [3, 0, 5]
    q, k_cache, v_cache, (k, v) = problem(3, 2, 2, 8, 1, 3, seed=2)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    cache_seqlens = torch.tensor(lengths)
    fa.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens)
    written = torch.zeros(3, 1, 8, 1, dtype=torch.bool)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(k_cache[b, :, n : n + 3], k[b], atol=0, rtol=0)
        torch.testing.assert_close(v_cache[b, :, n : n + 3], v[b], atol=0, rtol=0)
        written[b, :, n : n + 3] = True
    assert torch.equal(k_cache.masked_select(~written), k_before.masked_select(~written))
    assert torch.equal(v_cache.masked_select(~written), v_before.masked_select(~written))
    assert cache_seqlens.tolist() == lengths  # not updated, as in flash-attn


def test_caches_in_flash_attns_layout_are_written_through_their_views():
    # A cache kept as (B, N_max, H_kv, D), passed as its (B, H_kv, N_max, D) view: the write lands in it.
    q, _, _, (k, v) = problem(2, 4, 2, 9, 1, 2, seed=3)
    k_store, v_store = randn(2, 9, 2, 8, seed=4), randn(2, 9, 2, 6, seed=5)
    k_cache, v_cache = k_store.transpose(1, 2), v_store.transpose(1, 2)
    O = fa.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([2, 7]), num_splits=2)
    torch.testing.assert_close(k_store[1, 7:9], k[1].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(v_store[0, 2:4], v[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(O, batch_oracle(q, k_cache, v_cache, [4, 9])[0], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("N_new", [1, 4])
def test_float32_matches_the_oracle(N_new):
    q, k_cache, v_cache, _ = problem(2, 8, 2, 70, N_new, 0, D=16, D_v=16, seed=6)
    q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
    lengths = [60, 13]
    O, lse = fa.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths), causal=True, num_splits=3, return_lse=True
    )
    assert O.dtype == lse.dtype == torch.float32
    O_ref, lse_ref = batch_oracle(q, k_cache, v_cache, lengths)
    assert_matches(O.double(), lse.double(), O_ref, lse_ref, atol=1e-5)


def test_a_decode_loop_equals_attention_over_the_whole_sequence():
    # Prefill 5 entries, then decode 4 steps of one token each, advancing cache_seqlens by hand.
    B, H, N, D = 2, 2, 9, 8
    q_all, k_all, v_all = randn(B, H, N, D, seed=1), randn(B, H, N, D, seed=2), randn(B, H, N, D, seed=3)
    k_cache, v_cache = torch.zeros(B, H, 12, D, dtype=torch.float64), torch.zeros(B, H, 12, D, dtype=torch.float64)
    k_cache[:, :, :5], v_cache[:, :, :5] = k_all[:, :, :5], v_all[:, :, :5]
    cache_seqlens = torch.full((B,), 5, dtype=torch.int32)
    ref = fa.reference.dense_attention(q_all, k_all, v_all, causal=True)
    for t in range(5, N):
        new = slice(t, t + 1)
        O = fa.flash_attention_with_kvcache(
            q_all[:, :, new], k_cache, v_cache, k_all[:, :, new], v_all[:, :, new], cache_seqlens=cache_seqlens,
            num_splits=3,
        )  # fmt: skip
        torch.testing.assert_close(O, ref[:, :, new], atol=1e-12, rtol=1e-12)
        cache_seqlens += 1


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    q, k_cache, v_cache, _ = problem(2, 2, 2, 6, 2, 0, seed=4)
    # Batch element 0 has no key at all; element 1's window (0, 0) with N_new = 2 > L = 1 leaves row 0 empty.
    O, lse = fa.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor([0, 1]), window=(0, 0), num_splits=2, return_lse=True
    )
    assert torch.equal(O[0], torch.zeros_like(O[0])) and torch.isneginf(lse[0]).all()
    assert torch.equal(O[1, :, 0], torch.zeros_like(O[1, :, 0])) and torch.isneginf(lse[1, :, 0]).all()
    assert torch.isfinite(lse[1, :, 1]).all()


def test_an_empty_batch_and_zero_new_queries():
    q, k_cache, v_cache, _ = problem(2, 2, 1, 6, 0, 0, seed=4)
    O, lse = fa.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, return_lse=True)
    assert O.shape == (2, 2, 0, 6) and lse.shape == (2, 2, 0)
    O, lse = fa.flash_attention_with_kvcache(q[:0], k_cache[:0], v_cache[:0], cache_seqlens=3, return_lse=True)
    assert O.shape == (0, 2, 0, 6) and lse.shape == (0, 2, 0)


def test_gradients_flow_to_q_and_to_the_cache_when_nothing_is_written():
    q, k_cache, v_cache, _ = problem(2, 4, 2, 10, 3, 0, seed=6)
    lengths = [7, 2]
    for t in (q, k_cache, v_cache):
        t.requires_grad_()
    w = randn(2, 4, 3, 6, seed=9)
    O = fa.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths), causal=True, num_splits=3
    )
    grads = torch.autograd.grad((O * w).sum(), (q, k_cache, v_cache))
    O_ref, _ = batch_oracle(q, k_cache, v_cache, lengths)
    grads_ref = torch.autograd.grad((O_ref * w).sum(), (q, k_cache, v_cache))
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=1e-12)
    assert torch.equal(grads[1][0, :, 7:], torch.zeros_like(grads[1][0, :, 7:]))  # past L_b: no gradient


def test_gradient_to_q_when_new_entries_are_written():
    q, k_cache, v_cache, (k, v) = problem(2, 2, 2, 10, 1, 1, seed=8)
    q.requires_grad_()
    O = fa.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([4, 8]), num_splits=2)
    (g,) = torch.autograd.grad(O.sum(), q)
    q_ref = q.detach().requires_grad_()
    (g_ref,) = torch.autograd.grad(batch_oracle(q_ref, k_cache, v_cache, [5, 9])[0].sum(), q_ref)
    torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=1e-12)


def test_torch_func_grad_in_q():
    q, k_cache, v_cache, _ = problem(2, 2, 1, 8, 2, 0, seed=10)
    lengths = torch.tensor([5, 8])

    def f(q):
        O = fa.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True, num_splits=3)
        return O.square().sum()

    def f_ref(q):
        return batch_oracle(q, k_cache, v_cache, lengths.tolist())[0].square().sum()

    torch.testing.assert_close(torch.func.grad(f)(q), torch.func.grad(f_ref)(q), atol=1e-12, rtol=1e-12)


def test_low_precision_error_is_at_most_twice_plain_pytorchs():
    # flash-attn's rule: against a float64 reference, the error in bfloat16 is at most about twice that of
    # plain PyTorch in bfloat16 (partial outputs are kept in float32, so splitting costs no precision).
    q, k_cache, v_cache, _ = problem(2, 4, 2, 300, 1, 0, D=32, D_v=32, seed=12)
    lengths = [300, 129]
    O_ref, _ = batch_oracle(q, k_cache, v_cache, lengths)
    bf = [t.bfloat16() for t in (q, k_cache, v_cache)]
    O, lse = fa.flash_attention_with_kvcache(*bf, cache_seqlens=torch.tensor(lengths), num_splits=7, return_lse=True)
    assert O.dtype == torch.bfloat16 and lse.dtype == torch.float32
    plain = []
    for b, L in enumerate(lengths):  # plain PyTorch: bfloat16 matmuls and softmax
        k_b, v_b = (t[b, :, :L].repeat_interleave(2, dim=0) for t in bf[1:])
        S = (bf[0][b] @ k_b.transpose(1, 2)) / math.sqrt(32)  # (H_q, 1, D) @ (H_q, D, L) -> (H_q, 1, L)
        plain.append(torch.softmax(S, dim=-1) @ v_b)  # (H_q, 1, L) @ (H_q, L, D_v) -> (H_q, 1, D_v)
    err = (O.double() - O_ref).abs().max()
    err_plain = (torch.stack(plain).double() - O_ref).abs().max()
    assert err <= 2 * err_plain + 1e-5, (err, err_plain)


# ------------------------------------------------------------------------------------ split counts


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
    run = dispatch.run

    def recording(p, q, k, v, opts):
        seen.append((q.shape[2], k.shape[2], opts.mask.offset, opts.mask.causal))
        return run(p, q, k, v, opts)

    monkeypatch.setattr(dispatch, "run", recording)
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
    assert dispatch.plan_ranges(*(None,) * 4, "auto").backend == "online"


def test_cpu_default_is_one_split():
    q, k_cache, _, _ = problem(1, 2, 2, 8, 1, 0)
    assert splitkv.default_num_splits(q, k_cache, 8) == 1


# ----------------------------------------------------------------------------------------- errors


def bad(**changes):
    q, k_cache, v_cache, (k, v) = problem(2, 4, 2, 10, 1, 2)
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "cache_seqlens": torch.tensor([3, 4])}
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    [
        ({"cache_seqlens": torch.tensor([3, 4, 5])}, ValueError, r"cache_seqlens must have shape \(2,\)"),
        ({"cache_seqlens": torch.tensor([[3, 4]])}, ValueError, r"cache_seqlens must have shape \(2,\)"),
        ({"cache_seqlens": torch.tensor([3.0, 4.0])}, TypeError, "cache_seqlens must be int32 or int64"),
        ({"cache_seqlens": torch.tensor([3, -1])}, ValueError, r"cache_seqlens\[1\] = -1"),
        ({"cache_seqlens": 11}, ValueError, r"cache_seqlens must lie in \[0, N_max\] = \[0, 10\]"),
        ({"cache_seqlens": torch.tensor([3, 4], device="meta")}, ValueError, "cache_seqlens is on meta but q"),
        ({"cache_seqlens": "3"}, TypeError, "cache_seqlens must be an int32/int64 torch.Tensor"),
        ({"cache_seqlens": True}, TypeError, "cache_seqlens must be an int32/int64 torch.Tensor"),
        ({"cache_seqlens": torch.tensor([3, 9])}, ValueError, r"cache_seqlens\[1\] = 9 leaves no room.*N_max = 10"),
        ({"q": randn(2, 3, 1, 8, seed=0)}, ValueError, "H_q=3 must be a multiple of the key/value heads H_kv=2"),
        ({"k": randn(2, 1, 2, 8, seed=0)}, ValueError, "k and v must have the same H_kv and N_new_kv"),
        ({"k": randn(2, 2, 2, 5, seed=0), "v": randn(2, 2, 2, 6, seed=0)}, ValueError, "k and k_cache must have"),
        ({"v": None}, ValueError, "k and v must be given together"),
        ({"q": randn(3, 4, 1, 8, seed=0)}, ValueError, "batch size B"),
        ({"q": randn(2, 4, 1, 7, seed=0)}, ValueError, "q and k_cache must have the same head dimension D"),
        ({"q": randn(2, 4, 8, seed=0)}, ValueError, r"q must have shape \(B, H_q, N_new, D\)"),
        ({"k_cache": None}, TypeError, "k_cache must be a torch.Tensor"),
        ({"q": randn(2, 4, 1, 8, seed=0, dtype=torch.float32)}, TypeError, "must share one dtype"),
        ({"v_cache": randn(2, 2, 9, 6, seed=0)}, ValueError, "k_cache and v_cache must have the same H_kv and N_max"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(changes, error, words):
    with pytest.raises(error, match=words) as info:
        fa.flash_attention_with_kvcache(**bad(**changes))
    assert isinstance(info.value, fa.AttentionError)


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"num_splits": -1}, ValueError, "num_splits must be 0"),
        ({"num_splits": 1.5}, TypeError, "num_splits must be an int"),
        ({"alibi_slopes": torch.ones(3)}, ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\)"),
        ({"window": (-2, 0)}, ValueError, "window left"),
        ({"softcap": -1.0}, ValueError, "softcap must be"),
        ({"causal": 1}, TypeError, "causal must be a bool"),
        ({"backend": "fast"}, ValueError, "backend must be one of"),
    ],
)
def test_bad_options_name_the_argument(options, error, words):
    with pytest.raises(error, match=words):
        fa.flash_attention_with_kvcache(**bad(), **options)


def test_triton_refuses_what_its_kernel_cannot_run_with_the_reason():
    # bad()'s float64 tensors (or, without the interpreter, CPU tensors; or no triton at all)
    with pytest.raises(NotImplementedError, match="backend='triton' cannot run this decode call: "):
        fa.flash_attention_with_kvcache(**bad(), backend="triton")


def test_gradients_through_the_in_place_write_are_refused_by_name():
    args = bad()
    args["k"].requires_grad_()
    with pytest.raises(ValueError, match="k requires grad, but k and v are written into k_cache"):
        fa.flash_attention_with_kvcache(**args)
    with torch.no_grad():
        fa.flash_attention_with_kvcache(**args)  # no gradient wanted: allowed


def test_a_failed_check_writes_nothing():
    args = bad(cache_seqlens=torch.tensor([3, 9]))
    before = args["k_cache"].clone()
    with pytest.raises(ValueError):
        fa.flash_attention_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before)
