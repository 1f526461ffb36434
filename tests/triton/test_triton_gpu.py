"""Real-GPU checks of the Triton kernels with the shipped configurations; skipped without CUDA.

Accuracy follows flash-attn's rule: the kernel's error against an fp32 reference may be at most twice the
error of plain PyTorch computing in the same low precision, plus a small floor. Nothing here touches CUDA
at import time.
"""

from __future__ import annotations

import pytest
import torch

from flashattn_teach.triton import triton_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def plain_attention(q, k, v, causal: bool):
    """Attention by the definition, every op in the inputs' dtype (as plain PyTorch would compute it)."""
    S = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, N_q, D) @ (B, H, D, N_k)
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        S = S.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(S, dim=-1), v)


def run(fn, q, k, v, dO):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    O = fn(q, k, v)
    O.backward(dO)
    return O, q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N", [113, 1023])
def test_error_at_most_twice_plain_pytorch(dtype: torch.dtype, D: int, causal: bool, N: int) -> None:
    torch.manual_seed(0)
    q, k, v, dO = (torch.randn(2, 4, N, D, device="cuda") for _ in range(4))
    ref = run(lambda *a: plain_attention(*a, causal), q, k, v, dO)  # fp32 reference
    low = [t.to(dtype) for t in (q, k, v, dO)]
    pt = run(lambda *a: plain_attention(*a, causal), *low)
    ours = run(lambda *a: triton_attention(*a, causal=causal), *low)
    for name, r, p, o in zip(("O", "dq", "dk", "dv"), ref, pt, ours, strict=True):
        err_ours = (o.float() - r).abs().max().item()
        err_pt = (p.float() - r).abs().max().item()
        assert err_ours <= 2 * err_pt + 1e-4, f"{name}: {err_ours:.3g} > 2 x {err_pt:.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_backward_is_bitwise_deterministic_on_gpu(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 8, 1000, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 2, 1000, 64, device="cuda", dtype=dtype) for _ in range(2))
    dO = torch.randn_like(q)
    fn = lambda *a: triton_attention(*a, causal=True, enable_gqa=True)  # noqa: E731
    first, second = run(fn, q, k, v, dO), run(fn, q, k, v, dO)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_peak_memory_grows_linearly_in_sequence_length() -> None:
    peaks = []
    for N in (2048, 4096, 8192):
        q, k, v, dO = (torch.randn(1, 8, N, 64, device="cuda", dtype=torch.float16) for _ in range(4))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(lambda *a: triton_attention(*a, causal=True), q, k, v, dO)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del q, k, v, dO
    # linear: doubling N doubles the peak (quadratic would quadruple it)
    assert peaks[2] / peaks[1] < 2.5 and peaks[1] / peaks[0] < 2.5, peaks
