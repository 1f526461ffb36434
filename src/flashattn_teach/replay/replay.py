"""Tile replay: the running statistics of one query block, recorded after every tile update.

For query block ``i`` (rows ``[r0, r1)``) the online softmax folds in one score tile ``S_ij`` per key
block ``j`` (Dao 2023, FlashAttention-2 Alg. 1 lines 8-10):

    m_i = max(m_i, rowmax(S_ij)),   l_i = exp(m_old - m_i) l_i + rowsum(exp(S_ij - m_i)),
    acc = exp(m_old - m_i) acc + exp(S_ij - m_i) V_j

and a replay gives, after each update, ``S_ij``, ``m_i``, ``l_i`` and the partial output
``acc / l_i`` (attention over the keys seen so far), next to the final dense output. The steps
(:mod:`.steps`) call the update of :mod:`flashattn_teach.core.online_softmax` exactly as the CPU references
call it, so the replay and the references cannot drift apart.

``order="key_major"`` replays FlashAttention's Algorithm 1 (Dao et al. 2022): the same tiles of block
``i`` in the same order, but the state goes to "HBM" between them (``O_i = acc / l_i`` is written and
read back as ``acc = O_i * l_i``, Alg. 1 lines 8 and 12-13) while the tiles of other query blocks run in
between; each step records its position in that global schedule (:mod:`.schedule`).

The mask contract (:mod:`flashattn_teach.masks`: causal, ``window``, ``softcap``, ``alibi_slopes``,
``seqlens_k``, ``attn_mask``) decides each tile's kind exactly as it does for the CPU references
(``MaskSpec.build`` and ``Tiling``): SKIP tiles (above the causal diagonal, outside the window's band, past
the key length, hidden by the mask) are never visited, so they are not steps; they are listed in
``Replay.skipped``. Every step records its kind, FULL (no mask work) or PARTIAL (the tile's own mask).

FlexAttention's ``block_mask`` (:func:`flashattn_teach.create_block_mask`, for the replayed head: ``H = 1``)
decides the kinds as ``flex_attention``'s CPU path reads it: its ``block_kinds`` at ``BLOCK_SIZE = (block_m,
block_n)``, or re-tiled to the replay's tiles conservatively (``BlockMask.tile_kinds``: SKIP only if every block
a tile meets is SKIP, FULL only if every one is FULL); SKIP tiles are not visited, PARTIAL tiles run
``mask_mod`` (elements of FULL blocks visible, of SKIP blocks hidden). ``score_mod`` runs on each visited
tile after the scale, the softcap and the biases, before the masks (:mod:`flashattn_teach.flex.mods`); both
functions see ``b = batch_index`` and ``h = 0``.

With an attention sink (``sinks``, GPT-OSS's learned logit of the replayed head) every row's state starts as if
it had seen one key of score ``sink_h`` and value zero, ``m_i = sink_h, l_i = 1, acc = 0``
(:func:`flashattn_teach.core.online_softmax.init_state`); each step records the sink's share of the row so far,
``exp(sink_h - m_i) / l_i``, and :meth:`Replay.sink_share` the share at the end, ``exp(sink_h - lse_i)``: the
weight the sink took from the keys, whose weights sum to ``1 - share``.

Memory is ``O(N D)`` for any ``N`` (besides a user's own ``attn_mask``): the dense output is computed for the
replayed rows only, from their ``(Br, N_k)`` scores, and the steps are computed when iterated, one tile at
a time, never stored.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
from torch import Tensor
from typing_extensions import Unpack

from .._validate.keywords import takes_keywords
from ..errors import AttentionValueError
from ..flex.mods import ScoreMod, UserMods
from ..masks.spec import MaskSpec
from ..reference.dense import dense_attention
from ..reference.scores import score_tile
from .inputs import ReplayKeywords, check_index, one_head_call, pick_matrix, rows_mask, rows_tensors
from .kernel_trace import check_traceable, kernel_inputs, kernel_tiles, production_tiles, trace_of
from .schedule import ORDERS, Schedule, Skipped, Tile, blocks
from .step import Step, TileState
from .steps import Steps

__all__ = [
    "ORDERS",
    "SOURCES",
    "Replay",
    "ReplayCall",
    "ReplayKeywords",
    "Step",
    "Steps",
    "Tile",
    "TileState",
    "replay",
]


SOURCES = ("reference", "triton")  # replay(source=...): the reference alone, or the tutorial kernel beside it


@dataclass(frozen=True)
class Replay:
    """One query block's tile updates, in the order the algorithm visits them."""

    steps: Steps
    query_block: int
    rows: tuple[int, int]
    N_q: int
    N_k: int
    block_m: int
    block_n: int
    causal: bool
    causal_align: str
    order: str
    scale: float
    schedule: Schedule  # every computed tile of every query block, in visiting order
    skipped: Skipped  # tiles of every query block never computed (SKIP under the mask contract)
    mask: MaskSpec  # the call's mask contract, as the references read it
    batch_index: int = 0
    sink: float | None = None  # sink_h of the replayed head, or None without a sink
    call: ReplayCall | None = field(default=None, repr=False, compare=False)  # how replay() was called
    source: str = "reference"  # "triton": each step also carries a kernel's numbers (.kernel_trace)
    kernel: str = "core"  # with source="triton": the tutorial kernel ("core") or "production" (triton/kernels/)
    note: str = ""  # what the renderers should say about this replay (the kernel's tile sizes)

    # notebook.notebook_html, installed by the trace package's __init__: notebook imports this module (through
    # html), so this module cannot import it (no import cycles).
    notebook_page: ClassVar[Callable[[Replay], str] | None] = None
    replay_kind: ClassVar[str] = "forward"  # the scenario, "replayKind" in its JSON

    def _repr_html_(self) -> str | None:
        """Jupyter's rich display: the replay page in an ``<iframe srcdoc>`` (:mod:`.notebook`)."""
        render = Replay.notebook_page
        return None if render is None else render(self)

    def all_steps(self) -> Iterator[Step]:
        """Every step, in the order it runs: the UPDATEs of the query block."""
        return iter(self.steps)

    def with_options(self, **changes: Any) -> Replay:
        """The replay of the same inputs with some of :func:`replay`'s keyword arguments changed (e.g.
        ``query_block=1`` or ``order="key_major"``); the page's views that need other query blocks or the
        other order are built this way."""
        if self.call is None:
            raise AttentionValueError("this Replay was not made by trace.replay(), so it cannot be replayed again")
        return self.call.run(**changes)

    @property
    def inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        """``q, k, v`` exactly as given to :func:`replay` (every batch element); the replayed element's rows are
        ``steps.q_i``, ``steps.k`` and ``steps.v``."""
        if self.call is None:
            raise AttentionValueError("this Replay was not made by trace.replay(), so it has no inputs")
        return self.call.q, self.call.k, self.call.v

    def sink_share(self) -> Tensor | None:
        """``(Br,)``: each replayed row's final sink share ``exp(sink_h - lse_i)``, from the replay's own last
        update (1 for a row block that sees no key: ``lse_i = sink_h``); None without a sink. Runs every update."""
        if self.steps.sink is None:
            return None
        if len(self.steps) == 0:
            r0, r1 = self.rows
            return torch.ones(r1 - r0, dtype=self.steps.q_i.dtype, device=self.steps.q_i.device)
        share = self.steps[-1].get("sink_share")
        assert share is not None
        return share

    @property
    def diagonal_offset(self) -> int:
        """The replayed batch element's ``off_b`` (``seqlens_k[b] - N_q`` under ``bottom_right`` with
        ``seqlens_k``)."""
        return self.mask.offset_of(self.batch_index)

    @property
    def window(self) -> tuple[int, int]:
        """``(left, right)`` with causal folded in (``right = 0``); ``-1``: unbounded."""
        return self.mask.left, self.mask.right

    @property
    def variants(self) -> tuple[str, ...]:
        """The options beyond plain (causal) attention this replay uses, by :func:`replay`'s argument names (a
        block mask's ``mask_mod`` is named ``block_mask``, the argument that carries it)."""
        mods = self.mask.mods
        named = {"mask_mod": "block_mask"} if mods is not None and mods.block_mask is not None else {}
        return tuple(named.get(name, name) for name in self.mask.variants)

    def labels(self) -> list[str]:
        """The masking options of this replay, one short label each (``causal (top_left)``, ``window (2, 0)``,
        ``softcap 30``, ...), for headings."""
        labels = [f"causal ({self.causal_align})"] if self.causal else []
        for name in self.variants:
            if name == "window":
                labels.append(f"window {self.window}")
            elif name == "softcap":
                labels.append(f"softcap {self.mask.softcap:g}")
            elif name in ("block_mask", "score_mod"):
                labels.append(flex_label(name, self.mask.mods, (self.block_m, self.block_n)))
            elif name == "seqlens_k":
                assert self.mask.seqlens_k is not None
                labels.append(f"seqlens_k {int(self.mask.seqlens_k.reshape(-1)[self.batch_index])}")
            else:
                labels.append(name)
        if self.sink is not None:
            labels.append(f"sink {self.sink:g}")
        return labels

    @property
    def T_r(self) -> int:
        return self.schedule.T_r

    @property
    def T_c(self) -> int:
        return self.schedule.T_c

    def state(self, step: Step, tile: Tile) -> TileState:
        """The state of ``tile = (i, j)`` at ``step``."""
        if tile == (step.i, step.j):
            return TileState.CURRENT
        if tile in step.done:
            return TileState.ACCUMULATED if tile[0] == step.i else TileState.DONE
        if tile in self.schedule:
            return TileState.PENDING
        return TileState.SKIPPED

    def grid(self, step: Step) -> list[list[TileState]]:
        """``(T_r, T_c)`` tile states at ``step``; ``T_r T_c`` grows as ``N^2``, so draw a window of a large one
        with :meth:`state`."""
        return [[self.state(step, (i, j)) for j in range(self.T_c)] for i in range(self.T_r)]

    def visible(self) -> Tensor:
        """``(N_q, N_k)`` bool: which scores of the replayed batch element count (False where masked or
        ``-inf``, also where a ``score_mod`` returns ``-inf``). Holds all ``N_q x N_k`` cells: for pictures, which
        draw every cell anyway."""
        N_q, N_k = self.N_q, self.N_k
        device = self.steps.q_i.device
        allowed, bias = rows_tensors(self.mask, (0, N_q), N_k, device, b=self.batch_index)  # (N_q, N_k)
        cells = torch.ones(N_q, N_k, dtype=torch.bool, device=device)
        if allowed is not None:
            cells &= allowed
        if bias is not None:
            cells &= ~torch.isneginf(bias)
        mods = self.mask.mods
        if mods is not None and mods.score_mod is not None and self.call is not None:  # its -inf hides a score too
            q = pick_matrix(self.call.q, "query", self.batch_index).to(self.steps.k.dtype)
            index = self.mask.tile_index(0, N_q, 0, N_k, device, b=self.batch_index, h=0)
            S = score_tile(q, self.steps.k, self.scale, softcap=self.mask.softcap, bias=bias)  # (N_q, N_k)
            cells &= ~torch.isneginf(mods.score(S, index))
        return cells


