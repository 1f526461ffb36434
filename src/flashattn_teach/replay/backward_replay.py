"""Backward replay: the tile steps of FlashAttention-2's backward (Dao 2023, Alg. 2), for one head.

Split as Triton's tutorial and :mod:`flashattn_teach.reference.backward` do it:

    preprocess:  delta_i = rowsum(dO_i * O_i)                              (Alg. 2 line 4)
    dK/dV pass:  for each key block j, each query block i that sees it (SKIP tiles left out):
                 P_ij = exp(S_ij - lse_i)                                   (line 11, recomputed)
                 dV_j += P_ij^T dO_i                                        (line 12)
                 dP_ij = dO_i V_j^T                                         (line 13)
                 dS_ij = P_ij * (dP_ij - delta_i)  [softcap: * (1 - T^2)]   (line 14)
                 dK_j += scale dS_ij^T Q_i                                  (line 16)
    dQ pass:     for each query block i, each key block j it sees (P_ij, dP_ij, dS_ij recomputed):
                 dQ_i += scale dS_ij K_j                                    (line 15)

Each tile's terms are :func:`flashattn_teach.core.backward.tile_terms`, the function every CPU backward calls,
so the replay cannot drift from them. Every step carries its equations with their numbers
(:class:`StepEquation`). ``dO`` defaults to ``torch.randn`` of O's shape from a ``torch.Generator`` seeded
with ``seed``. Rows with ``lse = -inf`` (every key masked) get ``P = 0`` and zero gradients. With an attention
sink (``sinks``, one more score column of value zero, GPT-OSS) ``lse_i = log(exp(sink) + sum_j exp(S_ij))``:
the formulas above are unchanged, since the sink's ``dP`` is 0 and ``delta_i`` already sums over the keys
only, and ``dsink = -sum_i exp(sink - lse_i) delta_i``. With FlexAttention's ``score_mod`` the scores are
``score_mod(S_ij)`` and ``dS_ij`` goes back through it, ``dS_in = dS_out * d score_mod / dS`` (autograd on the
tile, :func:`flashattn_teach.flex.mods.score_backward`); a ``block_mask`` decides the tiles as in the forward
replay (:mod:`.replay`). :meth:`BackwardReplay.oracle` differentiates dense attention in float64 with
``torch.autograd``, the reference the passes end at. Steps are computed when iterated.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import Tensor
from typing_extensions import Unpack

from .._validate.keywords import takes_keywords
from ..core.backward import BackwardTerms, tile_terms
from ..errors import AttentionValueError
from ..masks.spec import Tiling
from ..reference.dense import dense_attention
from ..reference.scores import score_hook, score_tile
from .inputs import ReplayKeywords, one_head_call, pick_matrix, rows_mask, rows_tensors
from .kernel_trace_backward import KernelBackwardTrace, check_traceable, kernel_blocks, run_backward_trace
from .replay import SOURCES, Replay, rows_score_mod
from .schedule import visited_key_blocks
from .step import ACCUMULATORS, Step, StepEquation, StepKind, numbers

__all__ = ["BackwardPass", "BackwardReplay", "backward_of", "replay_backward"]


BackwardPass = StepKind  # the phases of Alg. 2 are steps' kinds: PREPROCESS, DKDV, DQ (the old name)
PASSES = (StepKind.PREPROCESS, StepKind.DKDV, StepKind.DQ)  # in the order they run


@dataclass(frozen=True)
class TileGrads:
    """What both passes recompute on tile ``(i, j)`` (:func:`flashattn_teach.core.backward.tile_terms`: ``S, P,
    dP, dS (Br, Bc)``, ``dS`` w.r.t. the uncapped scores, and the contributions), with the equations of P_ij,
    dP_ij and dS_ij."""

    t: BackwardTerms
    eq_P: StepEquation
    eq_dP: StepEquation
    eq_dS: StepEquation


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
    sink: Tensor | None = None  # (1,): the head's sink logit, or None
    source: str = "reference"  # "triton": each dK/dV and dQ step also carries the kernels' numbers, step.kernel
    kernel: KernelBackwardTrace | None = None  # the kernels' trace (.kernel_trace_backward), with source="triton"
    note: str = ""  # with source="triton": the kernels' tiles where they differ from the requested ones

    def _tile(self, i: int, j: int) -> TileGrads:
        """Tile (i, j) by ``core.backward.tile_terms``, with the mask contract's features around it, and the
        equations of P_ij, dP_ij and dS_ij."""
        (r0, r1), (c0, c1) = self.tiling.row_blocks[i], self.tiling.col_blocks[j]
        allowed, bias = self.tiling.head_tile(i, j, (r0, r1), b=self.batch_index, h=0, device=self.q.device)
        q_i, k_j = self.q[r0:r1], self.k[c0:c1]
        mod, dmod = None, []
        if self.tiling.score_mod(i, j, self.q.device, (r0, r1), b=self.batch_index, h=0) is not None:

            def mod(S: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:  # S = score_mod(S), with its vjp
                S_out, vjp = self.tiling.score_backward(i, j, S, None, (r0, r1), b=self.batch_index, h=0)
                dmod.append(vjp(torch.ones_like(S_out)))  # d score_mod / dS: score_mod is elementwise (FlexAttention)
                return S_out, lambda dS: dS * dmod[0]

        lse_i, delta_i = self.lse[r0:r1], self.delta[r0:r1]  # (Br,)
        with torch.no_grad():  # the terms as numbers, with no autograd graph
            t = tile_terms(q_i, k_j, self.v[c0:c1], self.dO[r0:r1], lse_i, delta_i, self.scale, allowed,
                           scores=score_hook(self.softcap, bias, mod))  # fmt: skip
        P_symbolic = "exp(S_ij - lse_i)"
        if torch.isneginf(lse_i).any():  # the text shows exp(-inf - -inf) there: say what the code does instead
            P_symbolic += ", taken as 0 in a row with lse_i = -inf (it sees no key), not exp(-inf - -inf)"
        dS_text = f"{numbers(t.P)} * ({numbers(t.dP)} - {numbers(delta_i)})"
        dS_symbolic = "P_ij * (dP_ij - delta_i)"
        if dmod:  # through score_mod: its derivative, shown as the factor d score_mod / dS
            dS_text += f" * {numbers(dmod[0])}"
            dS_symbolic += " * dscore_mod/dS"
        if self.softcap is not None:  # d(softcap tanh(x / softcap))/dx = 1 - T^2
            T = torch.tanh((q_i * self.scale) @ k_j.T / self.softcap)  # (Br, D) @ (D, Bc) -> (Br, Bc)
            dS_text += f" * (1 - {numbers(T)}^2)"
            dS_symbolic += " * (1 - T_ij^2)"
        eq_P = StepEquation(11, "P_ij", P_symbolic, f"exp({numbers(t.S)} - {numbers(lse_i)})", t.P)
        dP_text = f"{numbers(self.dO[r0:r1])} {numbers(self.v[c0:c1])}^T"
        eq_dP = StepEquation(13, "dP_ij", "dO_i V_j^T", dP_text, t.dP)
        eq_dS = StepEquation(14, "dS_ij", dS_symbolic, dS_text, t.dS)
        return TileGrads(t, eq_P.with_result(), eq_dP.with_result(), eq_dS.with_result())

    def _step(
        self,
        step_kind: StepKind,
        index: int,
        i: int,
        j: int,
        tile: TileGrads,
        acc: dict[str, Tensor],
        equations: list[StepEquation],
    ) -> Step:
        """Step ``index`` of a pass: tile ``(i, j)``'s recomputed terms (:class:`~flashattn_teach.core.backward.
        BackwardTerms` under the paper's names), its accumulators ``acc`` after it, and its equations."""
        t = tile.t
        terms = {"S_ij": t.S, "P_ij": t.P, "dP_ij": t.dP, "dS_ij": t.dS, **acc}
        assert tuple(acc) == ACCUMULATORS[step_kind]
        step = Step(
            step_kind=step_kind,
            index=index,
            terms=terms,
            equations=tuple(equations),
            i=i,
            j=j,
            rows=self.tiling.row_blocks[i],
            cols=self.tiling.col_blocks[j],
            kind=self.tiling.kind(i, j, b=self.batch_index, h=0),
        )
        return step if self.kernel is None else dataclasses.replace(step, kernel=self.kernel.terms(step))

    def _visits(self) -> dict[int, list[int]]:
        return {i: list(js) for i, js in enumerate(visited_key_blocks(self.tiling, b=self.batch_index))}

    replay_kind: ClassVar[str] = "backward"  # the scenario, "replayKind" in its JSON

    def all_steps(self) -> Iterator[Step]:
        """Every step, in the order it runs: the PREPROCESS, the DKDV pass, then the DQ pass."""
        yield self.preprocess()
        yield from self.dkdv_steps()
        yield from self.dq_steps()

    def preprocess(self) -> Step:
        """The PREPROCESS step: ``delta = rowsum(dO * O)`` (and with a sink its gradient, which needs only delta);
        no tile."""
        eqs = [
            StepEquation(4, "delta", "rowsum(dO * O)", f"rowsum({numbers(self.dO)} * {numbers(self.O)})", self.delta)
        ]
        if self.sink is not None:
            ds = self.dsink()
            text = f"-sum(exp({numbers(self.sink[0])} - {numbers(self.lse)}) * {numbers(self.delta)})"
            eqs.append(StepEquation(None, "dsink", "-sum_i exp(sink - lse_i) delta_i", text, ds))
        terms = {eq.name: eq.value for eq in eqs}  # delta (N_q,), dsink ()
        return Step(StepKind.PREPROCESS, 0, terms, equations=tuple(e.with_result() for e in eqs))

    def dkdv_steps(self) -> Iterator[Step]:
        visits = self._visits()
        n = 0
        for j, (c0, c1) in enumerate(self.tiling.col_blocks):
            dV_j = torch.zeros(c1 - c0, self.v.shape[-1], dtype=self.q.dtype, device=self.q.device)
            dK_j = torch.zeros(c1 - c0, self.q.shape[-1], dtype=self.q.dtype, device=self.q.device)
            for i in (i for i in visits if j in visits[i]):
                r0, r1 = self.tiling.row_blocks[i]
                t = self._tile(i, j)
                dO_i, q_i = self.dO[r0:r1], self.q[r0:r1]
                dV_text = f"{numbers(dV_j)} + {numbers(t.t.P)}^T {numbers(dO_i)}"
                dK_text = f"{numbers(dK_j)} + {self.scale:.4g} {numbers(t.t.dS)}^T {numbers(q_i)}"
                dV_j = dV_j + t.t.dV  # P_ij^T dO_i: (Bc, Br) @ (Br, D_v) -> (Bc, D_v)
                dK_j = dK_j + t.t.dK  # scale dS_ij^T Q_i: (Bc, Br) @ (Br, D) -> (Bc, D)
                eqs = [
                    t.eq_P,
                    StepEquation(12, "dV_j", "dV_j + P_ij^T dO_i", dV_text, dV_j).with_result(),
                    t.eq_dP,
                    t.eq_dS,
                    StepEquation(16, "dK_j", "dK_j + scale dS_ij^T Q_i", dK_text, dK_j).with_result(),
                ]
                yield self._step(StepKind.DKDV, n, i, j, t, {"dV_j": dV_j, "dK_j": dK_j}, eqs)
                n += 1

    def dq_steps(self) -> Iterator[Step]:
        n = 0
        for i, js in self._visits().items():
            r0, r1 = self.tiling.row_blocks[i]
            dQ_i = torch.zeros(r1 - r0, self.q.shape[-1], dtype=self.q.dtype, device=self.q.device)
            for j in js:
                c0, c1 = self.tiling.col_blocks[j]
                t = self._tile(i, j)
                text = f"{numbers(dQ_i)} + {self.scale:.4g} {numbers(t.t.dS)} {numbers(self.k[c0:c1])}"
                dQ_i = dQ_i + t.t.dQ  # scale dS_ij K_j: (Br, Bc) @ (Bc, D) -> (Br, D)
                eq = StepEquation(15, "dQ_i", "dQ_i + scale dS_ij K_j", text, dQ_i).with_result()
                yield self._step(StepKind.DQ, n, i, j, t, {"dQ_i": dQ_i}, [t.eq_P, t.eq_dP, t.eq_dS, eq])
                n += 1

    def skipped(self) -> list[tuple[int, int]]:
        """The tiles ``(i, j)`` neither pass visits (SKIP under the mask contract)."""
        visits = self._visits()
        return [(i, j) for i in visits for j in range(len(self.tiling.col_blocks)) if j not in visits[i]]

    def grads(self) -> tuple[Tensor, Tensor, Tensor]:
        """dQ (N_q, D), dK (N_k, D), dV (N_k, D_v), assembled from the two passes (a key block no query
        block sees keeps zero gradients)."""
        dQ, dK, dV = torch.zeros_like(self.q), torch.zeros_like(self.k), torch.zeros_like(self.v)
        for s in self.dkdv_steps():
            dK[s.cols[0] : s.cols[1]] = s["dK_j"]
            dV[s.cols[0] : s.cols[1]] = s["dV_j"]
        for s in self.dq_steps():
            dQ[s.rows[0] : s.rows[1]] = s["dQ_i"]
        return dQ, dK, dV

    def dsink(self) -> Tensor:
        """``()``: the sink's gradient, ``-sum_i exp(sink - lse_i) delta_i`` (its column of dS, summed); 0 without."""
        if self.sink is None:
            return torch.zeros((), dtype=self.q.dtype, device=self.q.device)
        return -(torch.exp(self.sink - self.lse) * self.delta).sum()

    def gradients(self) -> dict[str, Tensor]:
        """``{"dQ", "dK", "dV"}`` (and ``"dsink"``, shape ``(1,)``, with a sink) from the replayed passes."""
        dQ, dK, dV = self.grads()
        out = {"dQ": dQ, "dK": dK, "dV": dV}
        if self.sink is not None:
            out["dsink"] = self.dsink().reshape(1)
        return out

    def oracle(self) -> dict[str, Tensor]:
        """The same gradients by ``torch.autograd`` through float64 dense attention
        (:func:`flashattn_teach.reference.dense.dense_attention`), under the same mask contract."""
        N_q, N_k, f64 = self.q.shape[0], self.k.shape[0], torch.float64
        mask = rows_mask(self.tiling.spec, (0, N_q), N_k, self.q.device, b=self.batch_index)  # (N_q, N_k)
        mask = mask.to(f64) if mask is not None and mask.is_floating_point() else mask
        leaves = {name: t.detach().to(f64).requires_grad_(True) for name, t in (("dQ", self.q), ("dK", self.k))}
        leaves["dV"] = self.v.detach().to(f64).requires_grad_(True)
        if self.sink is not None:
            leaves["dsink"] = self.sink.detach().to(f64).requires_grad_(True)
        mod = rows_score_mod(self.tiling.spec.mods, self.batch_index, 0)  # b = batch_index, h = 0
        q, k, v = (leaves[n].unsqueeze(0) for n in ("dQ", "dK", "dV"))  # (1, N, D): one head
        O = dense_attention(
            q, k, v, scale=self.scale, softcap=self.softcap, attn_mask=mask, sinks=leaves.get("dsink"), score_mod=mod
        )  # (1, N_q, D_v)
        O.backward(self.dO.detach().to(f64).unsqueeze(0))
        return {name: t.grad for name, t in leaves.items() if t.grad is not None}

    def max_error(self) -> dict[str, float]:
        """``max |grad - oracle|`` of each gradient, against :meth:`oracle`."""
        mine, ref = self.gradients(), self.oracle()
        return {name: float((mine[name].to(torch.float64) - ref[name]).abs().max()) for name in mine}


@takes_keywords()
def replay_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dO: Tensor | None = None,
    *,
    seed: int = 0,
    source: str = "reference",
    deterministic: bool = False,
    **options: Unpack[ReplayKeywords],
) -> BackwardReplay:
    """Replay the backward of one head of ``attention(q, k, v)``: shapes, mask contract, ``cu_seqlens``,
    ``sinks``, ``block_mask`` and ``score_mod`` as :func:`.replay.replay`, checked the same way (the gradients
    of tensors a ``score_mod`` captures are not replayed). ``dO``: ``(N_q, D_v)`` (or ``(B, N_q, D_v)``, element
    ``batch_index`` taken), default ``randn`` from ``torch.Generator().manual_seed(seed)`` (which draws
    the numbers ``torch.manual_seed(seed)`` would: inputs made that way with the same seed start alike, so the
    command line passes ``dO`` as the fourth ``randn`` after q, k, v).

    ``source="triton"``: each dK/dV and dQ step also carries the production backward kernels' own numbers for the
    same tile, ``step.kernel`` and ``step.kernel_diff`` (:mod:`.kernel_trace_backward`), at the kernels' tiles
    (powers of two >= 16); plain or causal attention, float32 or float16 on a CPU (Triton's interpreter), also
    bfloat16 on a GPU. ``deterministic``: trace the two-kernel backward (a dQ program) rather than the one-kernel
    backward (dQ by atomic adds)."""
    return backward_from(q, k, v, dO, seed, options, source, deterministic)


def backward_from(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dO: Tensor | None,
    seed: int,
    options: ReplayKeywords,
    source: str,
    deterministic: bool,
) -> BackwardReplay:
    """The backward replay of ``source`` (:data:`.replay.SOURCES`): the reference's, or with the kernels' trace."""
    if source not in SOURCES:
        raise AttentionValueError(f"source must be one of {SOURCES}, got {source!r}")
    if source == "reference":
        return backward_replay(q, k, v, dO, seed, options)
    head = one_head_call(q, k, v, options)
    check_traceable(head, q)
    kernel_m, kernel_n = kernel_blocks(head.block_m, head.block_n)
    ref = backward_replay(q, k, v, dO, seed, cast(ReplayKeywords, options | {"block_m": kernel_m, "block_n": kernel_n}))
    dt = torch.float32 if q.dtype == torch.float64 else q.dtype  # the kernels' dtype: float64 rounded to float32
    dO_k = ref.dO.to(dt)  # the kernels' dO; the reference then takes the same numbers
    ref = dataclasses.replace(ref, dO=dO_k.to(ref.dO.dtype), delta=(dO_k.to(ref.dO.dtype) * ref.O).sum(-1))
    names = ("query", "key", "value")
    q_k, k_k, v_k = (pick_matrix(t, n, ref.batch_index).to(dt) for t, n in zip((q, k, v), names, strict=True))
    trace = run_backward_trace(
        (q_k, k_k, v_k, ref.O.to(dt), ref.lse.float(), dO_k),
        causal=head.options.causal,
        causal_align=options["causal_align"],
        scale=ref.scale,
        block_m=kernel_m,
        block_n=kernel_n,
        deterministic=deterministic,
    )
    note = ""
    if (kernel_m, kernel_n) != (head.block_m, head.block_n):
        note = (
            f"The kernels tile {kernel_m} x {kernel_n} (powers of two >= 16, tl.dot's minimum), not the requested "
            f"{head.block_m} x {head.block_n}: this replay uses the kernels' tiles."
        )
    if q.dtype == torch.float64:
        note += " The kernels compute in float32 at most: they ran on the float64 inputs rounded to float32."
    return dataclasses.replace(ref, source="triton", kernel=trace, note=note.strip())


def backward_replay(
    q: Tensor, k: Tensor, v: Tensor, dO: Tensor | None, seed: int, options: ReplayKeywords
) -> BackwardReplay:
    """:func:`replay_backward`'s body: its keywords checked and their defaults filled, taken whole."""
    head = one_head_call(q, k, v, options)
    opts, q2, k2, v2, sink = head.options, head.q, head.k, head.v, head.sink  # sink: (1,), compute dtype
    batch_index, dt = head.batch_index, q2.dtype
    N_q, N_k = q2.shape[0], k2.shape[0]
    allowed, bias = rows_tensors(opts.mask, (0, N_q), N_k, q2.device, b=batch_index)  # (N_q, N_k)
    mods = opts.mask.mods
    index = opts.mask.tile_index(0, N_q, 0, N_k, q2.device, b=batch_index, h=0)
    mod = None if mods is None or mods.score_mod is None else functools.partial(mods.score, index=index)
    S = score_tile(q2, k2, opts.scale, allowed, softcap=opts.mask.softcap, bias=bias, score_mod=mod)  # (N_q, N_k)
    lse = torch.logsumexp(S, dim=-1)  # (N_q,), -inf for a fully masked row
    if sink is not None:  # the sink is one more score column: lse = log(exp(sink) + sum_j exp(S_ij))
        lse = torch.logaddexp(lse, sink)
    P = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros_like(S), torch.exp(S - lse.unsqueeze(-1)))
    O = P @ v2  # (N_q, N_k) @ (N_k, D_v) -> (N_q, D_v); the sink's value is zero
    if dO is None:
        gen = torch.Generator().manual_seed(seed)
        dO = torch.randn(O.shape, generator=gen, dtype=dt).to(q2.device)
    else:
        dO = pick_matrix(dO, "dO", batch_index)
        if dO.shape != O.shape:
            raise AttentionValueError(f"dO must have the output's shape {tuple(O.shape)}, got {tuple(dO.shape)}")
    dO = dO.to(dt)
    return BackwardReplay(
        q=q2,
        k=k2,
        v=v2,
        O=O,
        lse=lse,
        dO=dO,
        delta=(dO * O).sum(-1),  # Alg. 2 line 4
        tiling=opts.mask.tiling(head.block_m, head.block_n),
        scale=opts.scale,
        softcap=opts.mask.softcap,
        batch_index=batch_index,
        block_m=head.block_m,
        block_n=head.block_n,
        sink=sink,
    )


def backward_of(
    r: Replay, *, dO: Tensor | None = None, seed: int = 0, source: str = "reference", deterministic: bool = False
) -> BackwardReplay:
    """The backward replay of the inputs and options of the forward replay ``r`` (made by :func:`.replay.replay`);
    ``source`` and ``deterministic`` as :func:`replay_backward`'s."""
    q, k, v = r.inputs
    assert r.call is not None  # r.inputs raised otherwise
    return backward_from(q, k, v, dO, seed, r.call.options, source, deterministic)  # the forward's keywords, whole
