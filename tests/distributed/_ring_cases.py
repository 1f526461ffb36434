"""What each spawned rank runs in the ring attention tests: many cases per process group, each compared
in-rank with the float64 dense oracle on the full sequence built from the same seed."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import flashattn_teach as fa
from flashattn_teach.distributed import RingStats, RingTimeoutError, ring_attention, shard, visited_tiles


@dataclass(frozen=True)
class Case:
    layout: str
    causal: bool
    dtype: torch.dtype = torch.float64
    B: int = 1
    H_q: int = 2
    H_kv: int = 2
    N: int = 24
    D: int = 8
    D_v: int = 8
    return_lse: bool = False
    block: tuple[int, int] | None = None  # (BLOCK_M, BLOCK_N) of the online reference
    backend: str = "auto"
    seed: int = 0


@dataclass(frozen=True)
class Errors:
    """Max errors of one case against the oracle, relative to the oracle's largest magnitude."""

    case: Case
    O: float
    lse: float
    dq: float
    dk: float
    dv: float
    unmerged: float  # the negative control: the rank's own block alone, without the ring
    tiles: int  # tiles of 4 x 4 the ring's forward ran on this rank (RingStats)
    planned_tiles: int  # the same from the layout's schedule


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1.0))


def run_case(rank: int, world_size: int, case: Case, group: dist.ProcessGroup | None = None) -> Errors:
    gen = torch.Generator().manual_seed(case.seed)
    q, k, v, g = (
        torch.randn(case.B, H, case.N, d, generator=gen, dtype=torch.float64)
        for H, d in ((case.H_q, case.D), (case.H_kv, case.D), (case.H_kv, case.D_v), (case.H_q, case.D_v))
    )
    h = torch.randn(case.B, case.H_q, case.N, generator=gen, dtype=torch.float64)  # dL/dlse

    # the oracle: the whole sequence on this rank, dense, float64, ordinary autograd
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    O_ref, lse_ref = fa.dense_attention(qf, kf, vf, causal=case.causal, enable_gqa=True, return_lse=True)
    loss = (O_ref * g).sum() + ((lse_ref * h).sum() if case.return_lse else 0.0)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(loss, (qf, kf, vf))

    def mine(t: torch.Tensor, dim: int = -2) -> torch.Tensor:
        return shard(t, world_size, rank, case.layout, dim=dim)

    qs, ks, vs = (mine(t).to(case.dtype).requires_grad_() for t in (q, k, v))
    stats = RingStats()
    out = ring_attention(
        qs,
        ks,
        vs,
        group=group,
        causal=case.causal,
        layout=case.layout,
        return_lse=True,
        backend=case.backend,
        block_m=None if case.block is None else case.block[0],
        block_n=None if case.block is None else case.block[1],
        timeout=60.0,
        stats=stats,
    )
    O, lse = out
    local_loss = (O * mine(g).to(O.dtype)).sum()
    if case.return_lse:
        local_loss = local_loss + (lse * mine(h, dim=-1).to(lse.dtype)).sum()
    local_loss.backward()

    alone = fa.flash_attention(qs.detach(), ks.detach(), vs.detach(), causal=case.causal)
    return Errors(
        case,
        O=_rel(O, mine(O_ref)),
        lse=_rel(lse, mine(lse_ref, dim=-1)),
        dq=_rel(qs.grad, mine(dq_ref)),
        dk=_rel(ks.grad, mine(dk_ref)),
        dv=_rel(vs.grad, mine(dv_ref)),
        unmerged=_rel(alone, mine(O_ref)),
        tiles=stats.tiles(4, 4),
        planned_tiles=visited_tiles(case.N, world_size, case.layout, case.causal, 4, 4)[dist.get_rank(group)],
    )


def run_cases(rank: int, world_size: int, cases: list[Case]) -> list[Errors]:
    return [run_case(rank, world_size, c) for c in cases]


def run_world_and_subgroups(
    rank: int, world_size: int, cases: list[Case], subgroup_cases: list[Case]
) -> tuple[list[Errors], list[Errors]]:
    """``cases`` on the whole world, then ``subgroup_cases`` on two rings at once, of ranks {0, 2, ...}
    and {1, 3, ...} (non-adjacent global ranks)."""
    groups = [dist.new_group(list(range(parity, world_size, 2))) for parity in (0, 1)]  # all ranks create all
    mine = groups[rank % 2]
    sub_world = dist.get_world_size(mine)
    return run_cases(rank, world_size, cases), [
        run_case(dist.get_rank(mine), sub_world, c, mine) for c in subgroup_cases
    ]


def bad_calls(rank: int, world_size: int) -> list[Exception]:
    """The errors of the bad calls, in order: rank 1 passes a different N_local (every rank must raise,
    naming both shapes), then a different ``causal``, then every rank an odd N_local to the zigzag layout,
    then scales that differ as a tensor, a numpy float and a tensor against a float."""
    errors = []
    calls: list[tuple[int, str, bool, object]] = [
        (8 if rank == 0 else 6, "contiguous", False, None),
        (8, "contiguous", rank == 0, None),
        (5, "zigzag", False, None),
        (8, "contiguous", False, torch.tensor(0.5 if rank == 0 else 0.25)),
        (8, "contiguous", False, np.float32(0.5 if rank == 0 else 0.25)),
        (8, "contiguous", False, torch.tensor(0.5) if rank == 0 else 0.25),
    ]
    for n, layout, causal, scale in calls:
        q = torch.randn(1, 2, n, 4, dtype=torch.float64)
        try:
            ring_attention(q, q, q, layout=layout, causal=causal, scale=scale, timeout=30.0)
        except Exception as e:
            errors.append(e)
    return errors


def absent_rank(rank: int, world_size: int, timeout: float, dies: bool) -> tuple[str, float]:
    """Rank 1 dies (``dies``) or stays away longer than ``timeout``; rank 0 returns the message of the
    error it raised and how long it took."""
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    if rank == 1:
        if dies:
            os._exit(1)
        time.sleep(timeout + 1.0)
        return "", 0.0
    start = time.monotonic()
    try:
        ring_attention(q, q, q, timeout=timeout)
    except RingTimeoutError as e:
        return str(e), time.monotonic() - start
    raise AssertionError("ring_attention returned without the other rank")