@dataclass(frozen=True)
class ReplayCall:
    """The arguments of one :func:`replay` call (its keywords checked and their defaults filled), kept so that a
    view can replay the same inputs otherwise and the backward replay can take the same options whole."""

    q: Tensor
    k: Tensor
    v: Tensor
    query_block: int
    order: str
    options: ReplayKeywords

    def run(self, *, query_block: int | None = None, order: str | None = None, **changes: Any) -> Replay:
        """The replay of the same call with ``query_block``, ``order`` or some of the shared keywords changed."""
        unknown = sorted(set(changes) - set(self.options))
        if unknown:
            accepted = sorted({"query_block", "order", *self.options})
            raise AttentionValueError(f"replay() has no keyword argument {unknown[0]!r}; it takes {accepted}")
        options = cast(ReplayKeywords, self.options | changes)
        query_block = self.query_block if query_block is None else query_block
        return forward_replay(ReplayCall(self.q, self.k, self.v, query_block, order or self.order, options))


@takes_keywords()
def replay(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    query_block: int = 0,
    order: str = "query_major",
    source: str = "reference",
    kernel: str = "core",
    **options: Unpack[ReplayKeywords],
) -> Replay:
    """Replay query block ``query_block`` of ``attention(q, k, v)`` one tile update at a time.

    Args:
        q: ``(B, N_q, D)`` or ``(N_q, D)``; k: ``(B, N_k, D)``; v: ``(B, N_k, D_v)``. With ``B > 1`` batch
            element ``batch_index`` is replayed (a size-1 batch broadcasts). The replay runs one head.
        block_m, block_n: tile sizes ``BLOCK_M x BLOCK_N``; any sizes >= 1.
        query_block: ``i``, the block of query rows ``[i * block_m, min((i + 1) * block_m, N_q))``.
        causal, causal_align: see :mod:`flashattn_teach.masks.causal`.
        scale: softmax scale, default ``1 / sqrt(D)``.
        order: ``"query_major"`` (FlashAttention-2) or ``"key_major"`` (FlashAttention Alg. 1).
        window, softcap, seqlens_k: as for :func:`flashattn_teach.flash_attention` (see
            :mod:`flashattn_teach.masks`); ``seqlens_k`` has shape ``(B,)``.
        alibi_slopes: one slope (a number, or a ``(1,)`` tensor) or one per batch element (``(B,)``).
        attn_mask: bool (True: visible) or additive, broadcastable to ``(B, N_q, N_k)``, e.g. ``(N_q, N_k)``
            or a left-padding mask ``(B, 1, N_k)``; a 4-D mask is read as Hugging Face's
            ``(B, 1, N_q, N_k)``.
        cu_seqlens: packed sequences (flash-attn's varlen layout) along the one batch element's sequence
            axis, ``(S + 1,)`` boundaries from 0 to ``N`` (``N_q = N_k``): each query sees only the keys of its
            own sequence, causal and the window aligned per sequence (see :mod:`flashattn_teach.masks.packed`); needs
            ``B = 1`` and takes no ``attn_mask`` or ``seqlens_k`` (as ``flash_attention_varlen``).
        sinks: the replayed head's attention sink ``sink_h``: a number, or a ``(1,)`` tensor (slice a model's
            ``(H_q,)`` sinks as its queries: ``sinks[h:h + 1]``); see :mod:`flashattn_teach._validate.sinks`.
        block_mask: FlexAttention's block mask (:func:`flashattn_teach.create_block_mask`, or torch's), built
            for ``(N_q, N_k)``, ``B`` None, 1 or ``B``, and ``H`` None or 1 (the replayed head; a mask of several
            heads is refused: build it for the head you replay). Any ``BLOCK_SIZE``: the kinds are re-tiled to
            ``block_m x block_n`` as ``flex_attention`` re-tiles them.
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)``, called with ``h = 0``.
        source: ``"reference"``, or ``"triton"``: each step also carries the numbers the tutorial kernel
            (:mod:`flashattn_teach.core.kernel`) computed for the same tile, ``step.kernel`` and
            ``step.kernel_diff`` (:mod:`.kernel_trace`), at the kernel's tile sizes (powers of two >= 16); plain
            or causal attention, float32 or float16 on a CPU (Triton's interpreter), also bfloat16 on a GPU.
        kernel: with ``source="triton"``, ``"core"`` (the tutorial kernel) or ``"production"``: the production
            forward (``triton/kernels/forward.py``) at its launcher's tile, also with the mask contract's variants.

    Returns:
        A :class:`Replay`, computed in float64 for float64 inputs and float32 otherwise (as the
        references do), one :class:`Step` per visited tile of the block. Its steps are computed
        when iterated; keep the ones you need.

    Raises:
        AttentionTypeError, AttentionValueError (also ``TypeError``, ``ValueError``): a bad argument, named.
    """
    if source not in SOURCES:
        raise AttentionValueError(f"source must be one of {SOURCES}, got {source!r}")
    if source == "reference" and kernel != "core":
        raise AttentionValueError(f'kernel={kernel!r} picks the traced kernel of source="triton"; pass both')
    call = ReplayCall(q, k, v, query_block, order, options)
    return forward_replay(call) if source == "reference" else kernel_replay(call, kernel)


