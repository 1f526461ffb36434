"""The backward replay against torch.autograd of a float64 dense attention written here."""

from __future__ import annotations

import math

import pytest
import torch

from flashattn_teach.trace.backward_replay import replay_backward


def _dense_grads(q, k, v, dO, mask, softcap=None):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    S = (q @ k.T) / math.sqrt(q.shape[-1])
    if softcap is not None:
        S = softcap * torch.tanh(S / softcap)
    S = S.masked_fill(~mask, float("-inf"))
    P = torch.nan_to_num(torch.softmax(S, -1), nan=0.0)
    O = P @ v
    (O * dO).sum().backward()
    return P.detach(), O.detach(), (q.grad, k.grad, v.grad)


CASES = [
    (6, 4, 2, 2, False, None, None),
    (6, 4, 2, 2, True, None, None),
    (7, 4, 3, 2, True, None, None),
    (6, 4, 2, 2, False, (0, 0), None),
    (6, 4, 2, 2, True, None, 2.0),
]


@pytest.mark.parametrize(("N", "D", "bm", "bn", "causal", "window", "softcap"), CASES)
def test_backward_replay_matches_autograd(N, D, bm, bn, causal, window, softcap):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(N, D, generator=g, dtype=torch.float64) for _ in range(3))
    r = replay_backward(q, k, v, block_m=bm, block_n=bn, causal=causal, window=window, softcap=softcap)
    idx = torch.arange(N)
    mask = torch.ones(N, N, dtype=torch.bool)
    if causal:
        mask &= idx[None, :] <= idx[:, None]
    if window is not None:
        mask &= (idx[None, :] >= idx[:, None] - window[0]) & (idx[None, :] <= idx[:, None] + window[1])
    P, O, grads = _dense_grads(q, k, v, r.dO, mask, softcap)
    for mine, ref in zip(r.grads(), grads, strict=True):
        assert not torch.isnan(mine).any()
        torch.testing.assert_close(mine, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(r.delta, (r.dO * O).sum(-1), atol=1e-12, rtol=0)
    for s in r.dkdv_steps():
        (r0, r1), (c0, c1) = s.rows, s.cols
        torch.testing.assert_close(s.P_ij, P[r0:r1, c0:c1], atol=1e-12, rtol=0)
