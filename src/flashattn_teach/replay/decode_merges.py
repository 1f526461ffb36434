"""The merges of a decode step's replay: the split-KV partials folded together, one merge at a time.

Each merge combines the running result ``(O_a, lse_a)`` with the next split's ``(O_b, lse_b)`` by
:func:`flashattn_teach.merge_attention_states` (``merge.py``), and records, per query row::

    lse = log(exp(lse_a) + exp(lse_b)),   w_a = exp(lse_a - lse),   w_b = exp(lse_b - lse)

and ``max |O - O_final|`` against the dense output of the whole step. The merge is exact, commutative and
associative, so any ``order`` ends at the same result up to round-off.

An attention sink joins once per row, after every split (as ``decode/ranges.py``'s ``merge_sinks``): one more
merge, with the partial of one key of score ``sink_h`` and value zero, ``(O_b = 0, lse_b = sink_h)``
(:func:`merge_sink`); its ``w_b = exp(sink_h - lse)`` is the sink's share of each row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import AttentionValueError
from ..merge import merge_attention_states
from .step import Step, StepEquation, StepKind, numbers

__all__ = ["Partial", "check_merge_order", "fold_merges", "merge_sink", "merge_step"]

Partial = tuple[int, Tensor, Tensor]  # (split s, O_s (N_new, D_v), lse_s (N_new,))


def merge_step(
    index: int,
    merged: tuple[int, ...],
    split: int | None,
    a: tuple[Tensor, Tensor],
    b: tuple[Tensor, Tensor],
    O_final: Tensor,
) -> Step:
    """MERGE ``index``: ``a = (O_a, lse_a)`` of the splits ``merged`` with ``b = (O_b, lse_b)`` of split ``split``
    (None: the attention sink, ``O_b = 0``, ``lse_b = sink_h``), by :func:`flashattn_teach.merge_attention_states`.
    Its terms: ``lse_a, lse_b, lse, w_a, w_b (N_new,)`` and ``O, O_a, O_b (N_new, D_v)``; its equations give each
    but the inputs with the numbers put in, then the result (a row with ``lse = -inf`` saw no key: its weights are
    0, as the code takes them, not ``exp(-inf - -inf)``); ``max_diff`` is ``max |O - O_final|`` over every row."""
    (O_a, lse_a), (O_b, lse_b) = a, b
    O, lse = merge_attention_states(O_a, lse_a, O_b, lse_b)
    w_a, w_b = merge_weights(lse_a, lse_b, lse)
    terms = {"lse_a": lse_a, "lse_b": lse_b, "lse": lse, "w_a": w_a, "w_b": w_b, "O": O, "O_a": O_a, "O_b": O_b}
    max_diff = float((O - O_final).abs().max())
    equations = (
        StepEquation(
            None, "lse", "log(exp(lse_a) + exp(lse_b))", f"log(exp({numbers(lse_a)}) + exp({numbers(lse_b)}))", lse
        ),
        StepEquation(None, "w_a", "exp(lse_a - lse)", f"exp({numbers(lse_a)} - {numbers(lse)})", w_a),
        StepEquation(None, "w_b", "exp(lse_b - lse)", f"exp({numbers(lse_b)} - {numbers(lse)})", w_b),
        StepEquation(
            None, "O", "w_a O_a + w_b O_b", f"{numbers(w_a)} {numbers(O_a)} + {numbers(w_b)} {numbers(O_b)}", O
        ),
    )
    return Step(
        StepKind.MERGE,
        index,
        terms,
        tuple(e.with_result() for e in equations),
        max_diff=max_diff,
        merged=merged,
        split=split,
    )


def merge_weights(lse_a: Tensor, lse_b: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """``w_a = exp(lse_a - lse)``, ``w_b = exp(lse_b - lse)``; 0 and 0 for a row that saw no key in either
    (``lse = -inf``: subtract 0 instead, as ``merge.py`` does, so no NaN)."""
    lse_safe = torch.where(torch.isneginf(lse), 0.0, lse)
    return torch.exp(lse_a - lse_safe), torch.exp(lse_b - lse_safe)


def check_merge_order(merge_order: Sequence[int] | None, num_splits: int) -> list[int]:
    """``merge_order`` as a permutation of ``range(num_splits)`` (default: in order), else a named error."""
    if merge_order is None:
        return list(range(num_splits))
    order = list(merge_order)
    if sorted(order) != list(range(num_splits)):
        raise AttentionValueError(
            f"merge_order must list every split 0..{num_splits - 1} once (num_splits={num_splits}), got {order}"
        )
    return order


def fold_merges(
    partials: Sequence[Partial], order: Sequence[int], O_final: Tensor
) -> tuple[tuple[Step, ...], Tensor, Tensor]:
    """Fold the non-empty splits' ``partials`` in ``order`` (splits without a partial are skipped, as
    :mod:`flashattn_teach.serving.api` skips empty ranges); returns the merges and the merged ``(O, lse)``."""
    by_split = {s: (O_s, lse_s) for s, O_s, lse_s in partials}
    parts = [(s, *by_split[s]) for s in order if s in by_split]
    first, O, lse = parts[0]
    merged: tuple[int, ...] = (first,)
    steps = []
    for n, (s, O_b, lse_b) in enumerate(parts[1:]):
        step = merge_step(n, merged, s, (O, lse), (O_b, lse_b), O_final)
        steps.append(step)
        O, lse, merged = step["O"], step["lse"], (*merged, s)
    return tuple(steps), O, lse


def merge_sink(index: int, merged: tuple[int, ...], O: Tensor, lse: Tensor, sink: Tensor, O_final: Tensor) -> Step:
    """Merge ``index``: the merged splits' ``(O, lse)`` with the sink's partial ``(0, sink_h)`` (``sink (1,)``);
    a row that saw no key (``lse = -inf``) ends at ``O = 0``, ``lse = sink_h``."""
    lse_b = sink.to(lse.dtype).expand_as(lse)  # (1,) -> (N_new,)
    return merge_step(index, merged, None, (O, lse), (torch.zeros_like(O), lse_b), O_final)
