"""The Triton kernels align bottom-right causal masking, the window and ALiBi to each batch element's
``seqlens_k[b]``, as flash-attn does: forward, dK/dV and dQ against a float64 reference built here, one
batch element at a time, from flash-attn's rule (key ``j`` visible to query ``i`` of element ``b`` iff
``j < L_b`` and ``i + off_b - left <= j <= i + off_b + right``, ``off_b = L_b - N_q``; ALiBi
``-slope * |i + off_b - j|``). Small shapes: the interpreter is slow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _triton_cases import DEVICE, REL_TOL, assert_close_scaled  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flashattn_teach.triton import AttentionConfig, triton_attention  # noqa: E402

NEG_INF = float("-inf")


def rule(q, k, v, lengths, *, window=(-1, 0), alibi_slopes=None, causal_align="bottom_right"):
    """``(O, lse)`` in float64, ``q (B, H_q, N_q, D)``, ``k, v (B, H_kv, N_k, .)``; ``window`` with causal
    folded in (``right = 0``); ``alibi_slopes (H_q,)``."""
    _, H_q, N_q, D = q.shape
    N_k = k.shape[-2]
    k = k.double().repeat_interleave(H_q // k.shape[1], dim=1)
    v = v.double().repeat_interleave(H_q // v.shape[1], dim=1)
    i, j = torch.arange(N_q)[:, None], torch.arange(N_k)[None, :]
    left, right = window
    outs, lses = [], []
    for b, L in enumerate(lengths):
        off = L - N_q if causal_align == "bottom_right" else 0
        seen = (j < L) & ((left < 0) | (j >= i + off - left)) & ((right < 0) | (j <= i + off + right))  # (N_q, N_k)
        S = q[b].double() @ k[b].transpose(-1, -2) / D**0.5  # (H_q, N_q, N_k)
        if alibi_slopes is not None:
            S = S - alibi_slopes.double()[:, None, None] * (i + off - j).abs()
        S = S.masked_fill(~seen, NEG_INF)
        empty = ~seen.any(dim=-1, keepdim=True)
        S = S.masked_fill(empty, 0.0)
        outs.append(torch.softmax(S, dim=-1).masked_fill(empty, 0.0) @ v[b])
        lses.append(torch.logsumexp(S, dim=-1).masked_fill(empty[:, 0], NEG_INF))
    return torch.stack(outs), torch.stack(lses)


@dataclass(frozen=True)
class Case:
    lengths: tuple[int, ...]
    N_q: int = 21
    N_k: int = 37
    H_kv: int = 1
    group: int = 2
    window: tuple[int, int] = (-1, 0)  # causal
    alibi: bool = False
    causal_align: str = "bottom_right"
    config: AttentionConfig = field(default=AttentionConfig.uniform(16, 16))

    def tensors(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        B, H_q = len(self.lengths), self.H_kv * self.group
        q = torch.randn(B, H_q, self.N_q, 16, generator=g)
        k = torch.randn(B, self.H_kv, self.N_k, 16, generator=g)
        v = torch.randn(B, self.H_kv, self.N_k, 16, generator=g)
        return q, k, v, torch.randn(B, H_q, self.N_q, 16, generator=g)

    @property
    def slopes(self):
        return torch.linspace(0.1, 0.7, self.H_kv * self.group) if self.alibi else None

    def options(self):
        left, right = self.window
        causal = right == 0
        kw = {"causal": causal, "window": None if left < 0 and causal else self.window}
        return {**kw, "causal_align": self.causal_align, "seqlens_k": torch.tensor(self.lengths, device=DEVICE)}


CASES = {
    # element 1: 13 keys, 21 queries: rows 0-7 see nothing; element 2 none at all
    "causal": Case(lengths=(37, 13, 0)),
    # 16-key tiles: the diagonal of element 0 cuts tiles the other's does not
    "causal_tile_edges": Case(lengths=(16, 33), N_q=32, config=AttentionConfig.uniform(16, 32)),
    "window": Case(lengths=(37, 9), window=(4, 0)),
    "window_two_sided_no_causal": Case(lengths=(30, 20), window=(3, 2)),
    "alibi_causal": Case(lengths=(37, 18), alibi=True, H_kv=2, group=1),
    "top_left": Case(lengths=(37, 5), causal_align="top_left", alibi=True),
}


def _run(case: Case, q, k, v, dO):
    q, k, v = (t.to(DEVICE).requires_grad_() for t in (q, k, v))
    slopes = case.slopes
    O, lse = triton_attention(
        q,
        k,
        v,
        config=case.config,
        enable_gqa=True,
        return_lse=True,
        alibi_slopes=None if slopes is None else slopes.to(DEVICE),
        **case.options(),
    )
    dq, dk, dv = torch.autograd.grad((O * dO.to(DEVICE)).sum(), (q, k, v))
    return O, lse, dq, dk, dv


def _want(case: Case, q, k, v, dO):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    O, lse = rule(q, k, v, case.lengths, window=case.window, alibi_slopes=case.slopes, causal_align=case.causal_align)
    return O, lse, *torch.autograd.grad((O * dO.double()).sum(), (q, k, v))


def _check(case: Case, name: str) -> None:
    q, k, v, dO = case.tensors()
    got, want = _run(case, q, k, v, dO), _want(case, q, k, v, dO)
    for what, a, b in zip(("O", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert a.shape == b.shape, what
        assert_close_scaled(a, b, 2 * REL_TOL[torch.float32], f"{name} {what}")


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_align_each_element_to_its_own_length(name: str) -> None:
    _check(CASES[name], name)


def test_rows_before_a_short_element_s_diagonal_see_nothing() -> None:
    case = CASES["causal"]
    O, lse, dq, dk, dv = _run(case, *case.tensors())
    # element 1 has 13 keys and 21 queries: off_1 = -8, so rows 0-7 see no key and row 8 sees key 0
    assert torch.isneginf(lse[1, :, :8]).all() and torch.isfinite(lse[1, :, 8:]).all()
    assert (O[1, :, :8] == 0).all() and (dq[1, :, :8] == 0).all()
    assert torch.isneginf(lse[2]).all() and (O[2] == 0).all() and (dk[2] == 0).all() and (dv[2] == 0).all()
    assert (dk[1, :, 13:] == 0).all() and (dv[1, :, 13:] == 0).all()
    assert not any(t.isnan().any() for t in (O, dq, dk, dv))


@settings(max_examples=4, deadline=None)
@given(
    N_q=st.integers(1, 40),
    data=st.data(),
    window=st.sampled_from([(-1, 0), (5, 0), (2, 7)]),
    config=st.sampled_from([AttentionConfig.uniform(16, 16), AttentionConfig.uniform(32, 16)]),
)
def test_kernels_align_any_lengths_and_tiles(N_q: int, data, window: tuple[int, int], config) -> None:
    N_k = data.draw(st.integers(1, 40))
    lengths = tuple(data.draw(st.lists(st.integers(0, N_k), min_size=1, max_size=3)))
    _check(Case(lengths=lengths, N_q=N_q, N_k=N_k, window=window, config=config), "drawn")
