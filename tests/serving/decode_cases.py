"""What the KV-cache tests share: the oracle, small problems, and the tiles every backend runs at.

The oracle is built here from the definition, in float64, one batch element at a time: dense attention of
``q[b]`` over the first ``L_b`` keys of the updated cache, with the bottom-right mask and ALiBi distance
written out from query positions ``L_b - N_new + i``. It shares no code with the mask contract, the tiled
paths or the merge.
"""

from __future__ import annotations

import contextlib
import math

import torch

from flashattn_teach.dispatch import planner
from flashattn_teach.reference import parallel

NEG_INF = float("-inf")
CPU_BACKENDS = ["parallel", "query_major", "key_major", "dense"]


def randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def slopes_of(*shape, seed):
    return torch.rand(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def oracle(q, k_cache, v_cache, L, *, causal=True, window=None, softcap=None, alibi_slopes=None, scale=None):
    """``(O, lse)`` of one batch element, ``q (H_q, N_new, D)`` over keys ``[0, L)`` of ``k_cache (H_kv, N_max, D)``."""
    H_q, N_new, D = q.shape
    G = H_q // k_cache.shape[0]
    k = k_cache[:, :L].double().repeat_interleave(G, dim=0)  # (H_q, L, D): query head h reads kv head h // G
    v = v_cache[:, :L].double().repeat_interleave(G, dim=0)
    scale = 1 / math.sqrt(D) if scale is None else scale
    S = scale * q.double() @ k.transpose(1, 2)  # (H_q, N_new, D) @ (H_q, D, L) -> (H_q, N_new, L)
    if softcap is not None:
        S = softcap * torch.tanh(S / softcap)
    pos = (L - N_new + torch.arange(N_new))[:, None]  # (N_new, 1): query row i's position in the sequence
    j = torch.arange(L)[None, :]  # (1, L)
    if alibi_slopes is not None:
        S = S - alibi_slopes.double()[:, None, None] * (pos - j).abs()
    visible = torch.ones(N_new, L, dtype=torch.bool)
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    if left >= 0:
        visible &= j >= pos - left
    if right >= 0:
        visible &= j <= pos + right
    S = S.masked_fill(~visible, NEG_INF)
    lse = torch.logsumexp(S, dim=-1)  # (H_q, N_new); -inf for a row that sees nothing
    P = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(S - lse[..., None]))
    return P @ v, lse  # (H_q, N_new, L) @ (H_q, L, D_v) -> (H_q, N_new, D_v)


def batch_oracle(q, k_cache, v_cache, lengths, *, alibi_slopes=None, **opts):
    parts = [
        oracle(
            q[b],
            k_cache[b],
            v_cache[b],
            L,
            alibi_slopes=None if alibi_slopes is None else alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b],
            **opts,
        )
        for b, L in enumerate(lengths)
    ]
    return torch.stack([O for O, _ in parts]), torch.stack([lse for _, lse in parts])


def assert_matches(O, lse, O_ref, lse_ref, atol=1e-12):
    torch.testing.assert_close(O, O_ref, atol=atol, rtol=atol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    finite = ~torch.isneginf(lse_ref)
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=atol, rtol=atol)


@contextlib.contextmanager
def tiles(block_m: int, block_n: int):
    """Every tiled backend at ``block_m x block_n``, and the parallel one on its pool even for tiny calls."""
    saved, few_rows = dict(planner.TILED), planner.FEW_ROWS
    smallest = parallel.MIN_PARALLEL_SCORES
    planner.TILED.update({name: (order, block_m, block_n) for name, (order, _, _) in saved.items()})
    planner.FEW_ROWS = 0  # the tiles asked for, not the wide ones of a few-row call
    parallel.MIN_PARALLEL_SCORES = 0
    try:
        yield
    finally:
        planner.TILED.update(saved)
        planner.FEW_ROWS = few_rows
        parallel.MIN_PARALLEL_SCORES = smallest


def problem(B, H_q, H_kv, N_max, N_new, N_new_kv, *, D=8, D_v=6, seed=0):
    q = randn(B, H_q, N_new, D, seed=seed)
    k_cache, v_cache = randn(B, H_kv, N_max, D, seed=seed + 1), randn(B, H_kv, N_max, D_v, seed=seed + 2)
    new = (randn(B, H_kv, N_new_kv, D, seed=seed + 3), randn(B, H_kv, N_new_kv, D_v, seed=seed + 4))
    return q, k_cache, v_cache, (new if N_new_kv else (None, None))
