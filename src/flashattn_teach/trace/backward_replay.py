"""Backward replay: the tile steps of FlashAttention-2's backward (Dao 2023, Alg. 2), for one head.

Split as Triton's tutorial and :mod:`flashattn_teach.reference.backward` do it:

    preprocess:  delta_i = rowsum(dO_i * O_i)                              (Alg. 2 line 4)
    dK/dV pass:  for each key block j, each query block i that sees it (SKIP tiles left out):
                 P_ij = exp(S_ij - lse_i)                                   (line 11, recomputed)
                 dV_j += P_ij^T dO_i                                        (line 12)
                 dP_ij = dO_i V_j^T                                         (line 13)
                 dS_ij = P_ij * (dP_ij - delta_i)  [softcap: * (1 - T^2)]   (line 14)
                 dK_j += scale dS_ij^T Q_i                                  (line 16)
    dQ pass:     for each query block i, each key block j it sees:
                 dQ_i += scale dS_ij K_j                                    (line 15)

``dO`` defaults to ``torch.randn`` of O's shape from a ``torch.Generator`` seeded with ``seed``. Rows with
``lse = -inf`` (every key masked) get ``P = 0`` and zero gradients. Steps are computed when iterated.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._layout import compute_dtype
from .._options import make_options
from .._validate.inputs import validate_block_sizes
from ..masks.causal import TileKind
from ..masks.spec import Tiling
from ..online_softmax import score_tile
from .inputs import check_index, one_head, one_slope, pick_matrix
from .schedule import visited_key_blocks

__all__ = ["BackwardReplay", "BackwardStep", "replay_backward"]


@dataclass(frozen=True)
class BackwardStep:
    """One tile of a pass: ``pass_name`` "dkdv" or "dq"; tensors are the tile's, accumulators after it."""

    pass_name: str
    index: int
    i: int
    j: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    kind: TileKind
    S_ij: Tensor  # (Br, Bc)
    P_ij: Tensor  # (Br, Bc)
    dP_ij: Tensor  # (Br, Bc)
    dS_ij: Tensor  # (Br, Bc), w.r.t. the uncapped scores
    acc: dict[str, Tensor]  # "dV_j", "dK_j" (Bc, D) or "dQ_i" (Br, D), after this step
    equations: list[dict[str, Any]]


