"""What the mask tests share: ``formula``, the mask contract (window, softcap, ALiBi, seqlens_k, attn_mask)
written from flash-attn's definitions with plain torch ops over the whole score matrix (it shares no code with
``flashattn_teach.masks``), the paths it checks, and a probe that records the score tiles a path computes."""

from __future__ import annotations

import pytest
import torch

from flashattn_teach.masks.spec import Tiling
from flashattn_teach.reference import dense_attention, key_major_attention, online_attention, scores

from attention_strategies import parallel_attention
from probes import patch_everywhere

NEG_INF = float("-inf")


TILED = [
    pytest.param(online_attention, id="query_major"),
    pytest.param(key_major_attention, id="key_major"),
    pytest.param(parallel_attention, id="parallel"),
]
ALL = [*TILED, pytest.param(dense_attention, id="dense")]


def formula(q, k, v, *, causal=False, causal_align="top_left", window=None, softcap=None, alibi_slopes=None,
            seqlens_k=None, attn_mask=None, **_):  # fmt: skip
    """``(O, lse)`` by the definitions, float64, 4-D inputs ``(B, H, N, D)`` with ``H_kv`` dividing ``H_q``."""
    q, k, v = q.double(), k.double(), v.double()
    B, H_q, N_q, D = q.shape
    N_k = k.shape[-2]
    k = k.repeat_interleave(H_q // k.shape[1], dim=1)
    v = v.repeat_interleave(H_q // v.shape[1], dim=1)
    S = torch.einsum("bhid,bhjd->bhij", q, k) / D**0.5
    if softcap is not None:
        S = softcap * torch.tanh(S / softcap)
    off = 0 if causal_align == "top_left" else N_k - N_q
    if seqlens_k is not None and causal_align == "bottom_right":
        off = (seqlens_k - N_q).reshape(-1, 1, 1, 1)  # flash-attn: each batch element aligned to its own length
    i = torch.arange(N_q)[:, None]
    j = torch.arange(N_k)[None, :]
    seen = torch.ones(B, H_q, N_q, N_k, dtype=torch.bool)
    if causal:
        seen &= j <= i + off
    if window is not None:
        left, right = window
        if left >= 0:
            seen &= j >= i + off - left
        if right >= 0:
            seen &= j <= i + off + right
    if seqlens_k is not None:
        seen &= j < seqlens_k[:, None, None, None]
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().reshape(-1, H_q, 1, 1)  # (1 or B, H_q, 1, 1)
        S = S - slopes * (i + off - j).abs()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            seen &= attn_mask
        else:
            S = S + attn_mask.double()
    S = S.masked_fill(~seen, NEG_INF)
    empty = torch.isneginf(S).all(dim=-1, keepdim=True)  # rows that see no key: O = 0, lse = -inf
    S = S.masked_fill(empty, 0.0)
    P = torch.softmax(S, dim=-1).masked_fill(empty, 0.0)
    lse = torch.logsumexp(S, dim=-1).masked_fill(empty[..., 0], NEG_INF)
    return P @ v, lse


def assert_lse_equal(lse, ref, atol):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    finite = ~torch.isneginf(ref)
    torch.testing.assert_close(lse[finite].double(), ref[finite], atol=atol, rtol=0)


def count_score_tiles(monkeypatch):
    """Patch the references to record ``(Br, Bc, masked)`` of every score tile they compute: ``score_tile``
    for the query-major and key-major loops, ``Tiling.head_tile`` for the parallel path's per-head loops."""
    visited: list[tuple[int, int, bool]] = []
    original = scores.score_tile

    def counting(q_i, k_j, scale, allowed=None, **variants):
        visited.append((q_i.shape[-2], k_j.shape[-2], allowed is not None))
        return original(q_i, k_j, scale, allowed, **variants)

    head_tile = Tiling.head_tile

    def counting_head_tile(self, i, j, rows, **where):
        allowed, bias = head_tile(self, i, j, rows, **where)
        c0, c1 = self.col_blocks[j]
        visited.append((rows[1] - rows[0], c1 - c0, allowed is not None))
        return allowed, bias

    patch_everywhere(monkeypatch, scores, "score_tile", counting)
    monkeypatch.setattr(Tiling, "head_tile", counting_head_tile)
    return visited
