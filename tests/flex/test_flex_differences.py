"""The smaller differences between ``flex_attention`` and torch's, each judged against torch's eager
``flex_attention`` on the CPU in float64: the output's memory layout (the query's stride order), the error
mixed dtypes raise, ``return_lse``'s deprecation warning, and the ``kernel_options`` that change no value.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flashattn_teach as fa
from flashattn_teach.errors import AttentionDtypeError, BackendUnavailableError

B, H, N, D = 2, 3, 37, 16


def torch_eager(q, k, v, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()", return_lse's deprecation
        return torch_flex.flex_attention(q, k, v, **kw)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def contiguous_strides(shape) -> tuple[int, ...]:
    return torch.empty(shape).stride()


def bias(score, b, h, q_idx, kv_idx):
    return score + 0.1 * (h + 1) * (q_idx - kv_idx)


# ---- the output's layout: the query's stride order, as torch's eager flex_attention

LAYOUTS = {
    "(B, N, H, D).transpose(1, 2)": lambda: randn(B, N, H, D).transpose(1, 2),
    "(H, B, N, D).transpose(0, 1)": lambda: randn(H, B, N, D).transpose(0, 1),
    "(H, N, B, D).permute(2, 0, 1, 3)": lambda: randn(H, N, B, D).permute(2, 0, 1, 3),
    "D not innermost: (B, H, D, N).transpose(2, 3)": lambda: randn(B, H, D, N).transpose(2, 3),
    "a sliced query": lambda: randn(B, H, 2 * N, D)[:, :, ::2],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_has_the_querys_stride_order_as_torchs(layout):
    q = LAYOUTS[layout]()
    k, v = randn(B, H, N, D, seed=1), randn(B, H, N, D, seed=2)
    want, (want_lse, _) = torch_eager(q, k, v, score_mod=bias, return_aux=torch_flex.AuxRequest(lse=True))
    out, (lse, _) = fa.flex_attention(q, k, v, score_mod=bias, return_aux=torch_flex.AuxRequest(lse=True))
    assert out.stride() == want.stride() and lse.stride() == want_lse.stride()
    assert torch.allclose(out, want, rtol=0, atol=1e-12) and torch.allclose(lse, want_lse, rtol=0, atol=1e-12)


def test_the_layout_probe_would_see_a_contiguous_out():
    # the negative control: for the transposed query torch's out is not laid out contiguously
    q = LAYOUTS["(B, N, H, D).transpose(1, 2)"]()
    want = torch_eager(q, randn(B, H, N, D, seed=1), randn(B, H, N, D, seed=2))
    assert want.stride() != contiguous_strides(want.shape)


def test_the_relaid_out_keeps_the_gradients():
    q = LAYOUTS["(B, N, H, D).transpose(1, 2)"]().requires_grad_()
    q_plain = q.detach().contiguous().requires_grad_()
    k, v = randn(B, H, N, D, seed=1), randn(B, H, N, D, seed=2)
    dO = randn(B, H, N, D, seed=3)
    fa.flex_attention(q, k, v, score_mod=bias).backward(dO)
    fa.flex_attention(q_plain, k, v, score_mod=bias).backward(dO)
    assert torch.allclose(q.grad, q_plain.grad, rtol=0, atol=1e-12)


# ---- mixed dtypes: refused with an error that is both torch's ValueError and a TypeError


@pytest.mark.parametrize("caught", [ValueError, TypeError, RuntimeError])
def test_mixed_dtypes_raise_an_error_both_value_and_type(caught):
    # torch's compiled flex_attention (inductor's lowerings) raises ValueError for mixed query, key and value
    # dtypes; this library refuses them on every path
    q, k, v = randn(1, 2, 8, D).float(), randn(1, 2, 8, D), randn(1, 2, 8, D)
    with pytest.raises(caught, match=r"share one dtype.*query torch.float32, key torch.float64") as info:
        fa.flex_attention(q, k, v)
    assert isinstance(info.value, AttentionDtypeError)


# ---- return_lse's deprecation


def test_return_lse_warns_as_torchs_and_return_aux_does_not():
    q = k = v = randn(1, 2, 8, D)
    torch_flex._WARNINGS_SHOWN.discard("deprecated_return_lse")  # torch warns once per process
    with warnings.catch_warnings(record=True) as theirs:
        warnings.simplefilter("always")
        torch_flex.flex_attention(q, k, v, return_lse=True)
    categories = {w.category for w in theirs if "return_lse" in str(w.message)}
    assert categories == {FutureWarning}
    with pytest.warns(FutureWarning, match=r"return_lse is deprecated.*return_aux=AuxRequest\(lse=True\)"):
        fa.flex_attention(q, k, v, return_lse=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fa.flex_attention(q, k, v, return_aux=torch_flex.AuxRequest(lse=True))


# ---- kernel_options

ACCEPTED = [
    {"FORCE_USE_FLEX_ATTENTION": True},
    {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    {"fwd_BLOCK_M": 64, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N2": 16, "WRITE_DQ": False, "USE_TMA": True},
    {"BACKEND": "TRITON"},
    {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True},
    {"PRESCALE_QK": False},
]


@pytest.mark.parametrize("options", ACCEPTED, ids=lambda o: ",".join(o))
def test_kernel_options_that_change_no_value_are_accepted(options):
    # a causal mask: every row sees a key and its blocks are contiguous, so the promises hold
    q, k, v = randn(B, H, N, D), randn(B, H, N, D, seed=1), randn(B, H, N, D, seed=2)
    block_mask = fa.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, N, N, device="cpu")
    kw = dict(score_mod=bias, block_mask=block_mask)
    out = fa.flex_attention(q, k, v, kernel_options=options, **kw)
    assert torch.equal(out, fa.flex_attention(q, k, v, **kw))
    theirs_mask = torch_flex.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, N, N, "cpu")
    want = torch_eager(q, k, v, score_mod=bias, block_mask=theirs_mask, kernel_options=options)
    assert torch.allclose(out, want, rtol=0, atol=1e-12)


def test_prescale_qk_without_a_score_mod_is_accepted():
    q, k, v = randn(B, H, N, D), randn(B, H, N, D, seed=1), randn(B, H, N, D, seed=2)
    out = fa.flex_attention(q, k, v, kernel_options={"PRESCALE_QK": True})
    assert torch.allclose(out, torch_eager(q, k, v), rtol=0, atol=1e-12)


def test_options_that_change_values_are_refused_by_name():
    q = k = v = randn(1, 2, 8, D)
    with pytest.raises(BackendUnavailableError, match="PRESCALE_QK=True makes torch call score_mod on scores in log2"):
        fa.flex_attention(q, k, v, score_mod=bias, kernel_options={"PRESCALE_QK": True})
    for internal in ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX"):
        with pytest.raises(ValueError, match=f"{internal} is set by flex_attention itself"):
            fa.flex_attention(q, k, v, kernel_options={internal: True})
    with pytest.raises(ValueError, match="'SOMETHING_NEW' is not one of torch's FlexKernelOptions"):
        fa.flex_attention(q, k, v, kernel_options={"SOMETHING_NEW": 1})


def test_backend_is_checked_as_torch_checks_it():
    q = k = v = randn(1, 2, 8, D)
    for options, error in (
        ({"BACKEND": "CUDNN"}, ValueError),
        ({"BACKEND": "TRITON", "FORCE_USE_FLEX_ATTENTION": True}, RuntimeError),
    ):
        with pytest.raises(error):
            torch_eager(q, k, v, kernel_options=options)
        with pytest.raises(error, match="BACKEND"):
            fa.flex_attention(q, k, v, kernel_options=options)