@dataclass(frozen=True)
class BackwardReplay:
    q: Tensor  # (N_q, D)
    k: Tensor  # (N_k, D)
    v: Tensor  # (N_k, D_v)
    O: Tensor  # (N_q, D_v)
    lse: Tensor  # (N_q,)
    dO: Tensor  # (N_q, D_v)
    delta: Tensor  # (N_q,), Alg. 2 line 4
    tiling: Tiling
    scale: float
    softcap: float | None
    batch_index: int
    block_m: int
    block_n: int

    def _tile(self, i: int, j: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """S_ij, P_ij, dP_ij, dS_ij of tile (i, j)."""
        (r0, r1), (c0, c1) = self.tiling.row_blocks[i], self.tiling.col_blocks[j]
        allowed, bias = self.tiling.head_tile(i, j, (r0, r1), b=self.batch_index, h=0, device=self.q.device)
        q_i, k_j = self.q[r0:r1], self.k[c0:c1]
        S_ij = score_tile(q_i, k_j, self.scale, allowed, softcap=self.softcap, bias=bias)  # (Br, Bc)
        lse_i = self.lse[r0:r1].unsqueeze(-1)  # (Br, 1)
        P_ij = torch.where(torch.isneginf(lse_i), torch.zeros_like(S_ij), torch.exp(S_ij - lse_i))
        dP_ij = self.dO[r0:r1] @ self.v[c0:c1].T  # (Br, D_v) @ (D_v, Bc)
        dS_ij = P_ij * (dP_ij - self.delta[r0:r1].unsqueeze(-1))
        if self.softcap is not None:
            T = torch.tanh((q_i * self.scale) @ k_j.T / self.softcap)
            dS_ij = dS_ij * (1 - T * T)
        return S_ij, P_ij, dP_ij, dS_ij

    def _kind(self, i: int, j: int) -> TileKind:
        return self.tiling.kind(i, j, b=self.batch_index, h=0)

    def _visits(self) -> dict[int, list[int]]:
        return {i: list(js) for i, js in enumerate(visited_key_blocks(self.tiling, b=self.batch_index))}

    def dkdv_steps(self) -> Iterator[BackwardStep]:
        visits = self._visits()
        n = 0
        for j, (c0, c1) in enumerate(self.tiling.col_blocks):
            dV_j = torch.zeros(c1 - c0, self.v.shape[-1], dtype=self.q.dtype, device=self.q.device)
            dK_j = torch.zeros(c1 - c0, self.q.shape[-1], dtype=self.q.dtype, device=self.q.device)
            for i in (i for i in visits if j in visits[i]):
                r0, r1 = self.tiling.row_blocks[i]
                S_ij, P_ij, dP_ij, dS_ij = self._tile(i, j)
                dV_j = dV_j + P_ij.T @ self.dO[r0:r1]
                dK_j = dK_j + self.scale * dS_ij.T @ self.q[r0:r1]
                eqs = [
                    {"line": 11, "name": "P_ij", "symbolic": "exp(S_ij - lse_i)", "value": P_ij},
                    {"line": 12, "name": "dV_j", "symbolic": "dV_j + P_ij^T dO_i", "value": dV_j},
                    {"line": 13, "name": "dP_ij", "symbolic": "dO_i V_j^T", "value": dP_ij},
                    {"line": 14, "name": "dS_ij", "symbolic": "P_ij * (dP_ij - delta_i)", "value": dS_ij},
                    {"line": 16, "name": "dK_j", "symbolic": "dK_j + scale dS_ij^T Q_i", "value": dK_j},
                ]
                yield BackwardStep(
                    "dkdv",
                    n,
                    i,
                    j,
                    (r0, r1),
                    (c0, c1),
                    self._kind(i, j),
                    S_ij,
                    P_ij,
                    dP_ij,
                    dS_ij,
                    {"dV_j": dV_j, "dK_j": dK_j},
                    eqs,
                )
                n += 1

    def dq_steps(self) -> Iterator[BackwardStep]:
        n = 0
        for i, js in self._visits().items():
            r0, r1 = self.tiling.row_blocks[i]
            dQ_i = torch.zeros(r1 - r0, self.q.shape[-1], dtype=self.q.dtype, device=self.q.device)
            for j in js:
                c0, c1 = self.tiling.col_blocks[j]
                S_ij, P_ij, dP_ij, dS_ij = self._tile(i, j)
                dQ_i = dQ_i + self.scale * dS_ij @ self.k[c0:c1]
                eqs = [{"line": 15, "name": "dQ_i", "symbolic": "dQ_i + scale dS_ij K_j", "value": dQ_i}]
                yield BackwardStep(
                    "dq", n, i, j, (r0, r1), (c0, c1), self._kind(i, j), S_ij, P_ij, dP_ij, dS_ij, {"dQ_i": dQ_i}, eqs
                )
                n += 1

    def grads(self) -> tuple[Tensor, Tensor, Tensor]:
        """dQ (N_q, D), dK (N_k, D), dV (N_k, D_v), assembled from the two passes."""
        dQ, dK, dV = torch.zeros_like(self.q), torch.zeros_like(self.k), torch.zeros_like(self.v)
        for s in self.dkdv_steps():
            dK[s.cols[0] : s.cols[1]] = s.acc["dK_j"]
            dV[s.cols[0] : s.cols[1]] = s.acc["dV_j"]
        for s in self.dq_steps():
            dQ[s.rows[0] : s.rows[1]] = s.acc["dQ_i"]
        return dQ, dK, dV


def replay_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dO: Tensor | None = None,
    *,
    block_m: int,
    block_n: int,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    batch_index: int = 0,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: float | Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    seed: int = 0,
) -> BackwardReplay:
    """Replay the backward of one head, shapes and mask contract as :func:`.replay.replay`."""
    B = max((t.shape[0] for t in (q, k, v) if t.dim() == 3), default=1)
    block_m, block_n = validate_block_sizes(block_m, block_n)
    batch_index = check_index("batch_index", batch_index, B, f"batch size B={B}")
    if isinstance(attn_mask, Tensor) and attn_mask.dim() == 3:
        attn_mask = attn_mask.unsqueeze(-3)
    four_d = [one_head(t) for t in (q, k, v)]
    opts = make_options(
        *four_d,
        causal=causal,
        causal_align=causal_align,
        scale=scale,
        attn_mask=attn_mask,
        window=window,
        softcap=softcap,
        alibi_slopes=one_slope(alibi_slopes, B),
        seqlens_k=seqlens_k,
    )
    dt = compute_dtype(q.dtype)
    q2, k2, v2 = (pick_matrix(t, name, batch_index).to(dt) for t, name in ((q, "query"), (k, "key"), (v, "value")))
    N_q, N_k = q2.shape[0], k2.shape[0]
    kinds = {"structure": TileKind.PARTIAL, "mask": TileKind.PARTIAL}
    allowed, bias = opts.mask.tensors(0, N_q, 0, N_k, q2.device, **kinds, b=batch_index, h=0)
    S = score_tile(q2, k2, opts.scale, allowed, softcap=opts.mask.softcap, bias=bias)  # (N_q, N_k)
    lse = torch.logsumexp(S, dim=-1)  # (N_q,), -inf for a fully masked row
    P = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros_like(S), torch.exp(S - lse.unsqueeze(-1)))
    O = P @ v2  # (N_q, D_v)
    if dO is None:
        gen = torch.Generator().manual_seed(seed)
        dO = torch.randn(O.shape, generator=gen, dtype=dt)
    dO = dO.to(dt)
    delta = (dO * O).sum(-1)  # Alg. 2 line 4
    return BackwardReplay(
        q2,
        k2,
        v2,
        O,
        lse,
        dO,
        delta,
        opts.mask.tiling(block_m, block_n),
        opts.scale,
        opts.mask.softcap,
        batch_index,
        block_m,
        block_n,
    )
