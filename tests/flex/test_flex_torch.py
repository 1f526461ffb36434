"""``flashattn_teach.flex_attention`` and ``create_block_mask`` against torch's FlexAttention itself.

torch's ``flex_attention`` runs eagerly on the CPU here (no torch.compile): it evaluates ``mask_mod`` and
``score_mod`` densely over the score matrix, in float64 for float64 inputs, and has no CPU backward, so
only forwards are compared: ``O`` and ``lse`` for the same functions on the same inputs, each library with
its own ``create_block_mask``. Both block masks must also hold the same tables (torch's public attributes)
for the same ``mask_mod``. Eager torch ignores a block mask's tables (it applies ``mask_mod`` everywhere),
so hand-built block masks are checked against the oracle (``test_flex_oracle.py``), not here.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import flashattn_teach as fa

from flex_cases import (
    MASKS,
    SCORE_MODS,
    TORCH_SUITE,
    Dims,
    Params,
    assert_lse_equal,
    causal_mask,
    oracle,
    relative_causal,
)

flex = pytest.importorskip("torch.nn.attention.flex_attention")

B, H_Q, H_KV, D, D_V = 2, 4, 2, 16, 8
# fp64: both exact up to summation order; fp32: each library's own float32 error, twice the oracle tests'.
TOL = {torch.float64: 1e-10, torch.float32: 4e-5}


def torch_flex(q, k, v, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's eager flex_attention with its lse (``return_aux`` where torch has it, else ``return_lse``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()" and return_lse's deprecation
        if hasattr(flex, "AuxRequest"):
            O, aux = flex.flex_attention(q, k, v, return_aux=flex.AuxRequest(lse=True), **kw)
            return O, aux.lse
        return flex.flex_attention(q, k, v, return_lse=True, **kw)


def inputs(N_q: int, N_k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_Q, N_q, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H_KV, N_k, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H_KV, N_k, D_V, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v))


def both_libraries(
    builder, N_q: int, N_k: int, dtype: torch.dtype, block_size=128, torch_mask_for_ours: bool = False, **kw
) -> None:
    """Ours and torch's on the same inputs and functions, each with its own block mask of ``mask_mod`` (or
    both with torch's, ``torch_mask_for_ours``: code that keeps torch's mask builder)."""
    mods = builder(Dims(B, H_Q, N_q, N_k), Params(dtype))
    q, k, v = inputs(N_q, N_k, dtype)
    ours_mask = theirs_mask = None
    if mods.mask_mod is not None:
        theirs_mask = flex.create_block_mask(mods.mask_mod, B, H_Q, N_q, N_k, device="cpu", BLOCK_SIZE=block_size)
        ours_mask = (
            theirs_mask
            if torch_mask_for_ours
            else fa.create_block_mask(mods.mask_mod, B, H_Q, N_q, N_k, device="cpu", BLOCK_SIZE=block_size)
        )
    with torch.no_grad():  # torch has no CPU backward
        O, lse = fa.flex_attention(
            q, k, v, score_mod=mods.score_mod, block_mask=ours_mask, enable_gqa=True, return_lse=True, **kw
        )
        O_ref, lse_ref = torch_flex(q, k, v, score_mod=mods.score_mod, block_mask=theirs_mask, enable_gqa=True, **kw)
    assert O.dtype == O_ref.dtype and O.shape == O_ref.shape and lse.shape == lse_ref.shape
    torch.testing.assert_close(O, O_ref, atol=TOL[dtype], rtol=0)
    assert_lse_equal(lse, lse_ref, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", list(TORCH_SUITE))
def test_torch_suite_score_mods_match_torch_flex_attention(name, dtype):
    both_libraries(TORCH_SUITE[name], 113, 203, dtype)


@pytest.mark.parametrize("block_size", [128, (32, 64)], ids=["128", "32x64"])
@pytest.mark.parametrize(("N_q", "N_k"), [(113, 203), (203, 113)])
@pytest.mark.parametrize("name", list(MASKS))
def test_common_masks_match_torch_flex_attention(name, N_q, N_k, block_size):
    """Including rows that see no key (the document mask with N_q > N_k): torch gives 0 and -inf too."""
    both_libraries(MASKS[name], N_q, N_k, torch.float64, block_size=block_size)


@pytest.mark.parametrize("block_size", [128, (32, 64)], ids=["128", "32x64"])
@pytest.mark.parametrize("name", ["causal_document", "dilated_window"])
def test_torch_block_mask_given_to_ours_matches_torch(name, block_size):
    """A BlockMask from torch's own create_block_mask, passed to our flex_attention."""
    both_libraries(MASKS[name], 203, 113, torch.float64, block_size=block_size, torch_mask_for_ours=True)


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_learned_score_mods_match_torch_flex_attention_forward(name):
    both_libraries(SCORE_MODS[name], 113, 203, torch.float64)


