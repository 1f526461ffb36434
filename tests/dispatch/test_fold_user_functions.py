"""Grouped-query attention with one query row and FlexAttention's user functions (issue 35, finding 1).

``rows.py`` runs the ``G`` query heads of a key/value head as ``G`` rows of it when ``N_q = 1``; a
``score_mod``, ``mask_mod`` or block mask reads ``h`` and ``q_idx``, which folding would change, so such a
call must run unfolded. Judged against torch's own eager ``flex_attention`` (CPU, float64 and float32), on
every CPU backend, through ``flex_attention`` and ``flash_attention``; gradients against the float64 dense
reference. The functions read ``h`` and ``q_idx`` so that a fold would show: every case differs from plain
attention (checked too, as the negative control)."""

from __future__ import annotations

import warnings

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach._options import make_options
from flashattn_teach.dispatch import rows
from flashattn_teach.reference import dense_attention

flex = pytest.importorskip("torch.nn.attention.flex_attention")

B, H_Q, H_KV, N_K, D = 2, 8, 2, 67, 16  # G = 4 query heads per key/value head; an awkward key length
TOL = {torch.float64: 1e-10, torch.float32: 4e-5}


def score_mod(score, b, h, q_idx, kv_idx):
    return score * 2 + h - 0.5 * q_idx + 0.01 * kv_idx  # a fold would read h // G... and q_idx = g


def mask_mod(b, h, q_idx, kv_idx):
    return ((kv_idx + h) % 3 != 0) & (kv_idx >= q_idx)  # a different key set per query head


CASES = ("score_mod", "mask_mod", "block_mask", "score_mod and block_mask", "score_mod and mask_mod")


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(35)
    return tuple(
        torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        for shape in ((B, H_Q, 1, D), (B, H_KV, N_K, D), (B, H_KV, N_K, D))
    )


def _ours(case: str, device: torch.device) -> dict:
    kw: dict = {}
    if "score_mod" in case:
        kw["score_mod"] = score_mod
    if case.endswith("mask_mod"):
        kw["mask_mod"] = mask_mod
    if "block_mask" in case:
        kw["block_mask"] = fa.create_block_mask(mask_mod, B, H_Q, 1, N_K, device=device)
    return kw


def _torch(q, k, v, case: str):
    """torch's eager flex_attention (a mask_mod goes in torch's own block mask, its only way in)."""
    kw: dict = {"enable_gqa": True}
    if "score_mod" in case:
        kw["score_mod"] = score_mod
    if "mask" in case.replace("score_mod", ""):
        kw["block_mask"] = flex.create_block_mask(mask_mod, B, H_Q, 1, N_K, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        return flex.flex_attention(q, k, v, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["flex_attention", "auto", "parallel", "query_major", "key_major", "dense"])
def test_gqa_one_row_with_user_functions_matches_torch(backend, case, dtype):
    q, k, v = _inputs(dtype)
    want = _torch(q, k, v, case)
    kw = _ours(case, q.device)
    if backend == "flex_attention":
        if "mask_mod" in kw:  # flex_attention takes its mask_mod through a block mask, as torch's
            kw = {"score_mod": kw.get("score_mod"), "block_mask": fa.create_block_mask(mask_mod, B, H_Q, 1, N_K)}
        got = fa.flex_attention(q, k, v, enable_gqa=True, **kw)
    else:
        got = fa.flash_attention(q, k, v, enable_gqa=True, backend=backend, **kw)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    # negative control: the functions change the result, so dropping them could not pass the check above
    assert (fa.flash_attention(q, k, v, enable_gqa=True) - want).abs().max() > 0.1


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["parallel", "query_major", "key_major"])
def test_gqa_one_row_with_user_functions_has_the_dense_gradients(backend, case):
    q, k, v = (t.requires_grad_() for t in _inputs(torch.float64))
    kw = _ours(case, q.device)
    O = fa.flash_attention(q, k, v, enable_gqa=True, backend=backend, **kw)
    want = dense_attention(q, k, v, enable_gqa=True, **kw)
    torch.testing.assert_close(O, want, atol=1e-12, rtol=1e-12)
    dO = torch.randn_like(O)
    for got, expected in zip(
        torch.autograd.grad(O, (q, k, v), dO), torch.autograd.grad(want, (q, k, v), dO), strict=True
    ):
        torch.testing.assert_close(got, expected, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("case", CASES)
def test_fold_declines_user_functions_by_name(case):
    q, k, v = _inputs(torch.float64)
    opts = make_options(q, k, v, enable_gqa=True, **_ours(case, q.device))
    assert rows.declined(opts) == ["mask.mods"]
    assert rows.fold(q, k, v, opts) is None
    plain = make_options(q, k, v, enable_gqa=True)  # the same call without them folds
    assert rows.declined(plain) == [] and rows.fold(q, k, v, plain) is not None
