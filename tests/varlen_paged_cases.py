"""Packed sequences over a paged KV cache (``flash_attention_varlen(..., block_table=)``) and their float64
oracle, written from the definition and nothing of the library's code: each sequence's keys read back from
its pages one position at a time (key j at page ``block_table[b, j // page_size]``, slot ``j % page_size``),
then one dense softmax per sequence and query head. Shared by the CPU and the Triton tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# (len_q, len_k) per sequence: more keys than queries (bottom-right causal offset 14), no keys at all (its
# rows see nothing), keys but no queries, one of each, a square one that cuts 16-key tiles
LENGTHS = [(6, 20), (2, 0), (0, 5), (1, 1), (17, 17)]
H_Q, H_KV, D, D_V = 4, 2, 16, 8  # GQA: two query heads per key/value head; D_v != D
GARBAGE = (10**6, -1)  # table entries past a sequence's pages: never to be read


@dataclass(frozen=True)
class PagedVarlen:
    q: Tensor  # (total_q, H_q, D)
    k_pages: Tensor  # (num_blocks, H_kv, page_size, D), possibly a transposed view
    v_pages: Tensor  # (num_blocks, H_kv, page_size, D_v)
    block_table: Tensor  # (B, max_blocks) int32
    cu_q: Tensor  # (B + 1,) int32
    cu_k: Tensor  # (B + 1,) int32
    max_q: int
    max_k: int

    def args(self) -> tuple:
        return (self.q, self.k_pages, self.v_pages, self.cu_q, self.cu_k, self.max_q, self.max_k)


def paged_varlen(*, page_size: int, layout: str = "bhnd", dtype=torch.float32, device="cpu", seed=0) -> PagedVarlen:
    """Random pools with two spare pages no sequence owns, a shuffled block table (one more column than the
    longest sequence needs) and garbage in every entry past a sequence's pages. ``layout="bnhd"``: the pools
    stored as flash-attn's ``(num_blocks, page_size, H_kv, D)`` and passed as ``.transpose(1, 2)``."""
    g = torch.Generator().manual_seed(seed)
    used = [math.ceil(n_k / page_size) for _, n_k in LENGTHS]
    max_blocks = max(used) + 1
    num_blocks = sum(used) + 2
    if layout == "bnhd":
        k_pages = torch.randn(num_blocks, page_size, H_KV, D, generator=g).transpose(1, 2)
        v_pages = torch.randn(num_blocks, page_size, H_KV, D_V, generator=g).transpose(1, 2)
    else:
        k_pages = torch.randn(num_blocks, H_KV, page_size, D, generator=g)
        v_pages = torch.randn(num_blocks, H_KV, page_size, D_V, generator=g)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.empty(len(LENGTHS), max_blocks, dtype=torch.int32)
    for b, n in enumerate(used):
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
        table[b, n:] = GARBAGE[b % 2]
    lq = torch.tensor([a for a, _ in LENGTHS])
    lk = torch.tensor([b for _, b in LENGTHS])
    zero = torch.zeros(1, dtype=torch.int64)
    cu_q, cu_k = (torch.cat([zero, n.cumsum(0)]).to(torch.int32) for n in (lq, lk))
    q = torch.randn(int(lq.sum()), H_Q, D, generator=g)
    k_pages, v_pages, q = (t.to(device, dtype) for t in (k_pages, v_pages, q))
    return PagedVarlen(
        q, k_pages, v_pages, table.to(device), cu_q.to(device), cu_k.to(device), int(lq.max()), int(lk.max())
    )


def keys_by_hand(pages: Tensor, table: Tensor, b: int, n: int) -> Tensor:
    """``(n, H_kv, .)``: sequence b's keys, position j read at page ``table[b, j // page_size]``, slot
    ``j % page_size`` (differentiable into ``pages``)."""
    page_size = pages.shape[2]
    rows = [pages[int(table[b, j // page_size]), :, j % page_size] for j in range(n)]  # each (H_kv, .)
    if not rows:
        return pages.new_zeros(0, pages.shape[1], pages.shape[3])
    return torch.stack(rows)


def oracle(
    p: PagedVarlen,
    *,
    q: Tensor | None = None,
    k_pages: Tensor | None = None,
    v_pages: Tensor | None = None,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    alibi: Tensor | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(O (total_q, H_q, D_v), lse (H_q, total_q))`` in float64 (pass float64 tensors to differentiate):
    row i of sequence b sits at key position ``i + n_k - n_q`` (bottom-right) and sees key j iff ``j < n_k``,
    causal ``j <= i + off``, the window ``i + off - left <= j <= i + off + right`` (-1: unbounded). Scores
    ``scale * q.k``, then softcap, then ``-slope_h |i + off - j|``; with sinks one more logit ``sink_h`` of
    value zero. A row that sees nothing: O = 0, lse = sink_h (-inf without sinks)."""
    q = p.q.double() if q is None else q
    k_pages = p.k_pages.double() if k_pages is None else k_pages
    v_pages = p.v_pages.double() if v_pages is None else v_pages
    table = p.block_table.cpu()
    G = H_Q // H_KV
    scale = 1.0 / math.sqrt(D)
    O_rows, lse_rows = [], []
    for b, (n_q, n_k) in enumerate(LENGTHS):
        q0 = int(p.cu_q[b])
        kb, vb = (keys_by_hand(pages, table, b, n_k) for pages in (k_pages, v_pages))  # (n_k, H_kv, .)
        off = n_k - n_q
        i = torch.arange(n_q)[:, None] + off  # (n_q, 1): each row's key position
        j = torch.arange(n_k)[None, :]  # (1, n_k)
        seen = torch.ones(n_q, n_k, dtype=torch.bool)
        if causal:
            seen &= j <= i
        left, right = window
        if left >= 0:
            seen &= j >= i - left
        if right >= 0:
            seen &= j <= i + right
        O_b, lse_b = [], []
        for h in range(H_Q):
            qh = q[q0 : q0 + n_q, h]  # (n_q, D)
            S = scale * qh @ kb[:, h // G].T  # (n_q, D) @ (D, n_k) -> (n_q, n_k)
            if softcap is not None:
                S = softcap * torch.tanh(S / softcap)
            if alibi is not None:
                slope = float(alibi[b, h] if alibi.dim() == 2 else alibi[h])
                S = S - slope * (i - j).abs()
            S = S.masked_fill(~seen, -math.inf)
            if sinks is not None:  # the sink: one more column of value zero
                S = torch.cat([S, sinks[h].double().expand(n_q, 1)], dim=1)  # (n_q, n_k + 1)
            lse = torch.logsumexp(S, dim=1)  # (n_q,)
            # a row that sees nothing has lse = -inf and every S_ij = -inf: subtract 0 instead, P = 0, no NaN
            P = torch.exp(S - torch.where(torch.isinf(lse), 0.0, lse)[:, None])  # (n_q, n_k [+ 1])
            O_b.append(P[:, :n_k] @ vb[:, h // G])  # (n_q, n_k) @ (n_k, D_v) -> (n_q, D_v)
            lse_b.append(lse)
        O_rows.append(torch.stack(O_b, dim=1))  # (n_q, H_q, D_v)
        lse_rows.append(torch.stack(lse_b))  # (H_q, n_q)
    return torch.cat(O_rows), torch.cat(lse_rows, dim=1)
