"""The tile updates of one query block: the running statistics after each, computed when iterated.

For query block ``i`` the online softmax folds in one score tile ``S_ij`` per visited key block ``j``
(Dao 2023, FlashAttention-2 Alg. 1 lines 8-10), through :mod:`flashattn_teach.core.online_softmax`, called
exactly as the CPU references call it:

    m_i = max(m_i, rowmax(S_ij)),   l_i = exp(m_old - m_i) l_i + rowsum(exp(S_ij - m_i)),
    acc = exp(m_old - m_i) acc + exp(S_ij - m_i) V_j

:class:`Steps` yields one :class:`TileStep` per update; the replay of a prefill query block
(:mod:`.replay`) and of one split of a decode step (:mod:`.decode_replay`) both iterate it, and every
renderer draws the tile states of :class:`TileState`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from itertools import islice
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from ..core.online_softmax import UpdateTerms, init_state, normalize, update_terms
from ..masks.causal import TileKind
from ..masks.spec import Tiling
from ..reference.scores import score_tile
from .schedule import Done, Schedule

__all__ = ["Step", "StepKind", "Steps", "TileState", "TileStep", "sink_share"]


class StepKind(Enum):
    """What a step of any replay does; its JSON's ``"stepKind"`` (``replay.schema.json``) and every renderer's
    title. The forward and a decode split run UPDATEs; a decode step then MERGEs; the backward runs
    PREPROCESS once, then its DKDV and DQ passes (FA2 Alg. 2)."""

    UPDATE = "update"  # one tile folded into m_i, l_i, acc (FA2 Alg. 1 lines 8-10): TileStep
    MERGE = "merge"  # two partials (O, lse) combined (Flash-Decoding): decode_merges.MergeStep
    PREPROCESS = "preprocess"  # delta = rowsum(dO * O) (FA2 Alg. 2 line 4)
    DKDV = "dkdv"  # outer loop over key blocks j: dK_j, dV_j on chip: backward_replay.BackwardStep
    DQ = "dq"  # outer loop over query blocks i: dQ_i on chip: backward_replay.BackwardStep

    @property
    def title(self) -> str:
        """The heading every renderer gives a step of this kind."""
        return STEP_TITLES[self]


class Step(Protocol):
    """What a step of any scenario carries: its kind and its index within its pass or split (each kind's record,
    TileStep, MergeStep, BackwardStep, adds its terms and, but for a merge, its tile). A replay's
    ``all_steps()`` yields them in the order they run."""

    @property
    def step_kind(self) -> StepKind: ...

    @property
    def index(self) -> int: ...


STEP_TITLES = {
    StepKind.UPDATE: "tile update",
    StepKind.MERGE: "merge",
    StepKind.PREPROCESS: "preprocess",
    StepKind.DKDV: "dK/dV pass",
    StepKind.DQ: "dQ pass",
}


class TileState(Enum):
    """A tile of the ``(T_r, T_c)`` grid at one step of a replay; every renderer draws these."""

    CURRENT = "current"  # folded in at this step
    ACCUMULATED = "accumulated"  # an earlier tile of the replayed query block
    DONE = "done"  # a tile of another query block, computed earlier in the schedule
    SKIPPED = "skipped"  # a SKIP tile (causal, window, seqlens_k or attn_mask): never computed
    PENDING = "pending"  # computed later


@dataclass(frozen=True)
class TileStep:
    """The state of query block ``i`` after folding in the tile of key block ``j``.

    ``rows = (r0, r1)`` and ``cols = (c0, c1)`` are half-open; ``completed_columns`` is ``c0``, the first
    column of this tile (with a window, the columns before it need not all have been visited). ``kind`` is
    the tile's :class:`~flashattn_teach.masks.causal.TileKind` under the mask contract, FULL or PARTIAL.
    ``S_ij (Br, Bc)`` is scaled, capped and biased, ``-inf`` where masked; ``m_i, l_i (Br,)`` are the values
    after the update; ``O_partial = acc / l_i`` and ``O_final`` (dense attention) are ``(Br, D_v)``;
    ``max_diff = max |O_partial - O_final|``. ``position`` is this update's index in the whole schedule of
    the chosen loop order and ``done`` the tiles (of every query block) computed before it. With an attention
    sink, ``sink_share (Br,)`` is the sink's weight in each row so far, ``exp(sink_h - m_i) / l_i`` (the state
    started at ``m_i = sink_h, l_i = 1``): the keys seen so far hold ``1 - sink_share``, and after the last
    update it is ``exp(sink_h - lse_i)``.

    For the equations with their numbers (:mod:`.equations`), ``m_old, l_old (Br,)`` and ``acc_old (Br, D_v)``
    are the state the update started from (key-major: ``acc`` as read back from HBM) and ``terms`` every term
    of the update (:class:`~flashattn_teach.core.online_softmax.UpdateTerms`, ``terms.m_new`` is ``m_i``): all
    ``O(Br (Bc + D_v))``, one tile's worth. ``last`` is True at the block's last update. ``softcap`` and
    ``biased`` say what ``S_ij`` holds besides ``scale Q_i K_j^T`` (the cap, an ALiBi or additive-mask term).
    """

    index: int
    i: int
    j: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    completed_columns: int
    kind: TileKind
    S_ij: Tensor
    m_i: Tensor
    l_i: Tensor
    O_partial: Tensor
    O_final: Tensor
    max_diff: float
    position: int
    done: Done
    m_old: Tensor
    l_old: Tensor
    acc_old: Tensor
    terms: UpdateTerms
    last: bool
    sink_share: Tensor | None = None
    softcap: float | None = None  # S_ij was capped: softcap * tanh(scale Q_i K_j^T / softcap)
    biased: bool = False  # S_ij holds an additive term (ALiBi or an additive attn_mask)
    step_kind: ClassVar[StepKind] = StepKind.UPDATE

    @property
    def masked(self) -> bool:
        """The tile is PARTIAL and ran with its own mask."""
        return self.kind is TileKind.PARTIAL

    @property
    def skipped(self) -> bool:
        """Always False: a skipped tile is never visited, so it is never a step (see ``Replay.skipped``)."""
        return self.kind is TileKind.SKIP


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

    def __len__(self) -> int:
        return len(self.schedule.key_blocks(self.i))

    def __getitem__(self, n: int) -> TileStep:
        if n < 0:
            n += len(self)
        if not 0 <= n < len(self):
            raise IndexError(f"step index out of range [0, {len(self)})")
        return next(islice(self, n, None))

    def __iter__(self) -> Iterator[TileStep]:
        r0, r1 = self.rows
        b, device, softcap = self.batch_index, self.q_i.device, self.tiling.spec.softcap
        # With a sink, every row starts as if it had seen one key of score sink_h and value 0.
        m_i, l_i, acc = init_state((r1 - r0,), self.v.shape[-1], dtype=self.q_i.dtype, device=device, sink=self.sink)
        # The inner loop of query_major_forward: the key blocks the tiling visits, SKIP tiles left out.
        key_blocks = self.schedule.key_blocks(self.i)
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
            yield TileStep(
                index=n,
                i=self.i,
                j=j,
                rows=(r0, r1),
                cols=(c0, c1),
                completed_columns=c0,
                kind=self.tiling.kind(self.i, j, b=b, h=0),
                S_ij=S_ij,
                m_i=m_i,
                l_i=l_i,
                O_partial=O_partial,
                O_final=self.O_final,
                max_diff=float((O_partial - self.O_final).abs().max()),
                position=position,
                done=self.schedule.before(position),
                m_old=m_old,
                l_old=l_old,
                acc_old=acc_old,
                terms=terms,
                last=n == len(key_blocks) - 1,
                sink_share=None if self.sink is None else sink_share(self.sink, m_i, l_i),
                softcap=softcap,
                biased=bias is not None,
            )


def sink_share(sink: Tensor, m_i: Tensor, l_i: Tensor) -> Tensor:
    """``(Br,)``: the sink's weight among the sink and the keys folded in so far, ``exp(sink_h - m_i) / l_i``
    (``l_i`` is relative to ``m_i``, so ``exp(sink_h - m_i)`` is the sink's term of it). ``m_i >= sink_h`` from
    the first update on, so the exponent is ``<= 0``; ``l_i >= 1``: no division by zero."""
    return torch.exp(sink - m_i) / l_i