def kernel_replay(call: ReplayCall, kernel: str = "core") -> Replay:
    """``source="triton"``: the replay at the kernel's tile sizes, each step with the kernel's trace of its tile."""
    head = one_head_call(call.q, call.k, call.v, call.options)
    check_traceable(call.order, head, call.q, call.k, call.options["causal_align"], kernel)
    sizes = f"N_q={head.q.shape[0]}, block_m={head.block_m}"
    check_index("query_block", call.query_block, blocks(head.q.shape[0], head.block_m), sizes)  # before re-tiling
    raw, rounded = kernel_inputs(call.q, call.k, call.v)  # the inputs' own dtype (float64: float32)
    tile = production_tiles(head, *raw) if kernel == "production" else None
    kernel_m, kernel_n, i, tiles = kernel_tiles(head, call.query_block, tile)
    options = cast(ReplayKeywords, call.options | {"block_m": kernel_m, "block_n": kernel_n})
    ref = forward_replay(ReplayCall(call.q, call.k, call.v, i, call.order, options))
    trace = trace_of(kernel, head, raw, (kernel_m, kernel_n), ref.causal, ref.scale)
    steps = dataclasses.replace(ref.steps, kernel_terms=trace.terms)
    note = " ".join([tiles, rounded]).strip()
    return dataclasses.replace(ref, steps=steps, source="triton", kernel=kernel, note=note)


