"""``BlockMask``'s API against torch's own object (``torch.nn.attention.flex_attention``) built for the same
mask: indexing (``block_mask[b]``, ``[:, h]``, ``[b, h, q_blocks]``, slices, tensors), ``_adjust``, torch's
keyword constructor, ``str``/``repr``/``to_string``, and the attributes that are read only here. Each indexed or
adjusted mask is compared list by list with torch's, and run through ``flex_attention`` against torch's eager
``flex_attention`` in float64 (which reads only ``mask_mod``: the blocks the mask lists are the library's alone
to get right).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flashattn_teach as fa
from flashattn_teach import BlockMask, create_block_mask
from flashattn_teach.errors import AttentionTypeError, AttentionValueError

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
B, H, N, D, BLOCK = 2, 3, 203, 16, 32


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def head_window(b, h, q_idx, kv_idx):
    """A causal window that widens with the head."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 24 * (h + 1))


DOC = torch.stack([torch.arange(N) // 50, torch.arange(N) // 70])  # (B, N) document ids, differing per element


def document(b, h, q_idx, kv_idx):
    return (DOC[b, q_idx] == DOC[b, kv_idx]) & (q_idx >= kv_idx)


# built for (B, H): the kinds keep a size-1 dim where the function reads neither b (causal) nor h
MASKS = {"causal": (causal, B, H), "head_window": (head_window, B, H), "document": (document, B, H)}


def both(name: str, **kw):
    mask_mod, Bm, Hm = MASKS[name]
    ours = create_block_mask(mask_mod, Bm, Hm, N, N, device="cpu", BLOCK_SIZE=BLOCK, **kw)
    theirs = torch_flex.create_block_mask(mask_mod, Bm, Hm, N, N, device="cpu", BLOCK_SIZE=BLOCK, **kw)
    return ours, theirs


def assert_like_torch(ours: BlockMask, theirs) -> None:
    for name in LISTS:
        a, t = getattr(ours, name), getattr(theirs, name)
        assert (a is None) == (t is None), name
        if t is not None:
            assert a.dtype == t.dtype and a.shape == t.shape, (name, a.shape, t.shape)
            assert torch.equal(a, t), name
    assert ours.shape == theirs.shape and ours.seq_lengths == theirs.seq_lengths
    assert ours.BLOCK_SIZE == theirs.BLOCK_SIZE and ours.numel() == theirs.numel()
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert ours.sparsity() == pytest.approx(theirs.sparsity())
    assert ours.to_string() == theirs.to_string() and str(ours) == str(theirs)


def torch_eager(q, k, v, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()"
        return torch_flex.flex_attention(q, k, v, **kw)


def qkv(Bq: int, Hq: int, N_q: int = N, N_k: int = N):
    g = torch.Generator().manual_seed(N_q * 1000 + N_k)
    return tuple(
        torch.randn(Bq, Hq, n, D, generator=g, dtype=torch.float64) for n in (N_q, N_k, N_k)
    )  # (B, H, N, D) each


# ---- indexing

INDICES = {
    "b": 1,
    "-b": -1,
    "b,h": (1, 2),
    "slices": (slice(0, 2), slice(1, 3)),
    ":,h": (slice(None), 1),
    "b,h,q_blocks": (slice(0, 2), slice(1, 2), torch.tensor([1, 4])),
    ":,:,q_block": (slice(None), slice(None), 3),
    "tensor": (torch.tensor([1, 0]),),
    "ellipsis": (...,),
}


@pytest.mark.parametrize("index", INDICES)
@pytest.mark.parametrize("name", MASKS)
def test_indexing_gives_torchs_lists_shape_and_drawing(name, index):
    ours, theirs = both(name)
    idx = INDICES[index]
    assert_like_torch(ours[idx], theirs[idx])


def test_indexing_without_full_blocks_is_torchs():
    ours, theirs = both("document", separate_full_blocks=False)
    assert_like_torch(ours[1, :, 2:5], theirs[1, :, 2:5])


def test_an_index_past_the_dim_is_refused_by_the_dim():
    ours, _ = both("document")
    with pytest.raises(IndexError, match="index 5 is out of range for dim 1 of size 3"):
        ours[0, 5]


def test_an_indexed_masks_mask_mod_is_refused_until_one_is_assigned_as_torchs():
    ours, theirs = both("document")
    q, k, v = qkv(1, H)
    with pytest.raises(RuntimeError, match="sliced"):
        torch_eager(q, k, v, block_mask=theirs[1])
    with pytest.raises(RuntimeError, match=r"indexed \(block_mask\[...\]\).*sliced.mask_mod = original.mask_mod"):
        fa.flex_attention(q, k, v, block_mask=ours[1])


def _offset(mask_mod, db: int = 0, dh: int = 0, dq: int = 0):
    def shifted(b, h, q_idx, kv_idx):
        return mask_mod(b + db, h + dh, q_idx + dq, kv_idx)

    return shifted


@pytest.mark.parametrize(
    ("name", "index", "Bq", "Hq", "shift"),
    [("document", 1, 1, H, (1, 0)), ("head_window", (slice(None), 2), B, 1, (0, 2))],
)
def test_an_indexed_mask_with_its_mask_mod_assigned_runs_as_torchs(name, index, Bq, Hq, shift):
    ours, theirs = both(name)
    q, k, v = qkv(Bq, Hq)
    sliced, theirs_sliced = ours[index], theirs[index]
    sliced.mask_mod = _offset(ours.mask_mod, *shift)
    theirs_sliced.mask_mod = _offset(theirs.mask_mod, *shift)
    want = torch_eager(q, k, v, block_mask=theirs_sliced)
    assert torch.allclose(fa.flex_attention(q, k, v, block_mask=sliced), want, rtol=0, atol=1e-12)
    # the negative control: where the slice starts matters (element 0's documents, head 0's window differ)
    sliced.mask_mod = ours.mask_mod
    assert not torch.allclose(fa.flex_attention(q, k, v, block_mask=sliced), want, atol=1e-3)


@pytest.mark.parametrize("position", [0, 77, 130, 202])
def test_decoding_by_indexing_the_query_block_and_setting_seq_lengths_runs_as_torchs(position):
    # gpt-fast's decode step: the query block of the position, its mask_mod offset, seq_lengths (1, KV_LEN)
    ours, theirs = both("head_window")
    q, k, v = qkv(B, H, N_q=1)
    results = []
    for base in (ours, theirs):
        step = base[:, :, position // BLOCK]
        step.mask_mod = _offset(base.mask_mod, dq=position)
        step.seq_lengths = (1, N)
        results.append(step)
    assert_like_torch(*results)
    want = torch_eager(q, k, v, block_mask=results[1])
    assert torch.allclose(fa.flex_attention(q, k, v, block_mask=results[0]), want, rtol=0, atol=1e-12)


def test_an_indexed_query_block_without_seq_lengths_set_is_refused_by_name():
    ours, _ = both("causal")
    step = ours[:, :, 3]
    step.mask_mod = _offset(causal, dq=3 * BLOCK)
    q, k, v = qkv(1, 1)
    with pytest.raises(AttentionValueError, match=r"holds 1 x 7 blocks.*set block_mask.seq_lengths"):
        fa.flex_attention(q, k, v, block_mask=step)


# ---- _adjust


@pytest.mark.parametrize("lengths", [(1, N), (1, 77), (70, 150), (N, 64), (96, N), (N, N)])
@pytest.mark.parametrize("name", MASKS)
def test_adjust_gives_torchs_lists_and_runs_as_torchs(name, lengths):
    ours, theirs = both(name)
    adjusted = ours._adjust(*lengths)
    try:
        theirs_adjusted = theirs._adjust(*lengths)
    except IndexError:
        # torch recounts a cut row as its entries below min(count, cols); for a causal band at (N, 64) that keeps an
        # entry past the cut, which torch's own transposition then indexes out of range. Ours keeps torch's
        # lists and drops the entry when reading them: the blocks are those of a mask built for the lengths.
        fresh = torch_flex.create_block_mask(MASKS[name][0], B, H, *lengths, device="cpu", BLOCK_SIZE=BLOCK)
        assert torch.equal(adjusted.to_dense(), fresh.to_dense())
        theirs_adjusted = fresh
    else:
        assert_like_torch(adjusted, theirs_adjusted)
    q, k, v = qkv(B, H, *lengths)
    want = torch_eager(q, k, v, block_mask=theirs_adjusted)
    assert torch.allclose(fa.flex_attention(q, k, v, block_mask=adjusted), want, rtol=0, atol=1e-12)


def test_adjust_past_the_lists_is_kept_as_torch_and_refused_when_read():
    ours, theirs = both("causal")
    longer, theirs_longer = ours._adjust(300, N), theirs._adjust(300, N)
    assert_like_torch(longer, theirs_longer)
    q, k, v = qkv(1, 1, 300, N)
    with pytest.raises(AttentionValueError, match=r"holds 7 x 7 blocks of \(32, 32\).*need 10 x 7"):
        fa.flex_attention(q, k, v, block_mask=longer)


# ---- torch's constructor


@pytest.mark.parametrize("with_q_lists", [True, False])
def test_torchs_keyword_constructor_keeps_the_given_lists_as_torchs(with_q_lists):
    _, theirs = both("document")
    # torch's constructor takes every list, the q_* ones possibly None (then the mask has none, as torch's)
    lists = {name: getattr(theirs, name) if with_q_lists or name in LISTS[:4] else None for name in LISTS}
    ours = BlockMask(seq_lengths=(N, N), BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=document, **lists)
    assert_like_torch(ours, torch_flex.BlockMask(seq_lengths=(N, N), BLOCK_SIZE=(BLOCK, BLOCK), **lists))
    q, k, v = qkv(B, H)
    assert torch.allclose(
        fa.flex_attention(q, k, v, block_mask=ours), torch_eager(q, k, v, block_mask=theirs), rtol=0, atol=1e-12
    )


def test_from_kv_blocks_of_fewer_batch_dims_draws_as_torchs():
    _, theirs = both("document")
    for picks in ((1,), (1, 2)):  # (H, T_r) and (T_r,) lists
        lists = [getattr(theirs, name)[picks] for name in LISTS[:4]]
        ours = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=BLOCK, seq_lengths=(N, N))
        assert_like_torch(ours, torch_flex.BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=BLOCK, seq_lengths=(N, N)))


def test_torchs_positional_constructor_and_a_mix_are_refused_by_name():
    _, theirs = both("causal")
    with pytest.raises(AttentionTypeError, match=r"by keyword here: BlockMask\(seq_lengths=..., kv_num_blocks="):
        BlockMask((N, N), theirs.kv_num_blocks, theirs.kv_indices)
    with pytest.raises(AttentionValueError, match="not a mix"):
        BlockMask(seq_lengths=(N, N), kv_num_blocks=theirs.kv_num_blocks)


# ---- read-only attributes, and the two torch lets a caller assign


@pytest.mark.parametrize("name", [*LISTS, "BLOCK_SIZE", "shape", "block_kinds"])
def test_assigning_a_derived_attribute_names_it_and_the_constructors(name):
    ours, _ = both("causal")
    before = ours.to_dense()
    with pytest.raises(AttributeError, match=rf"BlockMask.{name} is read only.*BlockMask.from_kv_blocks"):
        setattr(ours, name, getattr(ours, name))
    assert torch.equal(ours.to_dense(), before)


def test_seq_lengths_is_checked_when_assigned():
    ours, _ = both("causal")
    with pytest.raises(AttentionValueError, match=r"seq_lengths must be a pair \(Q_LEN, KV_LEN\)"):
        ours.seq_lengths = (N,)


# ---- the drawing


@pytest.mark.parametrize("grid_size", [(20, 20), -1, 3, (2, 5)])
@pytest.mark.parametrize("limit", [1, 4, 10])
def test_to_string_draws_as_torchs(grid_size, limit):
    ours, theirs = both("document")
    assert ours.to_string(grid_size=grid_size, limit=limit) == theirs.to_string(grid_size=grid_size, limit=limit)


def test_repr_is_torchs_and_to_keeps_the_lists():
    ours, theirs = both("head_window")
    assert repr(ours) == repr(theirs)
    assert repr(ours[1]) == repr(theirs[1])  # the reset mask_mod keeps torch's name
    assert_like_torch(ours[:, 1:].to("cpu"), theirs[:, 1:].to("cpu"))
