"""``create_block_mask`` and ``BlockMask`` against torch's own (``torch.nn.attention.flex_attention``, which
builds its block mask from the dense mask on the CPU): the same kinds and the same index lists, bit for bit,
for the common masks at awkward lengths and block sizes; the re-tiling and the element-level views checked
against a brute-force dense computation; and an allocation probe showing that nothing ``N_q x N_k`` is ever
allocated at N = 16384, with torch's create_block_mask as the control that does allocate it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention import flex_attention as torch_flex

from flashattn_teach import BlockMask, and_masks, create_block_mask, noop_mask, or_masks
from flashattn_teach.errors import AttentionTypeError, AttentionValueError
from flashattn_teach.flex import classify
from flashattn_teach.flex.mods import KIND_FULL, KIND_PARTIAL, KIND_SKIP

from allocation_probe import LargestAllocation

WINDOW, PREFIX = 48, 40
LISTS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX) | (q_idx >= kv_idx)


def dilated_window(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx) % 2 == 0) & (q_idx >= kv_idx) & (q_idx - kv_idx <= 4 * WINDOW)


def head_window(b, h, q_idx, kv_idx):
    """A window that widens with the head: its result depends on h, not on b."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 16 * (h + 1))


def document_mask(N: int, B: int = 2):
    """Document masking over a captured ``(B, N)`` document-id tensor, different documents per batch element."""
    g = torch.Generator().manual_seed(N)
    lengths = torch.randint(1, max(2, N // 3), (B, N), generator=g)
    doc = torch.stack([torch.repeat_interleave(torch.arange(N), row)[:N] for row in lengths])

    def same_document(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    return same_document


def _assert_like_torch(ours: BlockMask, theirs) -> None:
    for name in LISTS:
        a, t = getattr(ours, name), getattr(theirs, name)
        assert (a is None) == (t is None), name
        if t is not None:
            assert a.dtype == t.dtype and a.shape == t.shape, (name, a.dtype, a.shape, t.dtype, t.shape)
            assert torch.equal(a, t), name
    assert ours.shape == theirs.shape
    assert ours.BLOCK_SIZE == theirs.BLOCK_SIZE and ours.seq_lengths == theirs.seq_lengths
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert ours.sparsity() == pytest.approx(theirs.sparsity())


MASKS = {"causal": causal, "sliding_window": sliding_window, "prefix_lm": prefix_lm, "dilated_window": dilated_window}


@pytest.mark.parametrize("N", [113, 203, 1000])
@pytest.mark.parametrize("BLOCK_SIZE", [128, (64, 32)])
@pytest.mark.parametrize("name", [*MASKS, "document"])
def test_kinds_and_index_lists_equal_torchs_create_block_mask(name, BLOCK_SIZE, N):
    mask_mod, B, H = (document_mask(N), 2, None) if name == "document" else (MASKS[name], None, None)
    ours = create_block_mask(mask_mod, B, H, N, N, device="cpu", BLOCK_SIZE=BLOCK_SIZE)
    _assert_like_torch(ours, torch_flex.create_block_mask(mask_mod, B, H, N, N, device="cpu", BLOCK_SIZE=BLOCK_SIZE))


@given(
    N_q=st.integers(1, 300),
    N_k=st.integers(1, 300),
    block=st.tuples(st.sampled_from([8, 16, 32, 48, 128]), st.sampled_from([8, 16, 32, 48, 128])),
    left=st.integers(0, 300),
    right=st.integers(-50, 300),
    B=st.sampled_from([None, 1, 2]),
)
def test_any_window_at_any_lengths_and_block_sizes_equals_torchs(N_q, N_k, block, left, right, B):
    def window(b, h, q_idx, kv_idx):  # keys [q - left, q + right], a per-batch shift when B = 2
        shift = q_idx + 7 * b
        return (kv_idx >= shift - left) & (kv_idx <= shift + right)

    ours = create_block_mask(window, B, 2, N_q, N_k, device="cpu", BLOCK_SIZE=block)
    _assert_like_torch(ours, torch_flex.create_block_mask(window, B, 2, N_q, N_k, device="cpu", BLOCK_SIZE=block))


@pytest.mark.parametrize("Q_LEN, KV_LEN", [(113, 203), (203, 113), (1, 1000)])
@pytest.mark.parametrize("name", list(MASKS))
def test_rectangular_masks_equal_torchs(name, Q_LEN, KV_LEN):
    ours = create_block_mask(MASKS[name], 2, 3, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=(64, 32))
    theirs = torch_flex.create_block_mask(MASKS[name], 2, 3, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=(64, 32))
    _assert_like_torch(ours, theirs)


def test_a_mask_that_reads_neither_b_nor_h_is_classified_once_and_broadcast():
    ours = create_block_mask(causal, 2, 3, 203, 203, device="cpu", BLOCK_SIZE=32)
    assert ours.block_kinds.shape == (1, 1, 7, 7)
    assert ours.kv_indices.shape == (2, 3, 7, 7)  # torch's attributes at the requested B, H
    _assert_like_torch(ours, torch_flex.create_block_mask(causal, 2, 3, 203, 203, device="cpu", BLOCK_SIZE=32))


def test_a_mask_that_reads_h_keeps_the_head_dim_and_broadcasts_the_batch():
    ours = create_block_mask(head_window, 2, 3, 203, 203, device="cpu", BLOCK_SIZE=16)
    assert ours.block_kinds.shape == (1, 3, 13, 13)
    assert not torch.equal(ours.block_kinds[:, 0], ours.block_kinds[:, 2])
    _assert_like_torch(ours, torch_flex.create_block_mask(head_window, 2, 3, 203, 203, device="cpu", BLOCK_SIZE=16))


def test_document_masks_keep_the_batch_dim_and_broadcast_the_heads():
    mask_mod = document_mask(203)
    ours = create_block_mask(mask_mod, 2, 4, 203, 203, device="cpu", BLOCK_SIZE=32)
    assert ours.block_kinds.shape == (2, 1, 7, 7)
    _assert_like_torch(ours, torch_flex.create_block_mask(mask_mod, 2, 4, 203, 203, device="cpu", BLOCK_SIZE=32))


@pytest.mark.parametrize("B, H", [(None, None), (None, 3), (2, None)])
def test_none_batch_or_heads_mean_one_as_in_torch(B, H):
    ours = create_block_mask(head_window, B, H, 113, 113, device="cpu", BLOCK_SIZE=32)
    theirs = torch_flex.create_block_mask(head_window, B, H, 113, 113, device="cpu", BLOCK_SIZE=32)
    assert ours.shape == theirs.shape == (B or 1, H or 1, 113, 113)
    _assert_like_torch(ours, theirs)


def test_without_separate_full_blocks_every_computed_block_is_partial_as_in_torch():
    mask_mod = document_mask(203)
    ours = create_block_mask(mask_mod, 2, None, 203, 203, device="cpu", BLOCK_SIZE=32, separate_full_blocks=False)
    theirs = torch_flex.create_block_mask(
        mask_mod, 2, None, 203, 203, device="cpu", BLOCK_SIZE=32, separate_full_blocks=False
    )
    assert ours.full_kv_indices is None and not bool((ours.block_kinds == KIND_FULL).any())
    _assert_like_torch(ours, theirs)


@pytest.mark.parametrize("threads", ["inline", "pool"])
@pytest.mark.parametrize("chunk_elements", [1, 5000, 1 << 30])
def test_the_kinds_do_not_depend_on_the_chunk_size_or_the_threads(chunk_elements, threads, monkeypatch):
    """From one tile a chunk (1 element asks for one) to the whole grid at once, in the calling thread or on
    the worker threads: the same table."""
    monkeypatch.setattr(classify, "MIN_PARALLEL_ELEMENTS", 2**62 if threads == "inline" else 0)
    mask_mod = document_mask(203)
    some, every = classify.tile_visibility(
        mask_mod, 2, 3, 203, 150, 32, 16, torch.device("cpu"), chunk_elements=chunk_elements
    )
    dense = mask_mod(torch.arange(2).view(2, 1, 1, 1), None, torch.arange(203)[:, None], torch.arange(150)[None, :])
    padded = torch.nn.functional.pad(dense, (0, 160 - 150, 0, 224 - 203)).view(2, 1, 7, 32, 10, 16)
    assert torch.equal(some, padded.any(dim=(3, 5)))
    assert torch.equal(every, padded.all(dim=(3, 5)))


# ---- tile_kinds, visible_blocks, full_blocks against a dense computation


def _element_kinds(mask: BlockMask) -> torch.Tensor:
    """(B|1, H|1, N_q, N_k): each element's block kind, by repeating every block over its elements."""
    (N_q, N_k), (bm, bn) = mask.seq_lengths, mask.BLOCK_SIZE
    kinds = mask.block_kinds.repeat_interleave(bm, dim=2).repeat_interleave(bn, dim=3)
    return kinds[:, :, :N_q, :N_k]


def _dense(mask_mod, B: int, H: int, N_q: int, N_k: int) -> torch.Tensor:
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    return mask_mod(b, h, torch.arange(N_q)[:, None], torch.arange(N_k)[None, :]).broadcast_to(B, H, N_q, N_k)


def _per_tile(x: torch.Tensor, bm: int, bn: int, fill: bool, reduce: str) -> torch.Tensor:
    """``x`` (B, H, N_q, N_k) bool reduced over each ``bm x bn`` tile (a ragged tile padded with ``fill``)."""
    B, H, N_q, N_k = x.shape
    T_r, T_c = -(-N_q // bm), -(-N_k // bn)
    x = torch.nn.functional.pad(x, (0, T_c * bn - N_k, 0, T_r * bm - N_q), value=fill)
    x = x.reshape(B, H, T_r, bm, T_c, bn)
    return x.all(dim=5).all(dim=3) if reduce == "all" else x.any(dim=5).any(dim=3)


@pytest.mark.parametrize("tiling", [(32, 64), (16, 16), (48, 80), (200, 7), (1, 1), (512, 512)])
@pytest.mark.parametrize("name", ["document", "head_window", "prefix_lm"])
def test_tile_kinds_are_the_conservative_summary_of_the_blocks_each_tile_overlaps(name, tiling):
    N_q, N_k = 203, 170
    mask_mod = {"document": document_mask(203), "head_window": head_window, "prefix_lm": prefix_lm}[name]
    mask = create_block_mask(mask_mod, 2, 2, N_q, N_k, device="cpu", BLOCK_SIZE=(32, 16))
    bm, bn = tiling
    out = mask.tile_kinds(bm, bn)
    assert out.dtype == torch.int8 and out.shape == (*mask.block_kinds.shape[:2], -(-N_q // bm), -(-N_k // bn))
    # every element's block kind, each tile summarised over its (clipped) elements
    element = _element_kinds(mask)
    all_skip = _per_tile(element == KIND_SKIP, bm, bn, fill=True, reduce="all")
    all_full = _per_tile(element == KIND_FULL, bm, bn, fill=True, reduce="all")
    expect = torch.full(all_skip.shape, KIND_PARTIAL, dtype=torch.int8)
    expect[all_skip] = KIND_SKIP
    expect[all_full] = KIND_FULL
    assert torch.equal(out, expect)
    # sound for the mask itself: no element of a SKIP tile visible, every one of a FULL tile
    truth = _dense(mask_mod, 2, 2, N_q, N_k)
    some = _per_tile(truth, bm, bn, fill=False, reduce="any")
    every = _per_tile(truth, bm, bn, fill=True, reduce="all")
    kinds = out.expand(2, 2, -1, -1)
    assert not some[kinds == KIND_SKIP].any() and every[kinds == KIND_FULL].all()
    assert mask.tile_kinds(bm, bn) is out  # cached


def test_tile_kinds_at_the_masks_own_block_size_are_its_kinds():
    mask = create_block_mask(causal, None, None, 203, 203, device="cpu", BLOCK_SIZE=(64, 32))
    assert torch.equal(mask.tile_kinds(64, 32), mask.block_kinds)


@pytest.mark.parametrize("region", [(0, 203, 0, 170), (30, 97, 5, 151), (200, 203, 169, 170), (64, 64, 0, 10)])
def test_visible_and_full_blocks_rebuild_the_mask_with_mask_mod_on_partial_blocks(region):
    """The lead's formula on a tile: visible = visible_blocks & (full_blocks | mask_mod) is the mask itself."""
    r0, r1, c0, c1 = region
    mask_mod = document_mask(203)
    mask = create_block_mask(mask_mod, 2, None, 203, 170, device="cpu", BLOCK_SIZE=(32, 16))
    seen, full = mask.visible_blocks(*region), mask.full_blocks(*region)
    assert seen.shape == full.shape == (2, 1, r1 - r0, c1 - c0) and seen.dtype == full.dtype == torch.bool
    element = _element_kinds(mask)[:, :, r0:r1, c0:c1]
    assert torch.equal(seen, element != KIND_SKIP) and torch.equal(full, element == KIND_FULL)
    b = torch.arange(2).view(2, 1, 1, 1)
    user = mask_mod(b, None, torch.arange(r0, r1)[:, None], torch.arange(c0, c1)[None, :])
    truth = _dense(mask_mod, 2, 1, 203, 170)[:, :, r0:r1, c0:c1]
    assert torch.equal(seen & (full | user), truth)


def test_a_region_outside_the_sequences_is_refused_by_its_bounds():
    mask = create_block_mask(causal, None, None, 100, 100, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(AttentionValueError, match=r"rows \[90, 110\)"):
        mask.visible_blocks(90, 110, 0, 10)


# ---- torch's constructor, the combinators, the refusals


@pytest.mark.parametrize("separate_full_blocks", [True, False])
def test_from_kv_blocks_of_torchs_lists_gives_the_same_kinds_and_torchs_transposed_lists(separate_full_blocks):
    mask_mod = document_mask(203)
    theirs = torch_flex.create_block_mask(
        mask_mod, 2, 3, 203, 203, device="cpu", BLOCK_SIZE=32, separate_full_blocks=separate_full_blocks
    )
    lists = (theirs.kv_num_blocks, theirs.kv_indices, theirs.full_kv_num_blocks, theirs.full_kv_indices)
    rebuilt = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=32, mask_mod=mask_mod, seq_lengths=(203, 203))
    ours = create_block_mask(
        mask_mod, 2, 3, 203, 203, device="cpu", BLOCK_SIZE=32, separate_full_blocks=separate_full_blocks
    )
    assert torch.equal(rebuilt.block_kinds, ours.block_kinds.expand(2, 3, 7, 7))
    _assert_like_torch(rebuilt, theirs)
    # torch's lists without batch dims, and without the transposed ones
    flat = BlockMask.from_kv_blocks(theirs.kv_num_blocks[1, 2], theirs.kv_indices[1, 2], compute_q_blocks=False)
    assert flat.shape == (7 * 128, 7 * 128) and flat.q_indices is None
    assert flat.block_kinds.shape == (1, 1, 7, 7)
    assert torch.equal(flat.block_kinds[0, 0] != KIND_SKIP, ours.block_kinds[1, 0] == KIND_PARTIAL)


def test_from_kv_blocks_refuses_a_block_listed_as_partial_and_full():
    one = torch.ones(1, 1, 1, dtype=torch.int32)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.int32)
    with pytest.raises(AttentionValueError, match="both in kv_indices and in full_kv_indices"):
        BlockMask.from_kv_blocks(one, zero, one, zero)


def _grid(B: int = 2, H: int = 3, N: int = 50):
    return (
        torch.arange(B).view(B, 1, 1, 1),
        torch.arange(H).view(1, H, 1, 1),
        torch.arange(N)[:, None],
        torch.arange(N)[None, :],
    )


@pytest.mark.parametrize("mods", [(), (causal,), (causal, sliding_window, head_window), (prefix_lm, dilated_window)])
def test_and_or_and_noop_masks_agree_with_torchs(mods):
    grid = _grid()
    for ours, theirs in ((and_masks, torch_flex.and_masks), (or_masks, torch_flex.or_masks)):
        a, t = ours(*mods)(*grid), theirs(*mods)(*grid)
        assert a.dtype == torch.bool and torch.equal(*torch.broadcast_tensors(a, t))
    assert torch.equal(noop_mask(*grid), torch_flex.noop_mask(*grid))
    combined = and_masks(*mods, head_window)
    ours_mask = create_block_mask(combined, 2, 3, 113, 113, device="cpu", BLOCK_SIZE=16)
    _assert_like_torch(ours_mask, torch_flex.create_block_mask(combined, 2, 3, 113, 113, device="cpu", BLOCK_SIZE=16))


def test_the_combinators_refuse_a_non_function_by_position():
    with pytest.raises(AttentionTypeError, match="argument 1 is a int"):
        and_masks(causal, 3)


def test_refusals_name_the_argument():
    with pytest.raises(AttentionValueError, match="compute_dq_write_order"):
        create_block_mask(causal, 1, 1, 64, 64, device="cpu", compute_dq_write_order=True)
    with pytest.raises(AttentionTypeError, match="score_mod"):
        create_block_mask(lambda score, b, h, q, kv: score, 1, 1, 64, 64, device="cpu")
    with pytest.raises(AttentionTypeError, match="bool tensor"):
        create_block_mask(lambda b, h, q, kv: (q - kv).float(), 1, 1, 64, 64, device="cpu")
    with pytest.raises(AttentionValueError, match="for one element"):
        create_block_mask(lambda b, h, q, kv: (q >= kv).flatten(), 1, 1, 64, 64, device="cpu")
    with pytest.raises(AttentionValueError, match="BLOCK_SIZE"):
        create_block_mask(causal, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=(64, 0))
    with pytest.raises(AttentionValueError, match="Q_LEN"):
        create_block_mask(causal, 1, 1, 0, 64, device="cpu")


def test_compile_is_accepted_with_a_warning_and_changes_nothing():
    with pytest.warns(DeprecationWarning, match="_compile"):
        compiled = create_block_mask(causal, 1, 1, 113, 113, device="cpu", BLOCK_SIZE=32, _compile=True)
    assert torch.equal(
        compiled.block_kinds, create_block_mask(causal, 1, 1, 113, 113, device="cpu", BLOCK_SIZE=32).block_kinds
    )


def test_repr_and_str_are_torchs():
    # 4 x 4 blocks of 64, the last query block ragged (rows 192..202): both draw the same picture and counts
    mask = create_block_mask(causal, 2, None, 203, 203, device="cpu", BLOCK_SIZE=64)
    theirs = torch_flex.create_block_mask(causal, 2, None, 203, 203, device="cpu", BLOCK_SIZE=64)
    assert repr(mask) == repr(theirs) and str(mask) == str(theirs)
    assert "shape=(2, 1, 203, 203)" in repr(mask) and "██" in str(mask) and "░░" not in str(mask)


# ---- no N_q x N_k at N = 16384


N_LARGE = 16384


def test_create_block_mask_at_16384_allocates_nothing_n_by_n(monkeypatch):
    # dispatch modes are per thread: the chunks run in this one (the same ops the worker threads run)
    monkeypatch.setattr(classify, "MIN_PARALLEL_ELEMENTS", 2**62)
    mask_mod = document_mask(N_LARGE)
    with LargestAllocation() as probe:
        mask = create_block_mask(mask_mod, 2, None, N_LARGE, N_LARGE, device="cpu")
        mask.kv_indices, mask.q_indices  # noqa: B018 (torch's lists are derived on first use: count them too)
    assert probe.largest <= classify.CHUNK_ELEMENTS < N_LARGE * N_LARGE
    assert probe.largest >= 128 * 128  # the probe does see the classification's own work: a tile


def test_the_probe_sees_torchs_create_block_mask_allocate_n_by_n():
    with LargestAllocation() as probe:
        torch_flex.create_block_mask(causal, None, None, N_LARGE, N_LARGE, device="cpu")
    assert probe.largest >= N_LARGE * N_LARGE