def forward_replay(call: ReplayCall) -> Replay:
    """The replay of ``call``: :func:`replay`'s body, its keywords checked and their defaults filled."""
    order = call.order
    if order not in ORDERS:
        raise AttentionValueError(f"order must be one of {ORDERS}, got {order!r}")
    head = one_head_call(call.q, call.k, call.v, call.options)
    opts, q2, k2, v2, sink = head.options, head.q, head.k, head.v, head.sink  # sink: (1,), compute dtype
    block_m, block_n, batch_index = head.block_m, head.block_n, head.batch_index
    N_q, N_k = q2.shape[0], k2.shape[0]
    i = check_index("query_block", call.query_block, blocks(N_q, block_m), f"N_q={N_q}, block_m={block_m}")

    tiling = opts.mask.tiling(block_m, block_n)
    r0, r1 = tiling.row_blocks[i]
    q_i = q2[r0:r1]  # (Br, D)
    # The oracle for these rows only: their (Br, N_k) rows of the contract's mask and bias, then dense attention.
    O_final = dense_attention(
        q_i,
        k2,
        v2,
        scale=opts.scale,
        softcap=opts.mask.softcap,
        attn_mask=rows_mask(opts.mask, (r0, r1), N_k, q2.device, b=batch_index),  # (Br, N_k)
        sinks=sink,
        score_mod=rows_score_mod(opts.mask.mods, batch_index, r0),
    )
    steps = Steps.of_block(
        q2, k2, v2, tiling, i, O_final, scale=opts.scale, order=order, batch_index=batch_index, sink=sink
    )
    order_tiles = steps.schedule  # every computed tile of every query block, in visiting order
    return Replay(
        steps=steps,
        query_block=i,
        rows=(r0, r1),
        N_q=N_q,
        N_k=N_k,
        block_m=block_m,
        block_n=block_n,
        causal=opts.causal,
        causal_align=call.options["causal_align"],
        order=order,
        scale=opts.scale,
        schedule=order_tiles,
        skipped=order_tiles.skipped(),
        mask=opts.mask,
        batch_index=batch_index,
        sink=None if sink is None else float(sink),
        call=call,
    )


