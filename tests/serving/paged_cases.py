"""flash-attn's KV-cache test grid with paged caches, as data and one runner any backend can take.

A case is one decode step: a pool of pages (head-major, or flash-attn's ``(num_blocks, page_size, H_kv,
D)`` passed as its ``.transpose(1, 2)`` view), a shuffled block table whose entries past each sequence's
pages hold garbage (-1 or an id past the pool), ragged lengths (one of them 0), new keys or none, and the
variants (causal, window, ALiBi, softcap, cache_leftpad, sinks). :func:`run_case` runs it on a backend and
checks three things, each against something built here independently of the code under test:

- the pool after the step equals the pool before with ``k, v`` written slot by slot by a Python loop over
  the block table (so the written slots hold ``k, v`` and every other slot, every untouched page, is
  bitwise unchanged);
- ``O`` and ``lse`` equal the float64 oracle: each sequence's keys gathered position by position from that
  expected pool, then dense softmax attention with the masks, the padding and the sink written out;
- nothing else is needed from the library: the oracle shares no code with the mask contract, the pages
  module, the tiled paths or the merge.

``CASES`` samples the grid (every factor several times, not the full product); the lead adds Triton rows
(``run_case(case, "triton")`` under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

import flashattn_teach as fa

NEG_INF = float("-inf")
PAGE_SIZES = [1, 3, 7, 16, 256]
VARIANTS = ["plain", "causal", "window", "alibi", "softcap", "leftpad", "sinks", "all"]
HEADS = [(4, 2), (4, 1), (2, 2)]  # (H_q, H_kv): GQA, MQA, one query head per key/value head
STEPS = [(1, 1), (3, 3), (1, 0), (2, 0)]  # (N_new, N_new_kv): decode, chunked prefill, no new keys
SPLITS = [0, 1, 3]


@dataclass(frozen=True)
class PagedCase:
    """One decode step of the grid."""

    page_size: int
    variant: str
    H_q: int
    H_kv: int
    N_new: int
    N_new_kv: int
    num_splits: int
    flash_attn_layout: bool  # the pool is flash-attn's (num_blocks, page_size, H_kv, D), passed transposed
    D: int = 8
    D_v: int = 6

    @property
    def lengths(self) -> list[int]:
        """``cache_seqlens``: ragged, one empty, several pages long and ending mid-page for every size."""
        ps = self.page_size
        return [ps + 13, 0, 2 * ps + 5] if ps >= 16 else [13, 0, 29]

    @property
    def id(self) -> str:
        layout = "fa" if self.flash_attn_layout else "hm"
        return (
            f"page{self.page_size}-{self.variant}-H{self.H_q}x{self.H_kv}-new{self.N_new}x{self.N_new_kv}"
            f"-splits{self.num_splits}-{layout}"
        )


def _cases() -> list[PagedCase]:
    """Every (page size, variant) pair once; the other factors rotate so that each variant meets every
    step kind, head layout, split count and pool layout across the page sizes."""
    cases = []
    for (p, page_size), (v, variant) in itertools.product(enumerate(PAGE_SIZES), enumerate(VARIANTS)):
        H_q, H_kv = HEADS[(v + 2 * p) % len(HEADS)]
        N_new, N_new_kv = STEPS[(v + p) % len(STEPS)]
        cases.append(
            PagedCase(
                page_size=page_size,
                variant=variant,
                H_q=H_q,
                H_kv=H_kv,
                N_new=N_new,
                N_new_kv=N_new_kv,
                num_splits=SPLITS[(v + 4 * p) % len(SPLITS)],
                flash_attn_layout=(v + p) % 2 == 1,
            )
        )
    return cases


CASES = _cases()


def _randn(*shape, seed, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@dataclass
class Problem:
    """A case's tensors: pools, table, queries, new entries and the options of the call."""

    q: torch.Tensor
    k_pool: torch.Tensor  # (num_blocks, H_kv, page_size, D), a view when flash_attn_layout
    v_pool: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    block_table: torch.Tensor
    options: dict