def test_scale_matches_torch_flex_attention():
    both_libraries(TORCH_SUITE["relative_causal"], 113, 203, torch.float64, scale=0.3)


def test_three_dimensional_inputs_match_torch_on_a_batch_of_one():
    """torch's flex_attention takes 4-D inputs; ours also takes ``(H, N, D)``, as torch's batch of one."""
    q, k, v = (t[:1, :H_KV] for t in inputs(113, 203, torch.float64))  # (1, H, N, D)
    with torch.no_grad():
        O = fa.flex_attention(q[0], k[0], v[0], score_mod=relative_causal)
        O_ref, _ = torch_flex(q, k, v, score_mod=relative_causal)
    torch.testing.assert_close(O, O_ref[0], atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", [*TORCH_SUITE, *MASKS, *SCORE_MODS])
def test_the_oracle_matches_torch_flex_attention(name):
    """The float64 oracle of test_flex_oracle.py is torch's FlexAttention semantics (its eager path, which
    evaluates mask_mod densely): the same O and lse on the same cases, rows that see no key included."""
    registry = TORCH_SUITE if name in TORCH_SUITE else MASKS if name in MASKS else SCORE_MODS
    mods = registry[name](Dims(B, H_Q, 203, 113), Params(torch.float64))
    q, k, v = inputs(203, 113, torch.float64)
    theirs = None
    if mods.mask_mod is not None:
        theirs = flex.create_block_mask(mods.mask_mod, B, H_Q, 203, 113, device="cpu", BLOCK_SIZE=(32, 64))
    with torch.no_grad():
        O_ref, lse_ref = torch_flex(q, k, v, score_mod=mods.score_mod, block_mask=theirs, enable_gqa=True)
        O, lse = oracle(q, k, v, score_mod=mods.score_mod, mask_mod=mods.mask_mod)
    torch.testing.assert_close(O, O_ref, atol=1e-12, rtol=0)
    assert_lse_equal(lse, lse_ref, 1e-12)


# ------------------------------------------------------------------------------ the block mask tables

TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
Q_TABLES = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _assert_same_tables(ours, theirs, num: str, indices: str) -> None:
    """The same counts and the same index tables, element for element: the listed blocks (the first ``num``
    slots of each row) and the order of the unused slots after them too, as torch lays them out."""
    n_ours, n_theirs = getattr(ours, num), getattr(theirs, num)
    i_ours, i_theirs = getattr(ours, indices), getattr(theirs, indices)
    assert (n_ours is None) == (n_theirs is None), num
    if n_theirs is None:
        return
    assert n_ours.dtype == n_theirs.dtype and n_ours.shape == n_theirs.shape, (num, n_ours.shape, n_theirs.shape)
    assert torch.equal(n_ours, n_theirs), num
    assert i_ours.dtype == i_theirs.dtype and i_ours.shape == i_theirs.shape, (indices, i_ours.shape, i_theirs.shape)
    listed = torch.arange(i_theirs.shape[-1]) < n_theirs[..., None]
    assert torch.equal(i_ours[listed], i_theirs[listed]), f"{indices}: the listed blocks differ"
    assert torch.equal(i_ours, i_theirs), f"{indices}: the unused slots differ"


@pytest.mark.parametrize("block_size", [128, (32, 64), (64, 32)], ids=["128", "32x64", "64x32"])
@pytest.mark.parametrize(("Bm", "Hm"), [(None, None), (2, None), (2, 4)], ids=["BNone_HNone", "B2_HNone", "B2_H4"])
@pytest.mark.parametrize("name", list(MASKS))
def test_block_mask_tables_equal_torch_create_block_mask(name, Bm, Hm, block_size):
    """torch's public attributes, for the same mask_mod at ragged lengths (113 x 203): the partial and full
    tables by key block and by query block, the block size, the lengths, the shape, dense form, sparsity."""
    mask_mod = MASKS[name](Dims(2, 4, 113, 203), Params(torch.float64)).mask_mod
    ours = fa.create_block_mask(mask_mod, Bm, Hm, 113, 203, device="cpu", BLOCK_SIZE=block_size)
    theirs = flex.create_block_mask(mask_mod, Bm, Hm, 113, 203, device="cpu", BLOCK_SIZE=block_size)
    for num, indices in zip(TABLES[::2] + Q_TABLES[::2], TABLES[1::2] + Q_TABLES[1::2], strict=True):
        _assert_same_tables(ours, theirs, num, indices)
    assert tuple(ours.BLOCK_SIZE) == tuple(theirs.BLOCK_SIZE)
    assert tuple(ours.seq_lengths) == tuple(theirs.seq_lengths)
    assert tuple(ours.shape) == tuple(theirs.shape)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert ours.sparsity() == pytest.approx(theirs.sparsity())


def test_block_mask_tables_would_see_a_different_mask():
    """Control: the table comparison tells a causal mask from a sliding window of the same lengths."""
    window = MASKS["sliding_window"](Dims(1, 1, 113, 203), Params(torch.float64)).mask_mod
    ours = fa.create_block_mask(window, None, None, 113, 203, device="cpu", BLOCK_SIZE=(32, 64))
    theirs = flex.create_block_mask(causal_mask, None, None, 113, 203, device="cpu", BLOCK_SIZE=(32, 64))
    with pytest.raises(AssertionError):
        for num, indices in zip(TABLES[::2], TABLES[1::2], strict=True):
            _assert_same_tables(ours, theirs, num, indices)


def test_from_kv_blocks_matches_torch_attributes():
    """A block mask built from torch's tables holds torch's derived query-block tables too."""
    theirs = flex.create_block_mask(causal_mask, 1, 1, 113, 203, device="cpu", BLOCK_SIZE=(32, 64))
    ours = fa.BlockMask.from_kv_blocks(
        theirs.kv_num_blocks,
        theirs.kv_indices,
        theirs.full_kv_num_blocks,
        theirs.full_kv_indices,
        BLOCK_SIZE=theirs.BLOCK_SIZE,
        mask_mod=causal_mask,
        seq_lengths=(113, 203),
    )
    for num, indices in zip(TABLES[::2] + Q_TABLES[::2], TABLES[1::2] + Q_TABLES[1::2], strict=True):
        _assert_same_tables(ours, theirs, num, indices)
    assert torch.equal(ours.to_dense(), theirs.to_dense())


def test_noop_and_combined_masks_match_torch():
    """``noop_mask``, ``and_masks`` and ``or_masks`` of each library give the same tables."""
    document = MASKS["document"](Dims(2, 4, 113, 203), Params(torch.float64)).mask_mod
    window = MASKS["sliding_window"](Dims(2, 4, 113, 203), Params(torch.float64)).mask_mod
    pairs = [
        (fa.noop_mask, flex.noop_mask),
        (fa.and_masks(causal_mask, document), flex.and_masks(causal_mask, document)),
        (fa.or_masks(document, window), flex.or_masks(document, window)),
    ]
    for ours_mod, theirs_mod in pairs:
        ours = fa.create_block_mask(ours_mod, 2, None, 113, 203, device="cpu", BLOCK_SIZE=(32, 64))
        theirs = flex.create_block_mask(theirs_mod, 2, None, 113, 203, device="cpu", BLOCK_SIZE=(32, 64))
        for num, indices in zip(TABLES[::2], TABLES[1::2], strict=True):
            _assert_same_tables(ours, theirs, num, indices)
