"""The drop-in API against torch's own scaled_dot_product_attention, backend plans, and the seed example."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import flashattn_teach as fa
import flashattn_teach.triton

ROOT = Path(__file__).resolve().parents[2]


def r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


CASES = {
    "plain": (dict(), (2, 3, 7, 8), (2, 3, 11, 8), (2, 3, 11, 5)),
    "causal": (dict(is_causal=True), (2, 3, 9, 8), (2, 3, 9, 8), (2, 3, 9, 8)),
    "causal N_q < N_k": (dict(is_causal=True), (1, 2, 4, 8), (1, 2, 9, 8), (1, 2, 9, 8)),
    "scale": (dict(scale=0.37), (1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4)),
    "gqa": (dict(enable_gqa=True, is_causal=True), (2, 6, 7, 8), (2, 2, 7, 8), (2, 2, 7, 8)),
    "mqa broadcast": (dict(), (2, 4, 7, 8), (2, 1, 7, 8), (2, 1, 7, 8)),
    "batch broadcast": (dict(), (3, 2, 5, 4), (1, 2, 5, 4), (1, 2, 5, 4)),
    "rank 2": (dict(), (5, 4), (6, 4), (6, 3)),
    "rank 3": (dict(is_causal=True), (2, 5, 4), (2, 5, 4), (2, 5, 4)),
    "rank 5": (dict(), (2, 1, 2, 5, 4), (2, 3, 2, 6, 4), (2, 3, 2, 6, 4)),
}


@pytest.mark.parametrize("case", CASES)
def test_sdpa_matches_torch(case):
    kwargs, qs, ks, vs = CASES[case]
    q, k, v = r(*qs, seed=1), r(*ks, seed=2), r(*vs, seed=3)
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    got = fa.scaled_dot_product_attention(q, k, v, **kwargs)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    assert fa.explain(q, k, v, **kwargs).backend == "parallel"


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_sdpa_with_a_mask_matches_torch_on_a_tiled_path(mask_kind):
    q, k, v = r(2, 3, 7, 8, seed=1), r(2, 3, 9, 8, seed=2), r(2, 3, 9, 8, seed=3)
    mask = r(3, 7, 9, seed=4) > 0  # broadcast over batch
    mask[..., 0] = True  # every row sees a key: torch's math path gives NaN otherwise
    if mask_kind == "float":
        mask = torch.where(mask, 0.0, float("-inf")).double() + r(3, 7, 9, seed=5)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(fa.scaled_dot_product_attention(q, k, v, attn_mask=mask), expected, atol=1e-12, rtol=0)
    assert fa.explain(q, k, v, attn_mask=mask).backend == "parallel"


def test_sdpa_gradients_match_torch():
    q, k, v = (r(1, 4, 9, 8, seed=s).requires_grad_() for s in range(3))
    k2, v2 = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()
    ours = torch.autograd.grad(
        fa.scaled_dot_product_attention(q, k2, v2, is_causal=True, enable_gqa=True).sum(), (q, k2, v2)
    )
    theirs = torch.autograd.grad(
        F.scaled_dot_product_attention(q, k2, v2, is_causal=True, enable_gqa=True).sum(), (q, k2, v2)
    )
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_dropout_runs_on_the_fast_path_and_is_unbiased():
    q, k, v = r(1, 1, 4, 4, seed=1), r(1, 1, 6, 4, seed=2), r(1, 1, 6, 4, seed=3)
    assert fa.explain(q, k, v, dropout_p=0.5).backend == "parallel"
    torch.manual_seed(0)
    a = fa.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    b = fa.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)  # reproducible under a seed
    assert not torch.allclose(a, fa.scaled_dot_product_attention(q, k, v))  # and really dropping
    assert torch.equal(fa.scaled_dot_product_attention(q, k, v, dropout_p=1.0), torch.zeros(1, 1, 4, 4).double())
    mean = torch.stack([fa.scaled_dot_product_attention(q, k, v, dropout_p=0.5) for _ in range(4000)]).mean(0)
    torch.testing.assert_close(mean, fa.scaled_dot_product_attention(q, k, v), atol=0.1, rtol=0)


def test_named_backends_refuse_what_they_cannot_do():
    q = r(1, 1, 5, 4)
    mask = torch.ones(5, 5, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="float16, bfloat16 and float32"):
        fa.explain(q, q, q, attn_mask=mask, backend="triton")
    with pytest.raises(NotImplementedError, match="requires grad"):
        fa.explain(q, q, q, attn_mask=torch.zeros(5, 5, requires_grad=True).double(), backend="query_major")
    assert fa.explain(q.float(), q.float(), q.float(), dropout_p=0.1, backend="triton").backend == "triton"
    assert fa.explain(q, q, q, backend="key_major") == fa.Plan("key_major", "requested explicitly")
    with pytest.warns(DeprecationWarning, match="key_major"):
        assert fa.explain(q, q, q, backend="keymajor").backend == "key_major"


@pytest.mark.parametrize("backend", ["query_major", "key_major", "parallel", "dense", "auto"])
def test_flash_attention_backends_agree_with_bottom_right_causal_and_lse(backend):
    q, k, v = r(2, 4, 5, 8, seed=1), r(2, 2, 12, 8, seed=2), r(2, 2, 12, 8, seed=3)
    O, lse = fa.flash_attention(q, k, v, causal=True, causal_align="bottom_right", backend=backend, return_lse=True)
    O_ref, lse_ref = fa.dense_attention(
        q, k, v, causal=True, causal_align="bottom_right", enable_gqa=True, return_lse=True
    )
    torch.testing.assert_close(O, O_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=1e-12, rtol=0)


def test_attention_schedules_reproduces_the_seed_run():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 4) for _ in range(3))
    model = fa.AttentionSchedules().eval()
    assert isinstance(model.dense, torch.nn.Module) and isinstance(model.tiled, torch.nn.Module)
    out = model(q, k, v)
    assert out.shape == (2, 1, 6, 4)
    oracle = fa.dense_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out[1].double(), oracle, atol=1e-6, rtol=0)
    torch.testing.assert_close(out[0], out[1], atol=1e-6, rtol=0)


def test_demo_and_example_print_the_seed_shape():
    demo = subprocess.run(
        [sys.executable, "-m", "flashattn_teach.cli", "demo"], capture_output=True, text=True, check=True
    )
    assert "AttentionSchedules output [dense, tiled]: shape [2, 1, 6, 4]" in demo.stdout
    example = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "01_seed_example.py")], capture_output=True, text=True, check=True
    )
    assert "output shape: [2, 1, 6, 4]" in example.stdout
    diff = float(example.stdout.split("max |dense - tiled|:")[1])
    assert 0.0 <= diff < 1e-5


@pytest.mark.skipif(
    fa.triton.unsupported_reason(torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 1, 16))
    is not None,
    reason="the Triton path cannot run here (no triton, or no CUDA and no interpreter)",
)
def test_flash_attention_routes_to_triton_when_asked():
    q, k, v = (torch.randn(1, 4, 37, 16, generator=torch.Generator().manual_seed(s)) for s in range(3))
    k, v = k[:, :2], v[:, :2]
    assert fa.explain(q, k, v, enable_gqa=True, backend="triton").backend == "triton"
    O, lse = fa.flash_attention(q, k, v, causal=True, causal_align="bottom_right", backend="triton", return_lse=True)
    O_ref, lse_ref = fa.dense_attention(
        q.double(), k.double(), v.double(), causal=True, causal_align="bottom_right", enable_gqa=True, return_lse=True
    )
    torch.testing.assert_close(O.double(), O_ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-4, rtol=0)
