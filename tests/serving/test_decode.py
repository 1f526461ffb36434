"""Decoding against a KV cache: ``flash_attention_with_kvcache`` against the float64 oracle of
``decode_cases.py`` for every cache length, split count, variant and backend; the in-place write of the new
entries; gradients; and low-precision error.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flashattn_teach as fa

from decode_cases import CPU_BACKENDS, assert_matches, batch_oracle, problem, randn, slopes_of, tiles

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
