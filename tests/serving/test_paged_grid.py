"""Paged KV caches, ``cache_leftpad`` and sinks in ``flash_attention_with_kvcache`` on every CPU backend:
the grid of ``paged_cases.py`` against its float64 oracle and its expected pools; the contiguous cache
through a block table of identity pages; gradients into ``q`` and ``sinks``; and negative controls that
show the checks would see a wrong write or a wrong page."""

from __future__ import annotations

import pytest
import torch

import flashattn_teach as fa

from decode_cases import CPU_BACKENDS, tiles
from paged_cases import (
    CASES,
    HEADS,
    PAGE_SIZES,
    SPLITS,
    STEPS,
    VARIANTS,
    call,
    expected_pools,
    gather,
    make_problem,
    oracle,
    run_case,
)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_paged_decode_matches_the_oracle_and_writes_only_the_new_slots(case, backend):
    with tiles(2, 5):  # several key tiles per range, so the pages' seams fall inside and between tiles
        run_case(case, backend)


@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_paged_cache_gives_the_contiguous_cache_result(page_size):
    """The same keys, contiguous ``(B, H_kv, N_max, D)`` or cut into pages of a pool in a shuffled order:
    the same output (up to the order of the sums inside a tile, none here: one range, whole tiles)."""
    B, H_q, H_kv, N_max, D = 2, 4, 2, 4 * page_size, 8
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H_q, 1, D, generator=g, dtype=torch.float64)
    k_cache = torch.randn(B, H_kv, N_max, D, generator=g, dtype=torch.float64)
    v_cache = torch.randn(B, H_kv, N_max, D, generator=g, dtype=torch.float64)
    lengths = torch.tensor([N_max - 2, page_size + 1], dtype=torch.int32)
    table = torch.randperm(B * 4, generator=g).reshape(B, 4).to(torch.int32)
    k_pool = torch.empty(B * 4, H_kv, page_size, D, dtype=torch.float64)
    v_pool = torch.empty_like(k_pool)
    for b in range(B):
        for p in range(4):  # page p of sequence b: its keys [p * page_size, (p + 1) * page_size)
            k_pool[table[b, p]] = k_cache[b, :, p * page_size : (p + 1) * page_size]
            v_pool[table[b, p]] = v_cache[b, :, p * page_size : (p + 1) * page_size]
    O_contiguous = fa.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    O_paged = fa.flash_attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths, block_table=table)
    torch.testing.assert_close(O_paged, O_contiguous, atol=1e-14, rtol=1e-14)


def test_a_consecutive_run_of_pages_in_flash_attn_layout_is_read_without_a_copy():
    """flash-attn's pools ``(num_blocks, page_size, H_kv, D)`` hold consecutive pages back to back for each
    head, so a range over pages ``7, 8, 9`` is a strided view of the pool (no gather)."""
    from flashattn_teach.serving.pages import element_caches

    pool = torch.randn(12, 4, 2, 8).transpose(1, 2)  # (num_blocks, H_kv, page_size, D), a view
    table = torch.tensor([[7, 8, 9, 0]], dtype=torch.int32)
    (cache,) = element_caches(pool, pool, table)
    k, _ = cache.read(2, 11)  # positions [2, 11): pages 7, 8, 9
    assert k.shape == (1, 2, 9, 8)
    assert k.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()  # a view of the pool
    torch.testing.assert_close(k[0, :, 0], pool[7, :, 2])
    torch.testing.assert_close(k[0, :, 8], pool[9, :, 2])
    shuffled = torch.tensor([[7, 3, 9, 0]], dtype=torch.int32)
    k, _ = element_caches(pool, pool, shuffled)[0].read(2, 11)
    assert k.untyped_storage().data_ptr() != pool.untyped_storage().data_ptr()  # gathered
    torch.testing.assert_close(k[0, :, 2], pool[3, :, 0])


