"""The cases of torch's FlexAttention tests that this library failed, rebuilt here so CI needs no checkout.

``tools/run_torch_flex_tests.py`` runs torch's own ``test_flex_attention.py`` and ``test_flex_decoding.py``
against this library; these are the shapes of its failures, each judged against torch's eager
``flex_attention`` (or torch's ``BlockMask``) on the same inputs, in float64:

- grouped-query attention with one query row (every GQA decode step), with a ``score_mod``, a ``mask_mod``
  and a ``block_mask``, at the head ratios torch's decoding tests use;
- the index idioms torch's tests and attention-gym write in their functions (``bias[b][q_idx]``,
  ``bias[q_idx][kv_idx]``, a latent-attention dot product, a gathered row indexed again), at a size under
  and a size over the 2^19 scores where the CPU path changes how it calls the functions;
- BlockMask's indexing, ``_adjust``, ``to_string`` and torch's keyword constructor.

Each case failed before its fix (issue 35) and passes now.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

import flashattn_teach as fa

F64 = torch.float64


def _qkv(B: int, H_q: int, H_kv: int, N_q: int, N_k: int, D: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_q, N_q, D, generator=g, dtype=F64)
    k = torch.randn(B, H_kv, N_k, D, generator=g, dtype=F64)
    v = torch.randn(B, H_kv, N_k, D, generator=g, dtype=F64)
    return q, k, v


def _torch_eager(q, k, v, score_mod=None, mask_mod=None, mask_shape=(None, None)):
    """torch's eager flex_attention, with its own block mask when a mask_mod is given."""
    block_mask = None
    if mask_mod is not None:
        B, H = mask_shape
        block_mask = torch_flex.create_block_mask(mask_mod, B, H, q.shape[-2], k.shape[-2], device="cpu")
    return torch_flex.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=q.shape[1] != k.shape[1])


def _ours(q, k, v, score_mod=None, mask_mod=None, mask_shape=(None, None)):
    block_mask = None
    if mask_mod is not None:
        B, H = mask_shape
        block_mask = fa.create_block_mask(mask_mod, B, H, q.shape[-2], k.shape[-2], device="cpu")
    return fa.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=q.shape[1] != k.shape[1])


# ---------------------------------------------------------------- GQA with one query row

# (H_q, H_kv) from torch's test_flex_decoding (test_Hq_Hkv and its default (16, 8)); (4, 4) is the control.
GQA_HEADS = [
    (16, 1),
    (8, 2),
    (16, 8),
    pytest.param(4, 4, id="no-gqa-control"),
]


def _times_two_plus_head(score, b, h, q_idx, kv_idx):
    return score * 2 + h


def _every_third_key_hidden(b, h, q_idx, kv_idx):
    return kv_idx % 3 != 0


def _head_dependent_window(b, h, q_idx, kv_idx):
    return kv_idx >= 8 * h + q_idx


@pytest.mark.parametrize(("H_q", "H_kv"), GQA_HEADS)
def test_one_row_gqa_applies_score_mod_as_torch(H_q, H_kv):
    q, k, v = _qkv(2, H_q, H_kv, 1, 200)
    expected = _torch_eager(q, k, v, score_mod=_times_two_plus_head)
    torch.testing.assert_close(_ours(q, k, v, score_mod=_times_two_plus_head), expected)


@pytest.mark.parametrize(("H_q", "H_kv"), GQA_HEADS)
def test_one_row_gqa_applies_mask_mod_as_torch(H_q, H_kv):
    q, k, v = _qkv(2, H_q, H_kv, 1, 200)
    expected = _torch_eager(q, k, v, mask_mod=_every_third_key_hidden)
    torch.testing.assert_close(_ours(q, k, v, mask_mod=_every_third_key_hidden), expected)


@pytest.mark.parametrize(("H_q", "H_kv"), GQA_HEADS)
def test_one_row_gqa_applies_a_per_head_block_mask_as_torch(H_q, H_kv):
    """A block mask of shape (B, H_q): each query head of a key/value group sees its own keys."""
    q, k, v = _qkv(2, H_q, H_kv, 1, 300)
    shape = (2, H_q)
    expected = _torch_eager(q, k, v, _times_two_plus_head, _head_dependent_window, shape)
    torch.testing.assert_close(_ours(q, k, v, _times_two_plus_head, _head_dependent_window, shape), expected)


# ---------------------------------------------------------------- index idioms

