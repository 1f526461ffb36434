"""The tile updates of one query block: the running statistics after each, computed when iterated.

For query block ``i`` the online softmax folds in one score tile ``S_ij`` per visited key block ``j``
(Dao 2023, FlashAttention-2 Alg. 1 lines 8-10), through :mod:`flashattn_teach.core.online_softmax`, called
exactly as the CPU references call it:

    m_i = max(m_i, rowmax(S_ij)),   l_i = exp(m_old - m_i) l_i + rowsum(exp(S_ij - m_i)),
    acc = exp(m_old - m_i) acc + exp(S_ij - m_i) V_j

:class:`Steps` is the forward's scenario builder: it yields one UPDATE :class:`~.step.Step` per visited tile,
with the update's terms by name and, per query row, its equations (:class:`.equations.RowEquations`). The replay
of a prefill query block (:mod:`.replay`) and of one split of a decode step (:mod:`.decode_replay`) both iterate
it. With ``kernel_terms`` (``source="triton"``) each step also carries the kernel's numbers for its tile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from itertools import islice

import torch
from torch import Tensor

from ..core.online_softmax import UpdateTerms, init_state, normalize, update_terms
from ..masks.spec import Tiling
from ..reference.scores import score_tile
from .equations import RowEquations, row_equations
from .equations_key_major import key_major_row_equations
from .schedule import Schedule, visited_key_blocks
from .step import Step, StepKind

__all__ = ["Steps", "sink_share", "update_terms_by_name"]


@dataclass(frozen=True)
class Steps:
    """The tile updates of one query block, computed afresh each time they are iterated: ``len``,
    iteration, and ``[n]`` (which runs the first ``n + 1`` updates)."""

    q_i: Tensor  # (Br, D), the replayed rows
    k: Tensor  # (N_k, D)
    v: Tensor  # (N_k, D_v)
    O_final: Tensor  # (Br, D_v)
    i: int
    rows: tuple[int, int]
    tiling: Tiling
    batch_index: int
    scale: float
    schedule: Schedule
    sink: Tensor | None = None  # (1,): the replayed head's sink_h, in q_i's dtype
    # source="triton": a step's kernel terms from the kernel's trace (.kernel_trace.KernelTrace.terms)
    kernel_terms: Callable[[Step], Mapping[str, Tensor]] | None = None

    @classmethod
    def of_block(
        cls,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        tiling: Tiling,
        i: int,
        O_final: Tensor,
        *,
        scale: float,
        order: str = "query_major",
        batch_index: int = 0,
        sink: Tensor | None = None,
    ) -> Steps:
        """The updates of query block ``i`` of ``q (N_q, D)`` over ``k (N_k, D), v (N_k, D_v)``, in ``order``'s
        schedule of every tile ``tiling`` visits for batch element ``batch_index``: the forward replay's block,
        or a decode split's (its ``N_new`` rows one block)."""
        schedule = Schedule(visited_key_blocks(tiling, b=batch_index), len(tiling.col_blocks), order=order)
        r0, r1 = tiling.row_blocks[i]
        return cls(q[r0:r1], k, v, O_final, i, (r0, r1), tiling, batch_index, scale, schedule, sink)

    def __len__(self) -> int:
        return len(self.schedule.key_blocks(self.i))

    def __getitem__(self, n: int) -> Step:
        if n < 0:
            n += len(self)
        if not 0 <= n < len(self):
            raise IndexError(f"step index out of range [0, {len(self)})")
        return next(islice(self, n, None))

    def __iter__(self) -> Iterator[Step]:
        r0, r1 = self.rows
        b, device, softcap = self.batch_index, self.q_i.device, self.tiling.spec.softcap
        # With a sink, every row starts as if it had seen one key of score sink_h and value 0.
        m_i, l_i, acc = init_state((r1 - r0,), self.v.shape[-1], dtype=self.q_i.dtype, device=device, sink=self.sink)
        # The inner loop of query_major_forward: the key blocks the tiling visits, SKIP tiles left out.
        key_blocks = self.schedule.key_blocks(self.i)
        row = key_major_row_equations if self.schedule.order == "key_major" else row_equations  # FA1's or FA2's
        for n, j in enumerate(key_blocks):
            c0, c1 = self.tiling.col_blocks[j]
            if self.schedule.order == "key_major":  # read back from HBM (Alg. 1 line 8): acc = O_i * l_i
                acc = normalize(l_i, acc) * l_i.unsqueeze(-1)
            allowed, bias = self.tiling.head_tile(self.i, j, (r0, r1), b=b, h=0, device=device)  # (Br, Bc) or None
            mod = self.tiling.score_mod(self.i, j, device, (r0, r1), b=b, h=0)  # FlexAttention's score_mod, or None
            S_ij = score_tile(self.q_i, self.k[c0:c1], self.scale, allowed, softcap=softcap, bias=bias, score_mod=mod)
            m_old, l_old, acc_old = m_i, l_i, acc
            terms = update_terms(m_i, l_i, acc, S_ij, self.v[c0:c1])  # S_ij: (Br, D) @ (D, Bc) -> (Br, Bc)
            m_i, l_i, acc = terms.m_new, terms.l_new, terms.acc_new
            O_partial = normalize(l_i, acc)  # (Br, D_v)
            position = self.schedule.index((self.i, j))
            named = {
                "S_ij": S_ij,
                "m_i": m_i,
                "l_i": l_i,
                "O_partial": O_partial,
                "O_final": self.O_final,
                "m_old": m_old,
                "l_old": l_old,
                "acc_old": acc_old,  # key-major: as read back from HBM
                "V_j": self.v[c0:c1],  # (Bc, D_v)
                **update_terms_by_name(terms),
            }
            if self.sink is not None:
                named["sink_share"] = sink_share(self.sink, m_i, l_i)
            step = Step(
                step_kind=StepKind.UPDATE,
                index=n,
                terms=named,
                i=self.i,
                j=j,
                rows=(r0, r1),
                cols=(c0, c1),
                kind=self.tiling.kind(self.i, j, b=b, h=0),
                max_diff=float((O_partial - self.O_final).abs().max()),
                position=position,
                done=self.schedule.before(position),
                completed_columns=c0,
                last=n == len(key_blocks) - 1,
                softcap=softcap,
                biased=bias is not None,
            )
            step = replace(step, equations=RowEquations(step, row))
            yield step if self.kernel_terms is None else replace(step, kernel=self.kernel_terms(step))


def update_terms_by_name(terms: UpdateTerms) -> dict[str, Tensor]:
    """The core's update terms (FA2 Alg. 1 lines 9-10) by their field names: ``rowmax, m_new, alpha, P_ij,
    rowsum, l_new, PV, acc_new``."""
    return {f.name: getattr(terms, f.name) for f in fields(terms)}


def sink_share(sink: Tensor, m_i: Tensor, l_i: Tensor) -> Tensor:
    """``(Br,)``: the sink's weight among the sink and the keys folded in so far, ``exp(sink_h - m_i) / l_i``
    (``l_i`` is relative to ``m_i``, so ``exp(sink_h - m_i)`` is the sink's term of it). ``m_i >= sink_h`` from
    the first update on, so the exponent is ``<= 0``; ``l_i >= 1``: no division by zero."""
    return torch.exp(sink - m_i) / l_i
