"""Reshape between the user's layout and the grouped layout the CPU references compute in.

Grouped layout: ``q (B, H_kv, G, N_q, D)``, ``k (B, H_kv, 1, N_k, D)``, ``v (B, H_kv, 1, N_k, D_v)``
with ``G = H_q // H_kv``. A batched matmul then broadcasts each key/value head over its ``G`` query
heads, so grouped-query attention needs no ``repeat_interleave`` copy, and ``dK``, ``dV`` of a shared
head are a sum over the ``G`` axis.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._validate.inputs import AttentionShapes


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pad_rank(t: Tensor, rank: int) -> Tensor:
    """Prepend size-1 dims up to ``rank``, as matmul broadcasting does."""
    return t.reshape((1,) * (rank - t.dim()) + tuple(t.shape))


def to_grouped(q: Tensor, k: Tensor, v: Tensor, s: AttentionShapes) -> tuple[Tensor, Tensor, Tensor]:
    """User layout -> grouped layout, cast to the compute dtype."""
    dt = compute_dtype(q.dtype)
    rank = max(s.rank, 3)
    q, k, v = (pad_rank(t, rank).to(dt) for t in (q, k, v))
    B = 1
    for b in s.batch:
        B *= b
    qg = q.expand(*s.batch, s.H_q, s.N_q, s.D).reshape(B, s.H_kv, s.group, s.N_q, s.D)
    kg = k.expand(*s.batch, s.H_kv, s.N_k, s.D).reshape(B, s.H_kv, 1, s.N_k, s.D)
    vg = v.expand(*s.batch, s.H_kv, s.N_k, s.D_v).reshape(B, s.H_kv, 1, s.N_k, s.D_v)
    return qg, kg, vg


def rows_to_grouped(t: Tensor, s: AttentionShapes, dtype: torch.dtype) -> Tensor:
    """A per-query-row tensor of the output's layout, ``(*batch, H_q, N_q[, X])``, in the grouped layout
    ``(B, H_kv, G, N_q[, X])`` and ``dtype``: how ``O``, ``dO``, ``lse`` and ``dlse`` enter a backward."""
    per_row = t.dim() == len(s.lse_shape)  # lse-like: no feature axis
    full = s.lse_shape if per_row else s.out_shape
    t = t.expand(full).to(dtype)
    B = 1
    for b in s.batch:
        B *= b
    return t.reshape(B, s.H_kv, s.group, s.N_q, *(() if per_row else (t.shape[-1],)))


def from_grouped(o: Tensor, s: AttentionShapes) -> Tensor:
    """``(B, H_kv, G, N_q, X)`` -> ``(*batch, H_q, N_q, X)`` (or ``(N_q, X)`` for 2-D inputs)."""
    lead = s.out_shape[:-2]
    return o.reshape(*lead, s.N_q, o.shape[-1])


def lse_from_grouped(lse: Tensor, s: AttentionShapes) -> Tensor:
    """``(B, H_kv, G, N_q)`` -> ``(*batch, H_q, N_q)``."""
    return lse.reshape(s.lse_shape)


def grad_to_input(g: Tensor, t: Tensor, s: AttentionShapes) -> Tensor:
    """Map a grouped-layout gradient back onto input ``t``: undo broadcasting by summing, cast back."""
    heads = g.shape[1] * g.shape[2]  # H_kv * G for dq, H_kv * 1 for dk, dv
    g = g.reshape(*s.batch, heads, g.shape[-2], g.shape[-1])
    padded = pad_rank(t, max(s.rank, 3)).shape
    return g.sum_to_size(padded).reshape(t.shape).to(t.dtype)