def make_problem(case: PagedCase, *, dtype=torch.float64, seed=0) -> Problem:
    B, ps = len(case.lengths), case.page_size
    L = [n + case.N_new_kv for n in case.lengths]
    max_blocks = -(-max(L) // ps) + 1  # one entry more than the longest sequence uses
    num_blocks = B * max_blocks + 3  # pages no sequence is given: they must stay untouched
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_blocks, generator=g)[: B * max_blocks].reshape(B, max_blocks).to(torch.int32)
    for b, n in enumerate(L):
        used = -(-n // ps)
        table[b, used:] = -1 if b % 2 else 10**6  # garbage past the sequence's pages: never read
    if case.flash_attn_layout:  # flash-attn's pools, (num_blocks, page_size, H_kv, D), seen head-major
        k_pool = _randn(num_blocks, ps, case.H_kv, case.D, seed=seed + 1, dtype=dtype).transpose(1, 2)
        v_pool = _randn(num_blocks, ps, case.H_kv, case.D_v, seed=seed + 2, dtype=dtype).transpose(1, 2)
    else:
        k_pool = _randn(num_blocks, case.H_kv, ps, case.D, seed=seed + 1, dtype=dtype)
        v_pool = _randn(num_blocks, case.H_kv, ps, case.D_v, seed=seed + 2, dtype=dtype)
    q = _randn(B, case.H_q, case.N_new, case.D, seed=seed + 3, dtype=dtype)
    k = v = None
    if case.N_new_kv:
        k = _randn(B, case.H_kv, case.N_new_kv, case.D, seed=seed + 4, dtype=dtype)
        v = _randn(B, case.H_kv, case.N_new_kv, case.D_v, seed=seed + 5, dtype=dtype)
    options: dict = {"num_splits": case.num_splits}
    variant = case.variant
    if variant in ("causal", "window", "all") or case.N_new > 1:
        options["causal"] = True
    if variant in ("window", "all"):
        options["window"] = (4, 0) if variant == "window" else (5, 0)
    if variant == "alibi":
        options["alibi_slopes"] = torch.rand(case.H_q, generator=g, dtype=torch.float64).to(dtype)
    if variant == "all":
        options["alibi_slopes"] = torch.rand(B, case.H_q, generator=g, dtype=torch.float64).to(dtype)
    if variant in ("softcap", "all"):
        options["softcap"], options["scale"] = 1.5, 0.9
    if variant in ("leftpad", "all"):
        options["cache_leftpad"] = torch.tensor([min(n, 5) for n in case.lengths[:-1]] + [case.lengths[-1] // 2])
        options["cache_leftpad"] = options["cache_leftpad"].to(torch.int32)
    if variant in ("sinks", "all"):
        options["sinks"] = _randn(case.H_q, seed=seed + 6, dtype=dtype)
    return Problem(q, k_pool, v_pool, k, v, table, options)


def expected_pools(p: Problem, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools as the step must leave them: copies with ``k, v`` put in slot by slot."""
    k_pool, v_pool = p.k_pool.clone(), p.v_pool.clone()
    if p.k is None:
        return k_pool, v_pool
    ps = k_pool.shape[2]
    for b, n in enumerate(lengths):
        for t in range(p.k.shape[2]):
            page = int(p.block_table[b, (n + t) // ps])
            k_pool[page, :, (n + t) % ps] = p.k[b, :, t]
            v_pool[page, :, (n + t) % ps] = p.v[b, :, t]
    return k_pool, v_pool


def gather(pool: torch.Tensor, row: torch.Tensor, L: int) -> torch.Tensor:
    """``(H_kv, L, D)``: positions ``[0, L)`` of one sequence, read from the pool position by position."""
    ps = pool.shape[2]
    if L == 0:
        return pool.new_zeros(pool.shape[1], 0, pool.shape[3])
    return torch.stack([pool[int(row[j // ps]), :, j % ps] for j in range(L)], dim=1)


def oracle(p: Problem, k_pool: torch.Tensor, v_pool: torch.Tensor, lengths: list[int]):
    """``(O (B, H_q, N_new, D_v), lse (B, H_q, N_new))`` in float64, from the definition."""
    o = p.options
    B, H_q, N_new, D = p.q.shape
    N_new_kv = 0 if p.k is None else p.k.shape[2]
    G = H_q // k_pool.shape[1]
    scale = o.get("scale", 1 / math.sqrt(D))
    outs, lses = [], []
    for b in range(B):
        L = lengths[b] + N_new_kv
        k = gather(k_pool, p.block_table[b], L).double().repeat_interleave(G, dim=0)  # (H_q, L, D)
        v = gather(v_pool, p.block_table[b], L).double().repeat_interleave(G, dim=0)  # (H_q, L, D_v)
        S = scale * p.q[b].double() @ k.transpose(1, 2)  # (H_q, N_new, D) @ (H_q, D, L) -> (H_q, N_new, L)
        if o.get("softcap") is not None:
            S = o["softcap"] * torch.tanh(S / o["softcap"])
        pos = (L - N_new + torch.arange(N_new))[:, None]  # (N_new, 1)
        j = torch.arange(L)[None, :]  # (1, L)
        slopes = o.get("alibi_slopes")
        if slopes is not None:
            per_head = slopes if slopes.dim() == 1 else slopes[b]
            S = S - per_head.double()[:, None, None] * (pos - j).abs()
        visible = torch.ones(N_new, L, dtype=torch.bool)
        if "cache_leftpad" in o:
            visible &= j >= int(o["cache_leftpad"][b])
        left, right = o.get("window", (-1, -1))
        if o.get("causal"):
            right = 0
        if left >= 0:
            visible &= j >= pos - left
        if right >= 0:
            visible &= j <= pos + right
        S = S.masked_fill(~visible, NEG_INF)
        if o.get("sinks") is not None:  # one more entry per row, score sink_h, value 0
            S = torch.cat([S, o["sinks"].double()[:, None, None].expand(H_q, N_new, 1)], dim=-1)
            v = torch.cat([v, v.new_zeros(H_q, 1, v.shape[2])], dim=1)
        lse = torch.logsumexp(S, dim=-1)  # (H_q, N_new)
        P = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(S - lse[..., None]))
        outs.append(P @ v)  # (H_q, N_new, L') @ (H_q, L', D_v) -> (H_q, N_new, D_v)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def call(p: Problem, backend: str, **extra):
    return fa.flash_attention_with_kvcache(
        p.q,
        p.k_pool,
        p.v_pool,
        p.k,
        p.v,
        cache_seqlens=torch.tensor(extra.pop("lengths"), dtype=torch.int32),
        block_table=p.block_table,
        backend=backend,
        return_lse=True,
        **p.options,
        **extra,
    )


def run_case(case: PagedCase, backend: str, *, dtype=torch.float64, atol=1e-12) -> None:
    """Run one case on ``backend`` and check the pools and ``(O, lse)`` (the module docs)."""
    p = make_problem(case, dtype=dtype)
    k_want, v_want = expected_pools(p, case.lengths)
    O, lse = call(p, backend, lengths=case.lengths)
    assert torch.equal(p.k_pool, k_want) and torch.equal(p.v_pool, v_want), "the pools differ from the expected write"
    O_ref, lse_ref = oracle(p, k_want, v_want, case.lengths)
    torch.testing.assert_close(O.double(), O_ref, atol=atol, rtol=atol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    finite = ~torch.isneginf(lse_ref)
    torch.testing.assert_close(lse.double()[finite], lse_ref[finite], atol=atol, rtol=atol)
