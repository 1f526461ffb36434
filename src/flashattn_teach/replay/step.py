"""One step of any replay: what it does, where, its named terms and its equations with their numbers.

Three scenario builders yield these steps (:mod:`.steps` the forward's and a decode split's tile updates,
:mod:`.decode_merges` a decode step's merges, :mod:`.backward_replay` the backward's preprocess and passes), and
every renderer (table, JSON, page, picture) reads them, dispatching on :class:`StepKind` where the content
differs. A step's terms are named as the papers name them (Dao 2023, FlashAttention-2 Alg. 1 and 2;
Flash-Decoding's merge) and read as ``step["m_i"]``:

    UPDATE      S_ij, m_i, l_i, O_partial (= acc / l_i), O_final, m_old, l_old, acc_old, V_j, and the core's
                update terms rowmax, m_new, alpha, P_ij, rowsum, l_new, PV, acc_new
                (:class:`~flashattn_teach.core.online_softmax.UpdateTerms`); sink_share with a sink
    MERGE       lse_a, lse_b, lse, w_a, w_b, O
    PREPROCESS  delta (and dsink with a sink)
    DKDV        S_ij, P_ij, dP_ij, dS_ij, and the accumulators after it, dV_j and dK_j
    DQ          S_ij, P_ij, dP_ij, dS_ij, and the accumulator after it, dQ_i

A forward replay with ``source="triton"`` also gives each UPDATE ``step.kernel``, the tutorial kernel's own
``S_ij, m_i, l_i, alpha, acc_new`` for the same tile (:mod:`.kernel_trace`), and ``step.kernel_diff``; a backward
replay's DKDV and DQ steps the production backward kernels' (:mod:`.kernel_trace_backward`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from ..masks.causal import TileKind

__all__ = ["ACCUMULATORS", "Step", "StepEquation", "StepKind", "TileState", "numbers"]


class StepKind(Enum):
    """What a step does; its JSON's ``"stepKind"`` (``replay.schema.json``) and every renderer's title. The
    forward and a decode split run UPDATEs; a decode step then MERGEs; the backward runs PREPROCESS once, then
    its DKDV and DQ passes (FA2 Alg. 2)."""

    UPDATE = "update"  # one tile folded into m_i, l_i, acc (FA2 Alg. 1 lines 8-10)
    MERGE = "merge"  # two partials (O, lse) combined (Flash-Decoding)
    PREPROCESS = "preprocess"  # delta = rowsum(dO * O) (FA2 Alg. 2 line 4)
    DKDV = "dkdv"  # outer loop over key blocks j: dK_j, dV_j on chip
    DQ = "dq"  # outer loop over query blocks i: dQ_i on chip

    @property
    def title(self) -> str:
        """The heading every renderer gives a step of this kind."""
        return STEP_TITLES[self]


STEP_TITLES = {
    StepKind.UPDATE: "tile update",
    StepKind.MERGE: "merge",
    StepKind.PREPROCESS: "preprocess",
    StepKind.DKDV: "dK/dV pass",
    StepKind.DQ: "dQ pass",
}

# The terms a backward step accumulates on chip, by kind, in the order the renderers list them.
ACCUMULATORS = {StepKind.DKDV: ("dV_j", "dK_j"), StepKind.DQ: ("dQ_i",)}


class TileState(Enum):
    """A tile of the ``(T_r, T_c)`` grid at one step of a replay; every renderer draws these."""

    CURRENT = "current"  # folded in at this step
    ACCUMULATED = "accumulated"  # an earlier tile of the replayed query block
    DONE = "done"  # a tile of another query block, computed earlier in the schedule
    SKIPPED = "skipped"  # a SKIP tile (causal, window, seqlens_k or attn_mask): never computed
    PENDING = "pending"  # computed later


def numbers(t: Tensor | float) -> str:
    """A scalar, vector or matrix written out to 4 significant digits, ``-inf`` as such and ``-0`` as ``0``."""
    if isinstance(t, float) or t.dim() == 0:
        x = float(t) + 0.0  # -0.0 + 0.0 = 0.0: a zero gradient reads as 0, whatever its sign bit
        return "-inf" if x == float("-inf") else f"{x:.4g}"
    return "[" + ", ".join(numbers(x) for x in t) + "]"


@dataclass(frozen=True)
class StepEquation:
    """One equation of a step: ``name = symbolic = substituted`` (the numbers put in, then the result)."""

    line: int | None  # of the algorithm (FA2 Alg. 2); None for what the paper has no line for (the sink)
    name: str
    symbolic: str
    substituted: str
    value: Tensor  # the result: scalar, (Br,), (Br, Bc), (Bc, D) or (Br, D)

    def with_result(self) -> StepEquation:
        """This equation with its result appended to the substituted text: ``... = value``."""
        text = f"{self.substituted} = {numbers(self.value)}"
        return StepEquation(self.line, self.name, self.symbolic, text, self.value)


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no truth value; a step is itself, hashable by identity
class Step:
    """One step of a replay: its kind, its index within its pass, split or merges, its tile, its named terms
    (module docstring; ``step["m_i"]``) and its equations with their numbers.

    ``rows = (r0, r1)`` and ``cols = (c0, c1)`` are half-open and ``kind`` is the tile's
    :class:`~flashattn_teach.masks.causal.TileKind` (FULL or PARTIAL: SKIP tiles are never steps); a MERGE and the
    PREPROCESS have no tile (``i = j = -1``, ``kind`` None). ``equations``: an UPDATE's are one tuple of
    FA2 Alg. 1's lines per query row (:class:`.equations.RowEquations`), the others' a sequence of
    :class:`StepEquation`. ``max_diff`` is ``max |O - O_final|`` after an UPDATE or a MERGE.

    An UPDATE also records ``position``, its index in the whole schedule of its loop order, ``done``, the tiles
    (of every query block) computed before it, ``completed_columns`` (``c0``), ``last`` (the block's last
    update), and ``softcap``/``biased`` (what ``S_ij`` holds besides ``scale Q_i K_j^T``: the cap, an ALiBi or
    additive-mask term). A MERGE records ``merged``, the splits merged so far, and ``split``, the one merged in
    (None: the attention sink).
    """

    step_kind: StepKind
    index: int
    terms: Mapping[str, Tensor]
    equations: Sequence[Any] = ()
    i: int = -1
    j: int = -1
    rows: tuple[int, int] = (0, 0)
    cols: tuple[int, int] = (0, 0)
    kind: TileKind | None = None
    max_diff: float = 0.0
    position: int = -1
    done: Any = field(default=None, repr=False)  # schedule.Done: the tiles computed before this update
    completed_columns: int = 0
    last: bool = False
    softcap: float | None = None
    biased: bool = False
    merged: tuple[int, ...] = ()
    split: int | None = None
    kernel: Mapping[str, Tensor] = field(default_factory=dict)  # a traced kernel's terms (.kernel_trace), base e

    @property
    def kernel_diff(self) -> dict[str, float]:
        """Per term the kernel traced, ``max |kernel - reference|`` over the tile (equal infinities count 0, a
        -inf against a finite value inf); empty for a step of the reference alone."""
        diffs = {}
        for name, mine in self.kernel.items():
            ref = self.terms[name].to(mine)
            d = torch.where(mine == ref, 0.0, (mine - ref).abs())  # (Br,), (Br, Bc) or (Br, D_v)
            diffs[name] = float(torch.nan_to_num(d, nan=math.inf).max()) if d.numel() else 0.0
        return diffs

    def __getitem__(self, name: str) -> Tensor:
        """The term ``name`` (``step["m_i"]``), or a named error listing the terms this step has."""
        try:
            return self.terms[name]
        except KeyError:
            raise KeyError(f"a {self.step_kind.value} step has no term {name!r}; it has {sorted(self.terms)}") from None

    def get(self, name: str) -> Tensor | None:
        """The term ``name``, or None where this step has no such term (``sink_share`` without a sink)."""
        return self.terms.get(name)

    @property
    def tile_kind(self) -> TileKind:
        """The kind of this step's tile; a step without a tile (a MERGE, the PREPROCESS) has none: a named error."""
        if self.kind is None:
            raise ValueError(f"a {self.step_kind.value} step has no tile, so no tile kind")
        return self.kind

    @property
    def masked(self) -> bool:
        """The tile is PARTIAL and ran with its own mask."""
        return self.kind is TileKind.PARTIAL

    @property
    def skipped(self) -> bool:
        """Always False: a skipped tile is never visited, so it is never a step (see ``Replay.skipped``)."""
        return self.kind is TileKind.SKIP

    @property
    def accumulators(self) -> dict[str, Tensor]:
        """A backward step's on-chip accumulators after it, by name (``dV_j, dK_j`` or ``dQ_i``); else empty."""
        return {name: self.terms[name] for name in ACCUMULATORS.get(self.step_kind, ())}

    @property
    def label(self) -> str:
        """A merge's ``(0 1) + 2``: the splits merged so far and the one merged in (``sink`` for the sink)."""
        return "(" + " ".join(map(str, self.merged)) + ") + " + ("sink" if self.split is None else str(self.split))
