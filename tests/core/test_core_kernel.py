"""core/kernel.py against the core dense oracle in float64: in Triton's interpreter on a CPU (``tests/conftest.py``
sets ``TRITON_INTERPRET=1`` before triton is imported), compiled on a CUDA GPU. Shapes stay small (N <= 70) so
the interpreter is quick; block sizes 16 and 32 make several tiles, short last ones, and N_q != N_k.

flash-attn's rule for low precision: the kernel's error against float64 is at most twice that of plain PyTorch
(the dense oracle run in the same dtype), plus a small floor for outputs both get exactly right. bfloat16 runs
only on a GPU: the interpreter multiplies bfloat16 tiles wrongly (``tests/triton/test_triton_interpreter_dtypes.py``).
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402

from flashattn_teach.core import (  # noqa: E402
    dense_attention,
    flash_backward,
    kernel,
)
from flashattn_teach.errors import AttentionValueError  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
LOW = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not ON_GPU, reason="interpreter bf16"))]
# (N_q, N_k, D, block_m, block_n): several tiles, short last ones, N_q != N_k, and D = 24 (lanes masked)
SHAPES = [(37, 53, 16, 16, 16), (70, 20, 32, 32, 16), (16, 16, 16, 16, 32), (1, 45, 32, 16, 16), (20, 33, 24, 16, 16)]


def inputs(N_q: int, N_k: int, D: int, dtype: torch.dtype, gain: float = 1.0):
    g = torch.Generator().manual_seed(N_q * 100 + N_k + D)
    q, k, v, dO = (torch.randn(1, 2, n, D, generator=g) for n in (N_q, N_k, N_k, N_q))
    return tuple(t.to(DEVICE, dtype) for t in (q * gain, k * gain, v, dO))


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double().cpu() - b.double().cpu()).abs().max().item()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("N_q", "N_k", "D", "block_m", "block_n"), SHAPES)
def test_kernel_forward_and_backward_match_float64_in_float32(causal, N_q, N_k, D, block_m, block_n) -> None:
    q, k, v, dO = inputs(N_q, N_k, D, torch.float32)
    O, lse = kernel.triton_forward(q, k, v, causal, block_m=block_m, block_n=block_n)
    f64 = [t.double().cpu() for t in (q, k, v, dO)]
    O_ref, lse_ref = dense_attention(*f64[:3], causal=causal)
    assert O.dtype == torch.float32 and lse.dtype == torch.float32
    tol = 2e-3 if ON_GPU else 1e-5  # TF32 dots on a GPU
    assert max_err(O, O_ref) < tol and max_err(lse, lse_ref) < tol
    grads = kernel.triton_backward(q, k, v, O, dO, lse, causal, block_m=block_m, block_n=block_n)
    refs = flash_backward(*f64[:3], O_ref, f64[3], lse_ref, causal)
    for name, a, b in zip("qkv", grads, refs, strict=True):
        assert a.dtype == torch.float32 and max_err(a, b) < 5 * tol, f"d{name}"


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_error_is_at_most_twice_plain_pytorch_in_low_precision(dtype, causal) -> None:
    q, k, v, dO = inputs(45, 61, 32, dtype)
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    O_ref = dense_attention(*leaves, causal=causal)[0]
    refs = torch.autograd.grad(O_ref, leaves, dO.double().cpu())
    low = [t.detach().cpu().requires_grad_() for t in (q, k, v)]  # plain PyTorch in the same dtype
    O_pt = dense_attention(*low, causal=causal)[0]
    pts = torch.autograd.grad(O_pt, low, dO.cpu())
    mine = [t.detach().requires_grad_() for t in (q, k, v)]
    O = kernel.attention(*mine, causal=causal)
    grads = torch.autograd.grad(O, mine, dO)
    assert O.dtype == dtype
    for name, a, pt, ref in zip(("O", "dq", "dk", "dv"), (O, *grads), (O_pt, *pts), (O_ref, *refs), strict=True):
        assert max_err(a, ref) <= 2 * max_err(pt, ref) + 1e-4, name


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_with_logits_near_1e3_and_rows_with_no_key_has_no_nan(causal) -> None:
    q, k, v, dO = inputs(33, 50, 16, torch.float32, gain=20.0)
    O, lse = kernel.triton_forward(q, k, v, causal, block_m=16, block_n=16)
    f64 = [t.double().cpu() for t in (q, k, v)]
    O_ref, lse_ref = dense_attention(*f64, causal=causal)
    assert lse_ref.abs().max() > 500
    assert max_err(O, O_ref) < 1e-3 and not O.isnan().any()
    grads = kernel.triton_backward(q, k, v, O, dO, lse, causal, block_m=16, block_n=16)
    assert not any(g.isnan().any() for g in grads)
    O, lse = kernel.triton_forward(q, k[:, :, :0], v[:, :, :0], causal)  # N_k = 0: no row sees a key
    assert (O == 0).all() and torch.isneginf(lse).all()


def test_kernel_refuses_block_sizes_tl_dot_cannot_take() -> None:
    q, k, v, _ = inputs(8, 8, 16, torch.float32)
    with pytest.raises(AttentionValueError, match="block_m must be a power of two >= 16"):
        kernel.triton_forward(q, k, v, block_m=24)