def rows_score_mod(mods: UserMods | None, b: int, r0: int) -> ScoreMod | None:
    """The user's ``score_mod`` for a dense call on the rows ``[r0, ...)`` of batch element ``b`` alone: the
    dense call numbers its rows from 0 and its one batch element 0, so the indices are shifted back."""
    if mods is None or mods.score_mod is None:
        return None
    return functools.partial(_shifted, mods.score_mod, b, r0)


def _shifted(
    fn: ScoreMod, b: int, r0: int, score: Tensor, _b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
) -> Tensor:
    return fn(score, torch.full_like(_b, b), h, q_idx + r0, kv_idx)


def flex_label(name: str, mods: UserMods | None, tile: tuple[int, int]) -> str:
    """``block_mask causal 2x2`` (its ``mask_mod``'s name and ``BLOCK_SIZE``, ``re-tiled to ...`` when it differs
    from the replay's tiles) or ``score_mod alibi`` (the function's name)."""
    assert mods is not None
    if name == "score_mod":
        return f"score_mod {getattr(mods.score_mod, '__name__', '')}".rstrip()
    bm = mods.block_mask
    assert bm is not None
    fn = getattr(bm.mask_mod, "__name__", "")
    label = f"block_mask {fn} {bm.BLOCK_SIZE[0]}x{bm.BLOCK_SIZE[1]}".replace("  ", " ")
    return label if tuple(bm.BLOCK_SIZE) == tile else f"{label}, re-tiled to {tile[0]}x{tile[1]}"
