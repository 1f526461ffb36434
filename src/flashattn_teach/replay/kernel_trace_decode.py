"""The decode kernel's own numbers in a decode step's replay (``replay_decode(..., source="triton")``).

:func:`flashattn_teach.serving.launch_trace.trace_decode` runs the split-KV decode kernel's trace build
(``triton/kernels/decode.py``, ``TRACE=True``; :mod:`flashattn_teach.triton.kernels.trace_decode`) for the
replayed head: after each key block ``j`` of split ``s`` its program stores, per query row,

    [ s2 = S_ij log2(e) (BLOCK_N) | m_i (base 2) | l_i | alpha | acc, unnormalised (BLOCK_DV) ]

and the kernel's partials ``(O_s, lse_s)`` and merged ``(O, lse)`` are kept. :class:`DecodeKernelTrace` reads
them back in the reference's units and names: each split's UPDATE gets ``S_ij, m_i, l_i, alpha, acc_new`` (its
last also ``O_partial``, the kernel's ``O_s``), each MERGE the kernel's partial of the split it merges in
(``O_b, lse_b``), the first also the first split's (``O_a, lse_a``), the last the kernel's merged ``O, lse``
(the combine kernel merges all splits in one loop: its running values between merges are not traced).

The kernel cuts its keys into whole key blocks per split and tiles in powers of two >= 16, so the replay is made
at the kernel's ``BLOCK_N`` and split ranges (:data:`NOTE` and the replay's note say what changed). On a CPU the
kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set before its module's first import:
:func:`~flashattn_teach.serving.launch_trace.import_kernel`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor

from ..errors import AttentionValueError
from ..serving import launch_trace
from .step import Step

__all__ = ["NOTE", "UPDATE_TERMS", "DecodeKernelTrace", "kernel_block_n", "run_decode_trace"]

UPDATE_TERMS = ("S_ij", "m_i", "l_i", "alpha", "acc_new")  # a split's UPDATE, by the reference's names
LN2 = math.log(2.0)  # m_e = m_2 ln 2
NOTE = (
    "The decode kernel's numbers (triton/kernels/decode.py, its trace build) beside the reference's. Why they "
    "differ: (1) exp2 and the folded scale: the kernel computes s = (q . k) * qk_scale with qk_scale = scale * "
    "log2(e) (softcap and ALiBi in base 2 too) and P = exp2(s - m), so its m_i is in base 2, shown as m_i * ln 2 "
    "and S_ij as s * ln 2 (l_i, alpha, acc are the same numbers in either base). (2) The operand dtype: P is cast "
    "to V's dtype before the MMA, so with float16 inputs acc carries float16's rounding of P; float64 inputs run "
    "rounded to float32. (3) The split boundaries: the kernel gives each split ceil(blocks / num_splits) whole "
    "key blocks of BLOCK_N keys (a power of two >= 16), the replay here uses the same. (4) The merge's order "
    "and form: the combine kernel folds the float32 partials split after split as an online softmax in base e "
    "(m, l, acc), the reference merges pairs (O, lse) in its own dtype; only the partials and the result are traced."
)


def kernel_block_n(block_n: int) -> int:
    """The kernel's ``BLOCK_N`` for a replay's: rounded up to a power of two >= 16 (``tl.dot``'s minimum)."""
    return max(16, 1 << (block_n - 1).bit_length())


@dataclass(frozen=True)
class DecodeKernelTrace:
    """One traced decode step (:class:`~flashattn_teach.serving.launch_trace.DecodeTrace`) and the value head
    dim ``D_v`` that reads its records."""

    trace: Any  # serving.launch_trace.DecodeTrace
    D_v: int

    @property
    def block_n(self) -> int:
        return int(self.trace.block_n)

    def ranges(self, lo: int, L: int) -> tuple[tuple[int, int], ...]:
        """The kernel's split ranges of the keys ``[lo, L)``: whole key blocks per split."""
        return launch_trace.kernel_split_ranges(lo, L, self.trace.num_splits, self.block_n)

    def attach(self, splits: Sequence[Any], merges: Sequence[Step]) -> tuple[tuple[Any, ...], tuple[Step, ...]]:
        """The replay's splits with their updates reading this trace (``Steps.kernel_terms``) and its merges
        with the kernel's partials (:meth:`merge_terms`)."""
        read = tuple(
            replace(s, steps=replace(s.steps, kernel_terms=partial(self.update_terms, s.index))) for s in splits
        )
        last = len(merges) - 1
        return read, tuple(replace(m, kernel=self.merge_terms(m, last=i == last)) for i, m in enumerate(merges))

    def update_terms(self, split: int, step: Step) -> dict[str, Tensor]:
        """Record ``(split, step.j)``, cut to the step's ``Bc`` keys and ``D_v`` lanes, in base e, float64
        (``step.cols`` relative to the split's first key, as :class:`~.steps.Steps` yields them)."""
        c0, c1 = step.cols
        BN = self.block_n
        rec = self.trace.records[split, step.j].double()  # (N_new, W)
        if torch.isnan(rec[:, BN]).any():
            raise AttentionValueError(
                f"the decode kernel did not trace key block {step.j} of split {split}, which the replay visits"
            )
        terms = {
            "S_ij": rec[:, : c1 - c0] * LN2,  # (N_new, Bc): s2 = S_ij log2 e
            "m_i": rec[:, BN] * LN2,  # (N_new,): base 2 -> base e
            "l_i": rec[:, BN + 1],
            "alpha": rec[:, BN + 2],
            "acc_new": rec[:, BN + 3 : BN + 3 + self.D_v],  # (N_new, D_v)
        }
        if step.last:  # the split's partial O_s = acc / l_i, as the kernel wrote it before the merge
            terms["O_partial"] = self.trace.O_part[split].double()
        return terms

    def merge_terms(self, step: Step, last: bool) -> dict[str, Tensor]:
        """The kernel's partials of a MERGE's splits, and its merged result on the ``last`` merge, float64."""
        O_part, lse_part = self.trace.O_part.double(), self.trace.lse_part.double()
        terms: dict[str, Tensor] = {}
        if step.index == 0:
            terms |= {"lse_a": lse_part[step.merged[0]], "O_a": O_part[step.merged[0]]}
        assert step.split is not None  # the trace build takes no sink
        terms |= {"lse_b": lse_part[step.split], "O_b": O_part[step.split]}
        if last:
            terms |= {"lse": self.trace.lse.double(), "O": self.trace.O.double()}
        return terms


def run_decode_trace(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    step: Any,
    *,
    batch: int,
    head: int,
    block_n: int,
) -> tuple[DecodeKernelTrace, str]:
    """Run the decode kernel's trace build (checked inputs, a ``serving.checks.DecodeStep``; what the trace
    build does not run refused by name) at the kernel's ``BLOCK_N`` for ``block_n``; float64 inputs are rounded
    to float32 for it. Returns the trace and a note saying what the replay takes from the kernel."""
    launch_trace.import_kernel()
    launch_trace.check_trace_step(step)
    kernel_n = kernel_block_n(block_n)
    tiles = f"The kernel's key blocks are {kernel_n} keys (a power of two >= 16), not {block_n}: " * (
        kernel_n != block_n
    )
    note = f"{tiles}the replay uses the kernel's BLOCK_N and split ranges."
    if q.dtype == torch.float64:
        note += " The kernel computes in float32 at most: it ran on the float64 inputs rounded to float32."
        q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
        k, v = (None if t is None else t.float() for t in (k, v))
    trace = launch_trace.trace_decode(q, k_cache, v_cache, k, v, step, batch=batch, head=head, block_n=kernel_n)
    return DecodeKernelTrace(trace, v_cache.shape[-1]), note