# B=2, H=4: N=64 is 2^15 scores (one call of the functions over every (b, h)); N=256 is 2^19 (one per (b, h)).
SMALL, LARGE = 64, 256


@pytest.mark.parametrize("N", [SMALL, LARGE])
def test_chained_batch_then_query_index_as_torch(N):
    """``bias[b][q_idx]``: torch calls the function per element, so ``bias[b]`` is one row of ``bias``."""
    bias = torch.randn(2, N, generator=torch.Generator().manual_seed(1), dtype=F64)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b][q_idx]

    q, k, v = _qkv(2, 4, 4, N, N)
    torch.testing.assert_close(_ours(q, k, v, score_mod), _torch_eager(q, k, v, score_mod))


@pytest.mark.parametrize("N", [SMALL, LARGE])
def test_chained_query_then_key_index_as_torch(N):
    """``bias[q_idx][kv_idx]``, as torch's ``rel_pos_2d_index_multiple`` writes it."""
    bias = torch.randn(N, N, generator=torch.Generator().manual_seed(2), dtype=F64)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx][kv_idx]

    q, k, v = _qkv(2, 4, 4, N, N)
    torch.testing.assert_close(_ours(q, k, v, score_mod), _torch_eager(q, k, v, score_mod))


@pytest.mark.parametrize("N", [SMALL, LARGE])
def test_latent_attention_dot_product_as_torch(N):
    """attention-gym's MLA score_mod: ``torch.dot`` of one query's and one key's rotary parts."""
    g = torch.Generator().manual_seed(3)
    query_rope = torch.randn(2, 4, N, 8, generator=g, dtype=F64)
    key_rope = torch.randn(2, 1, N, 8, generator=g, dtype=F64)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + 0.5 * torch.dot(query_rope[b, h, q_idx], key_rope[b, h // 4, kv_idx])

    q, k, v = _qkv(2, 4, 1, N, N)
    torch.testing.assert_close(_ours(q, k, v, score_mod), _torch_eager(q, k, v, score_mod))


@pytest.mark.parametrize("N", [SMALL, LARGE])
def test_row_gathered_then_indexed_as_torch(N):
    """attention-gym's vision cross-attention mask: ``interval = intervals[image_of[kv_idx]]``, then
    ``interval[0]`` and ``interval[1]``, the start and end of one image's interval."""
    images, per_image = 3, N // 4
    intervals = torch.tensor([[0, N // 2], [N // 4, N], [N // 2, N]])
    image_of = torch.arange(images).repeat_interleave(per_image)

    def mask_mod(b, h, q_idx, kv_idx):
        interval = intervals[image_of[kv_idx]]
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    q, k, v = _qkv(2, 4, 4, N, images * per_image)
    expected = _torch_eager(q, k, v, mask_mod=mask_mod, mask_shape=(2, 4))
    torch.testing.assert_close(_ours(q, k, v, mask_mod=mask_mod, mask_shape=(2, 4)), expected)


# ---------------------------------------------------------------- BlockMask's API


def _document(b, h, q_idx, kv_idx):
    return ((q_idx + 37 * b + 11 * h) // 96 == (kv_idx + 37 * b + 11 * h) // 96) & (q_idx >= kv_idx)


def _both_masks(B=3, H=2, N_q=300, N_k=300):
    ours = fa.create_block_mask(_document, B, H, N_q, N_k, device="cpu")
    theirs = torch_flex.create_block_mask(_document, B, H, N_q, N_k, device="cpu")
    return ours, theirs


def _assert_same_mask(ours, theirs):
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        mine, torchs = getattr(ours, name), getattr(theirs, name)
        n = torchs.shape[-1] if name.endswith("indices") else None
        # index lists past each row's count are padding that torch and this library may fill differently
        counts = getattr(theirs, name.replace("indices", "num_blocks"))
        if n is not None:
            valid = torch.arange(n) < counts.unsqueeze(-1)
            mine, torchs = mine[..., :n].masked_fill(~valid, -1), torchs.masked_fill(~valid, -1)
        assert torch.equal(mine, torchs), name
    assert tuple(ours.seq_lengths) == tuple(theirs.seq_lengths)
    assert torch.equal(ours.to_dense(), theirs.to_dense())


def test_block_masks_built_alike_agree():
    """The comparison the BlockMask cases rest on: the two libraries' masks from one mask_mod agree."""
    _assert_same_mask(*_both_masks())


@pytest.mark.parametrize(
    "index",
    [1, (slice(None), 1), slice(0, 2), (slice(1, 3), slice(None)), (1, 0)],
    ids=["[b]", "[:, h]", "[0:2]", "[1:3, :]", "[b, h]"],
)
def test_indexing_as_torch(index):
    ours, theirs = _both_masks()
    _assert_same_mask(ours[index], theirs[index])


def test_adjust_as_torch():
    """``_adjust(new_q_len, new_kv_len)``: torch's decoding tests cut a prefill mask to one query row."""
    ours, theirs = _both_masks(B=2, H=1, N_q=512, N_k=512)
    _assert_same_mask(ours._adjust(1, 200), theirs._adjust(1, 200))


def test_to_string_as_torch():
    ours, theirs = _both_masks(B=1, H=1, N_q=1024, N_k=1024)
    assert str(ours) == str(theirs)
    assert ours.to_string(grid_size=(4, 4)) == theirs.to_string(grid_size=(4, 4))


def test_keyword_constructor_as_torch():
    """torch's ``BlockMask(seq_lengths=..., kv_num_blocks=..., ...)`` form, from torch's own mask's lists."""
    _, theirs = _both_masks()
    ours = fa.BlockMask(
        seq_lengths=theirs.seq_lengths,
        kv_num_blocks=theirs.kv_num_blocks,
        kv_indices=theirs.kv_indices,
        full_kv_num_blocks=theirs.full_kv_num_blocks,
        full_kv_indices=theirs.full_kv_indices,
        q_num_blocks=theirs.q_num_blocks,
        q_indices=theirs.q_indices,
        full_q_num_blocks=theirs.full_q_num_blocks,
        full_q_indices=theirs.full_q_indices,
        BLOCK_SIZE=theirs.BLOCK_SIZE,
        mask_mod=_document,
    )
    _assert_same_mask(ours, theirs)


@pytest.mark.parametrize("unpaired", ["full_kv_indices", "full_q_indices"])
def test_unpaired_index_lists_refused_as_torch(unpaired):
    """A count list without its indices: torch's ``BlockMask`` asserts, and so does this one (an error that
    is both an ``AssertionError`` and a ``ValueError``), rather than build a mask from half the lists."""
    _, theirs = _both_masks()
    lists = {
        name: getattr(theirs, name)
        for name in (
            "kv_num_blocks",
            "kv_indices",
            "full_kv_num_blocks",
            "full_kv_indices",
            "q_num_blocks",
            "q_indices",
            "full_q_num_blocks",
            "full_q_indices",
        )
    }
    lists[unpaired] = None
    common = {"seq_lengths": theirs.seq_lengths, "BLOCK_SIZE": theirs.BLOCK_SIZE, "mask_mod": _document}
    with pytest.raises(AssertionError):
        torch_flex.BlockMask(**common, **lists)
    with pytest.raises(AssertionError, match=unpaired.replace("indices", "")) as caught:
        fa.BlockMask(**common, **lists)
    assert isinstance(caught.value, ValueError)


def test_sliced_mask_mod_refused_with_torchs_words():
    """An indexed mask's ``mask_mod`` is reset; using it is refused in torch's words (its tests match them)."""
    ours = fa.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, 1, 256, 256, device="cpu")
    q, k, v = _qkv(1, 1, 1, 1, 256)
    with pytest.raises(RuntimeError, match="Cannot use mask_mod from a sliced BlockMask"):
        fa.flex_attention(q, k, v, block_mask=ours[:, :, 0])


@pytest.mark.parametrize("backend", ["auto", "dense", "query_major", "key_major", "parallel"])
def test_torchs_any_length_block_mask_taken_for_any_lengths(backend):
    """torch's strided-input tests pass its no-mask default, one block of (2^30, 2^30) built with
    ``seq_lengths = (1, 1)``, to calls of other lengths; torch skips its length check for such a mask."""
    q, k, v = _qkv(2, 4, 4, 128, 256)
    default = torch_flex._create_empty_block_mask(q, k)
    ours = fa.BlockMask.from_kv_blocks(
        default.kv_num_blocks, default.kv_indices, BLOCK_SIZE=default.BLOCK_SIZE, seq_lengths=(1, 1)
    )
    expected = _torch_eager(q, k, v)
    for mask in (ours, default):
        torch.testing.assert_close(fa.flash_attention(q, k, v, block_mask=mask, backend=backend), expected)
