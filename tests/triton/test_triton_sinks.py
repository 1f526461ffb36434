"""Attention sinks in the Triton kernels (``SINKS``: each row's state starts at ``m_i = sink_h log2(e)``,
``l_i = 1``; the backward kernels read them in the saved ``lse``): ``O``, ``lse`` and the gradients of
``q, k, v`` and the sinks against the float64 oracle of ``tests/sink_oracle.py``, with grouped-query heads,
causal masking, a window with softcap, rows that see no key (``lse = sink``), dropout (the kernels' keep mask
is the CPU paths', so the oracle draws the same one), and packed sequences. Small cases at the interpreter's
32 x 16 tiles; the negative control is the oracle without its sink."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _triton_cases import DEVICE, REL_TOL, assert_close_scaled  # noqa: E402

import flashattn_teach as fa  # noqa: E402
from flashattn_teach import dropout as dp  # noqa: E402

from sink_oracle import grads_of, sink_oracle  # noqa: E402

B, H_Q, H_KV, D = 1, 4, 2, 16

CASES = {
    "gqa": (24, 37, {}),
    "causal": (37, 37, {"causal": True}),
    "window_softcap": (24, 37, {"window": (6, 3), "softcap": 2.5}),
    # bottom-right with N_q > N_k: the first rows see no key
    "empty_rows": (29, 13, {"causal": True, "causal_align": "bottom_right"}),
}


def _leaves(N_q: int, N_k: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_Q, N_q, D, generator=g)
    k = torch.randn(B, H_KV, N_k, D, generator=g)
    v = torch.randn(B, H_KV, N_k, D, generator=g)
    sinks = torch.randn(H_Q, generator=g) * 2
    return [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)] + [sinks.to(DEVICE).requires_grad_()]


def _check(O, lse, leaves, O_ref, lse_ref, dtype, label: str) -> None:
    tol = REL_TOL[dtype]
    assert_close_scaled(O.double(), O_ref, tol, f"{label}: O")
    assert_close_scaled(lse.double(), lse_ref, tol, f"{label}: lse")
    got, want = grads_of(O, lse, leaves), grads_of(O_ref, lse_ref, leaves)
    for name, g, w in zip(("q", "k", "v", "sinks"), got, want, strict=True):
        assert_close_scaled(g.double(), w.double(), 4 * tol, f"{label}: d{name}")


def _oracle(leaves, **kw):
    return sink_oracle(*(t.double() for t in leaves), **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_triton_sinks_match_the_float64_oracle(case: str) -> None:
    N_q, N_k, kw = CASES[case]
    leaves = _leaves(N_q, N_k)
    O, lse = fa.flash_attention(*leaves[:3], sinks=leaves[3], backend="triton", return_lse=True, **kw)
    O_ref, lse_ref = _oracle(leaves, **kw)
    _check(O, lse, leaves, O_ref, lse_ref, torch.float32, case)
    if case == "empty_rows":  # rows 0..15 see no key (off = 13 - 29): O = 0, lse = sink_h
        assert torch.equal(O[:, :, :16].detach().cpu(), torch.zeros(B, H_Q, 16, D))
        assert torch.equal(lse[:, :, :16].cpu(), leaves[3].detach().cpu()[None, :, None].expand(B, H_Q, 16))
    # negative control: the oracle without its sink is far from the kernel's output
    O_plain, _ = sink_oracle(*(t.double() for t in leaves[:3]), None, **kw)
    assert (O.double().cpu() - O_plain.cpu()).abs().max() > 1e-2


def test_triton_sinks_in_the_deterministic_two_kernel_backward() -> None:
    N_q, N_k, kw = CASES["causal"]
    leaves = _leaves(N_q, N_k, seed=1)
    O, lse = fa.flash_attention(
        *leaves[:3], sinks=leaves[3], backend="triton", deterministic=True, return_lse=True, **kw
    )
    _check(O, lse, leaves, *_oracle(leaves, **kw), torch.float32, "deterministic")


def test_triton_sinks_with_dropout_drop_key_weights_only() -> None:
    p, seed = 0.25, 99
    leaves = _leaves(24, 37)
    torch.manual_seed(seed)  # the call draws its key from torch's default generator
    O, lse = fa.flash_attention(
        *leaves[:3], sinks=leaves[3], causal=True, dropout_p=p, backend="triton", return_lse=True
    )
    torch.manual_seed(seed)
    O_ref, lse_ref = _oracle(leaves, causal=True, key=dp.draw(p))
    _check(O, lse, leaves, O_ref, lse_ref, torch.float32, "dropout")
    assert_close_scaled(lse.double(), _oracle(leaves, causal=True)[1], REL_TOL[torch.float32], "lse undropped")


def test_triton_sinks_get_their_gradient_when_q_k_v_need_none() -> None:
    q, k, v, sinks = _leaves(24, 37)
    q, k, v = (t.detach() for t in (q, k, v))
    O = fa.flash_attention(q, k, v, sinks=sinks, causal=True, backend="triton")
    (dsink,) = torch.autograd.grad(O.square().sum(), sinks)
    s64 = sinks.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(_oracle([q, k, v, s64], causal=True)[0].square().sum(), s64)
    assert_close_scaled(dsink.double(), want, 4 * REL_TOL[torch.float32], "dsink")


def test_triton_varlen_sinks_match_the_oracle_per_sequence() -> None:
    lengths = [(9, 21), (5, 0), (18, 11)]  # the second sequence has no key: its rows' lse is the sink
    g = torch.Generator().manual_seed(3)
    cu_q = torch.tensor([0, 9, 14, 32], dtype=torch.int32)
    cu_k = torch.tensor([0, 21, 21, 32], dtype=torch.int32)
    q = torch.randn(32, H_Q, D, generator=g).to(DEVICE).requires_grad_()
    k = torch.randn(32, H_KV, D, generator=g).to(DEVICE).requires_grad_()
    v = torch.randn(32, H_KV, D, generator=g).to(DEVICE).requires_grad_()
    sinks = torch.randn(H_Q, generator=g).to(DEVICE).requires_grad_()
    leaves = [q, k, v, sinks]
    O, lse = fa.flash_attention_varlen(
        q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), 18, 21, causal=True, sinks=sinks, backend="triton", return_lse=True
    )
    parts = []
    for b in range(len(lengths)):
        rows, cols = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        # (len, H, D) -> (1, H, len, D), float64
        seq = [t[s].transpose(0, 1)[None].double() for t, s in ((q, rows), (k, cols), (v, cols))]
        O_b, lse_b = sink_oracle(*seq, sinks.double(), causal=True, causal_align="bottom_right")
        parts.append((O_b[0].transpose(0, 1), lse_b[0]))
    O_ref = torch.cat([o for o, _ in parts], dim=0)  # (total_q, H_q, D)
    lse_ref = torch.cat([x for _, x in parts], dim=1)  # (H_q, total_q)
    _check(O, lse, leaves, O_ref, lse_ref, torch.float32, "varlen")


def test_triton_sinks_with_no_query_row_give_zero_gradients() -> None:
    """``N_q = 0`` (an empty chunk of a chunked prefill): empty outputs, and the gradients are sums over no
    row, zeros; the backward used to fail reshaping its 0 rows."""
    leaves = _leaves(0, 13)
    O, lse = fa.flash_attention(*leaves[:3], sinks=leaves[3], backend="triton", return_lse=True)
    assert O.shape == (B, H_Q, 0, D) and lse.shape == (B, H_Q, 0)
    for t, g in zip(leaves, torch.autograd.grad((O.sum(), lse.sum()), leaves), strict=True):
        assert torch.equal(g, torch.zeros_like(t))
