"""core/kernel.py's trace build in Triton's interpreter: tracing changes no output, each record holds the
kernel's state after its key block (judged against float64 torch, base 2 as documented), the key blocks a
program never visits stay as they were, and a wrong buffer is refused by name. The replay's comparison of every
term: ``tests/replay/test_trace_kernel.py``; the SASS unchanged with tracing off: ``test_core_kernel_trace_sass.py``.
"""

from __future__ import annotations

import math

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402

from flashattn_teach.core import kernel  # noqa: E402
from flashattn_teach.errors import AttentionValueError  # noqa: E402


def test_the_trace_holds_each_key_blocks_state_and_changes_no_output() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (20, 40, 40))
    trace = torch.full(kernel.trace_shape(20, 40, 16, 16, 16), math.nan)
    O, lse = kernel.triton_forward(q, k, v, True, block_m=16, block_n=16, trace=trace)
    O_plain, lse_plain = kernel.triton_forward(q, k, v, True, block_m=16, block_n=16)
    assert torch.equal(O, O_plain) and torch.equal(lse, lse_plain)
    assert trace.shape == (2, 3, 16, 16 + 3 + 16)
    # causal: program 0 (rows 0-15) visits key block 0 only, program 1 (rows 16-19) blocks 0 and 1
    visited = ~torch.isnan(trace[:, :, 0, 16])
    assert visited.tolist() == [[True, False, False], [True, True, False]]
    # program 1 after key block 1, head (0, 0): its rows 16-19, each seeing keys up to its own index, in float64
    S = (q[0, 0, 16:].double() @ k[0, 0].double().T) / 4  # (4, 40), base e
    S[torch.arange(40)[None, :] > torch.arange(16, 20)[:, None]] = -math.inf
    m = S.amax(-1)
    P = torch.exp(S - m[:, None])
    rec = trace[1, 1, :4].double()  # (4, W)
    torch.testing.assert_close(rec[:, 16] * math.log(2), m, rtol=1e-6, atol=1e-6)  # m_i in base 2
    torch.testing.assert_close(rec[:, 17], P.sum(-1), rtol=1e-6, atol=1e-6)  # l_i
    torch.testing.assert_close(rec[:, 19:35], P @ v[0, 0].double(), rtol=1e-5, atol=1e-6)  # acc, unnormalised
    S_ij = rec[:, :16] * math.log(2)  # s = S_ij log2 e over keys 16-31, -inf where masked
    torch.testing.assert_close(S_ij, S[:, 16:32], rtol=1e-6, atol=1e-6)
    assert torch.isneginf(S_ij[:, 4:]).all()


def test_a_wrong_trace_buffer_is_refused_by_name() -> None:
    q = torch.randn(1, 1, 20, 16)
    with pytest.raises(AttentionValueError, match=r"trace must be contiguous float32 of shape \(2, 2, 16, 35\)"):
        kernel.triton_forward(q, q, q, block_m=16, block_n=16, trace=torch.empty(2, 2, 16, 34))
    with pytest.raises(AttentionValueError, match="trace_shape"):
        kernel.triton_forward(q, q, q, block_m=16, block_n=16, trace=torch.empty(2, 2, 16, 35, dtype=torch.float64))