@pytest.mark.parametrize("backend", ["parallel", "dense"])
def test_gradients_into_q_and_sinks_match_the_oracle(backend):
    """With ``k, v`` None, ``q``, ``sinks`` and the pools are differentiable (the pages read, nothing else);
    the oracle's float64 autograd gives the reference gradients."""
    case = next(c for c in CASES if c.variant == "all" and c.N_new_kv == 0)
    p = make_problem(case)
    p.k_pool, p.v_pool = p.k_pool.detach().requires_grad_(), p.v_pool.detach().requires_grad_()
    for t in (p.q, p.options["sinks"]):
        t.requires_grad_(True)
    O, lse = call(p, backend, lengths=case.lengths)
    O_ref, lse_ref = oracle(p, p.k_pool, p.v_pool, case.lengths)
    w = torch.randn(O.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    inputs = (p.q, p.options["sinks"], p.k_pool, p.v_pool)
    grads = torch.autograd.grad((O * w).sum() + lse.sum(), inputs)
    grads_ref = torch.autograd.grad((O_ref * w).sum() + lse_ref.sum(), inputs)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert grads[1].abs().sum() > 0  # the control: the sinks do reach the output


def test_a_row_that_sees_no_key_gives_zero_and_the_sink():
    case = next(c for c in CASES if c.variant == "sinks" and c.N_new_kv == 0)
    p = make_problem(case)
    O, lse = call(p, "parallel", lengths=case.lengths)
    assert case.lengths[1] == 0  # batch element 1 has no key
    assert torch.equal(O[1], torch.zeros_like(O[1]))
    torch.testing.assert_close(lse[1], p.options["sinks"][:, None].expand_as(lse[1]), atol=0, rtol=0)


def test_the_pool_check_sees_a_wrong_write():
    """Negative control of ``run_case``'s pool check: a step written through a different table leaves the
    pools unlike the expected ones."""
    case = next(c for c in CASES if c.N_new_kv > 0 and c.page_size == 3)
    p = make_problem(case)
    k_want, _ = expected_pools(p, case.lengths)
    swapped = p.block_table.clone()
    written = case.lengths[0] // case.page_size  # the page sequence 0's first new key goes to
    swapped[0, [0, written]] = swapped[0, [written, 0]]  # that page and the first exchanged
    fa.flash_attention_with_kvcache(
        p.q,
        p.k_pool,
        p.v_pool,
        p.k,
        p.v,
        cache_seqlens=torch.tensor(case.lengths),
        block_table=swapped,
        **p.options,
    )
    assert not torch.equal(p.k_pool, k_want)


def test_the_oracle_sees_a_wrong_page():
    """Negative control of the oracle: a table that points one page of a sequence elsewhere (a page of the
    pool no sequence is given) changes the oracle's ``O``. (Exchanging two of its pages would not, without
    a position-dependent mask: attention of one query is invariant under a permutation of its keys.)"""
    case = next(c for c in CASES if c.variant == "plain" and c.page_size == 3)
    p = make_problem(case)
    O, _ = call(p, "dense", lengths=case.lengths)
    spare = sorted(set(range(p.k_pool.shape[0])) - set(p.block_table.flatten().tolist()))[0]
    p.block_table[2, 1] = spare
    O_ref, _ = oracle(p, p.k_pool, p.v_pool, case.lengths)
    assert (O[2] - O_ref[2]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_paged_error_is_at_most_twice_plain_torchs(dtype):
    """flash-attn's rule: against the float64 oracle, the paged step's error in ``dtype`` is at most about
    twice that of plain PyTorch attention in the same dtype (SDPA on the gathered keys, the mask built by
    hand)."""
    case = next(c for c in CASES if c.N_new == 3 and c.variant == "causal")
    p = make_problem(case, dtype=dtype)
    k_want, v_want = expected_pools(p, case.lengths)
    O, _ = call(p, "parallel", lengths=case.lengths)
    p64 = make_problem(case)  # the same numbers in float64 (the inputs were rounded from them)
    for name in ("q", "k_pool", "v_pool", "k", "v"):
        setattr(p64, name, getattr(p, name).double())
    O_ref, _ = oracle(p64, k_want.double(), v_want.double(), case.lengths)
    G = case.H_q // case.H_kv
    errors = []
    for b, n in enumerate(case.lengths):
        L = n + case.N_new_kv
        k, v = (gather(pool, p.block_table[b], L).repeat_interleave(G, dim=0) for pool in (k_want, v_want))
        pos = L - case.N_new + torch.arange(case.N_new)[:, None]  # (N_new, 1)
        mask = torch.arange(L)[None, :] <= pos  # (N_new, L), causal bottom-right
        torch_O = torch.nn.functional.scaled_dot_product_attention(p.q[b], k, v, attn_mask=mask)
        errors.append((torch_O.double() - O_ref[b]).abs().max())
    torch_error = max(errors)
    ours = (O.double() - O_ref).abs().max()
    assert ours <= 2 * torch_error + 1e-3 * torch.finfo(dtype).eps, (ours, torch_error)


def test_the_grid_meets_every_factor_with_every_variant():
    """The sample is not the full product, but each variant meets every page size, step kind (decode,
    chunked prefill, no new keys), head layout (GQA, MQA, H_q = H_kv), split count and pool layout."""
    for variant in VARIANTS:
        cases = [c for c in CASES if c.variant == variant]
        assert {c.page_size for c in cases} == set(PAGE_SIZES)
        assert {(c.N_new, c.N_new_kv) for c in cases} == set(STEPS)
        assert {(c.H_q, c.H_kv) for c in cases} == set(HEADS)
        assert {c.num_splits for c in cases} == set(SPLITS)
        assert {c.flash_attn_layout for c in cases} == {False, True}
