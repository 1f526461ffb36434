"""Tile replay of one decode step: the tile updates inside each split-KV range, then the merges.

A decode step (:func:`flashattn_teach.flash_attention_with_kvcache`, :mod:`flashattn_teach.serving`)
writes ``N_new_kv`` new keys and values into the cache at ``[n, n + N_new_kv)`` (``n = cache_seqlens[b]``),
cuts the keys ``[lo, L)`` (``L = n + N_new_kv``; ``lo > 0`` only with a window's left side) into
``num_splits`` ranges, attends the ``N_new`` new queries over each range alone, and merges the partial
results exactly (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"). For one
batch element and one query head, the replay records:

1. per range ``s = [s0, s1)``: the tile updates of the ``N_new`` query rows (one query block), ``BLOCK_N``
   keys per tile from ``s0`` on, masked in global key positions (row ``i`` at ``L - N_new + i``), exactly
   as the prefill replay's :class:`~.steps.Steps`; then the range's partial result
   ``O_s = acc / l_i`` and ``lse_s = m_i + log(l_i)`` (``-inf`` for a row that sees no key of the range);
2. per merge (:mod:`.decode_merges`) of the running result ``(O_a, lse_a)`` with the next range's ``(O_b, lse_b)``
   (:func:`flashattn_teach.merge_attention_states`)::

       lse = log(exp(lse_a) + exp(lse_b)),   w_a = exp(lse_a - lse),   w_b = exp(lse_b - lse),
       O   = w_a O_a + w_b O_b

   and ``max |O - O_final|`` against the dense float64 output of the whole step, which reaches round-off
   at the last merge. The merge is associative and commutative: ``merge_order`` replays any order.

With a ``block_table`` (a paged cache) the replay gathers the element's pages into its copy and records
them: ``pages`` the block ids of its pages in key order, and :meth:`DecodeReplay.page_of` the page and slot
of a key (``block_table[b, j // page_size]``, ``j % page_size``), which the renderers show per key.

With attention sinks (``sinks (H_q,)``, as for the decode call) the replayed head's ``sink_h`` joins once
per row after the splits' merges, as the decode adds it: one more merge with ``(O = 0, lse = sink_h)``,
whose weight ``w_b = exp(sink_h - lse)`` is the sink's share of the row (:func:`.decode_merges.merge_sink`).

Empty ranges (more splits than keys) are not run and not merged, as in :mod:`flashattn_teach.serving.api`. The caches
are not written: the replay reads a copy with ``k, v`` in place. ``source="triton"``: the steps also carry the
decode kernel's own numbers (``step.kernel``, :mod:`.kernel_trace_decode`), at its ``BLOCK_N`` and split ranges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import ClassVar

import torch
from torch import Tensor

from .._layout import compute_dtype
from .._options import AttentionOptions
from .._validate.inputs import check_bool, check_scale, check_softcap, check_window, validate_block_sizes
from .._validate.sinks import check_sinks
from ..core.online_softmax import init_state, log_sum_exp
from ..errors import AttentionValueError
from ..reference.dense import dense_forward
from ..serving.checks import (
    DecodeStep,
    check_cache_inputs,
    check_cache_seqlens,
    check_decode_alibi,
    check_num_splits,
    check_room,
)
from ..serving.page_checks import check_block_ids, check_block_table, check_page_shapes
from ..serving.pages import element_caches
from ..serving.ranges import range_options
from ..serving.splitkv import default_num_splits, split_ranges
from .decode_merges import check_merge_order, fold_merges, merge_sink
from .inputs import check_index
from .kernel_trace_decode import DecodeKernelTrace, kernel_block_n, run_decode_trace
from .step import Step
from .steps import Steps

__all__ = ["DecodeReplay", "KeyRole", "SplitReplay", "replay_decode"]


class KeyRole(Enum):
    """A cache slot during the step; every renderer labels the keys with these."""

    OLD = "old"  # [0, n): cached by earlier steps
    NEW = "new"  # [n, L): written by this step
    UNUSED = "unused"  # [L, N_max): never read


@dataclass(frozen=True)
class SplitReplay:
    """Split ``index``, keys ``[s0, s1)``: its tile updates (iterate; ``cols`` in global key positions) and
    its partial result ``O_s (N_new, D_v)``, ``lse_s (N_new,)``."""

    index: int
    keys: tuple[int, int]
    steps: Steps  # columns relative to s0
    O_s: Tensor
    lse_s: Tensor

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[Step]:
        s0 = self.keys[0]
        for step in self.steps:
            c0, c1 = step.cols
            yield replace(step, cols=(s0 + c0, s0 + c1), completed_columns=s0 + c0)


@dataclass(frozen=True)
class DecodeReplay:
    """One decode step of batch element ``batch_index``, query head ``head``: splits, then merges.

    ``ranges`` are all ``num_splits`` key ranges (empty ones included), ``splits`` the non-empty ones;
    ``O, lse`` the merged result, ``O_final, lse_final`` the dense float64 oracle; ``visible (N_new, N_max)``
    which scores count. ``window`` is ``(left, right)`` with causal folded in (``-1``: unbounded)."""

    cache_len: int
    N_new_kv: int
    N_new: int
    N_max: int
    block_n: int
    num_splits: int
    keys: tuple[int, int]
    ranges: tuple[tuple[int, int], ...]
    splits: tuple[SplitReplay, ...]
    merges: tuple[Step, ...]
    O: Tensor
    lse: Tensor
    O_final: Tensor
    lse_final: Tensor
    visible: Tensor
    causal: bool
    window: tuple[int, int]
    softcap: float | None
    alibi_slope: float | None
    scale: float
    batch_index: int
    head: int
    page_size: int | None = None  # a paged cache: slots per page
    pages: tuple[int, ...] = ()  # the block ids of the element's pages [0, ceil(L / page_size)), in key order
    sink: float | None = None  # sink_h of the replayed head, merged in last; None without sinks
    source: str = "reference"  # "triton": steps carry the decode kernel's numbers (.kernel_trace_decode)
    note: str = ""  # source="triton": what the replay changed to follow the kernel (its BLOCK_N, the dtype)
    kernel: DecodeKernelTrace | None = None  # source="triton": the trace its steps read (and the kernel's O, lse)
    # notebook.decode_notebook_html, installed by the trace package's __init__: notebook imports this module
    # (through html), so this module cannot import it (no import cycles).
    notebook_page: ClassVar[Callable[[DecodeReplay], str] | None] = None
    replay_kind: ClassVar[str] = "decode"  # the scenario, "replayKind" in its JSON

    def all_steps(self) -> Iterator[Step]:
        """Every step, in the order it runs: each split's UPDATEs, then the MERGEs (the sink's last)."""
        for split in self.splits:
            yield from split
        yield from self.merges

    def _repr_html_(self) -> str | None:
        """Jupyter's rich display: the decode page in an ``<iframe srcdoc>`` (:mod:`.notebook`)."""
        render = DecodeReplay.notebook_page
        return None if render is None else render(self)

    @property
    def L(self) -> int:
        """Keys after the step: ``cache_len + N_new_kv``."""
        return self.cache_len + self.N_new_kv

    @property
    def max_diff(self) -> float:
        """``max |O - O_final|``: the merged result against the dense oracle."""
        return float((self.O.to(self.O_final.dtype) - self.O_final).abs().max()) if self.O.numel() else 0.0

    def role(self, key: int) -> KeyRole:
        """Whether cache slot ``key`` was cached before, written by this step, or is unused."""
        return KeyRole.OLD if key < self.cache_len else KeyRole.NEW if key < self.L else KeyRole.UNUSED

    def page_of(self, key: int) -> tuple[int, int] | None:
        """``(block id, slot)`` of cache position ``key`` in a paged cache; None when not paged or past the
        element's pages."""
        if self.page_size is None or key // self.page_size >= len(self.pages):
            return None
        return self.pages[key // self.page_size], key % self.page_size

    def split_of(self, key: int) -> int | None:
        """The split whose range holds ``key``, or None (unused, or before a window's reach)."""
        return next((s for s, (s0, s1) in enumerate(self.ranges) if s0 <= key < s1), None)

    def labels(self) -> list[str]:
        """The masking options, one short label each, for headings."""
        labels = ["causal (bottom_right)"] if self.causal else []
        if self.window[0] >= 0 or (self.window[1] >= 0 and not self.causal):
            labels.append(f"window {self.window}")
        if self.softcap is not None:
            labels.append(f"softcap {self.softcap:g}")
        if self.alibi_slope is not None:
            labels.append(f"alibi slope {self.alibi_slope:g}")
        if self.sink is not None:
            labels.append(f"sink {self.sink:g}")
        return labels


@dataclass(frozen=True)
class _Settings:
    """The call's masking options, as every key range reads them (checked, ``scale`` resolved)."""

    causal: bool
    scale: float
    window: tuple[int, int]
    softcap: float | None
    alibi_slopes: Tensor | None  # (1,): the replayed head's slope


def _options(q: Tensor, k: Tensor, v: Tensor, settings: _Settings, *, offset: int) -> AttentionOptions:
    """Options of the rows ``q (1, 1, N_new, D)`` over the keys ``k, v`` of one range, with the diagonal
    offset that puts row ``i`` at global key position ``L - N_new + i``, built as :mod:`flashattn_teach.serving.api`
    builds them."""
    return range_options(
        q,
        k,
        v,
        causal=settings.causal,
        scale=settings.scale,
        window=settings.window,
        softcap=settings.softcap,
        alibi_slopes=settings.alibi_slopes,
        offset=offset,
    )


def _split(
    s: int,
    keys: tuple[int, int],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    O_final: Tensor,
    settings: _Settings,
    *,
    block_n: int,
) -> SplitReplay:
    """Split ``s`` over ``keys = [s0, s1)`` of ``k, v (1, 1, L, D)``: its tile updates and partial result."""
    s0, s1 = keys
    L, N_new = k.shape[2], q.shape[2]
    opts = _options(q, k[:, :, s0:s1], v[:, :, s0:s1], settings, offset=L - N_new - s0)
    tiling = opts.mask.tiling(N_new, block_n)  # the N_new rows are one query block
    steps = Steps.of_block(q[0, 0], k[0, 0, s0:s1], v[0, 0, s0:s1], tiling, 0, O_final, scale=opts.scale)
    m_i, l_i, acc = init_state((N_new,), v.shape[-1], dtype=q.dtype, device=q.device)
    O_s = acc
    for step in steps:  # run once for the range's result; iterating again recomputes the steps
        m_i, l_i, O_s = step["m_i"], step["l_i"], step["O_partial"]
    return SplitReplay(index=s, keys=keys, steps=steps, O_s=O_s, lse_s=log_sum_exp(m_i, l_i))


def replay_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    *,
    cache_seqlens: Tensor | int,
    block_n: int,
    num_splits: int = 0,
    batch_index: int = 0,
    head: int = 0,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    merge_order: Sequence[int] | None = None,
    block_table: Tensor | None = None,
    sinks: Tensor | None = None,
    source: str = "reference",
) -> DecodeReplay:
    """Replay one step of ``flash_attention_with_kvcache`` for batch element ``batch_index``, query head
    ``head``: the tile updates of each split-KV range, then the merges.

    Args:
        q, k_cache, v_cache, k, v, cache_seqlens, causal, scale, window, softcap, alibi_slopes, num_splits:
            as for :func:`flashattn_teach.flash_attention_with_kvcache`, with its defaults (``causal=False``;
            layout ``(B, H, N, D)``); the caches are NOT written (the replay reads a copy with ``k, v`` in
            place). ``num_splits=0`` chooses as the decode does (1 on the CPU).
        block_n: ``BLOCK_N``, keys per tile inside a range (tiles start at the range's first key).
        batch_index, head: the batch element and the query head replayed (key/value head ``head // G``).
        merge_order: the order the ranges' partials are merged in, a permutation of ``range(num_splits)``
            (default in order, as the decode merges them).
        block_table: ``(B, max_blocks)`` for a paged cache, ``k_cache, v_cache`` then pools of pages
            ``(num_blocks, H_kv, page_size, D)``, as for the decode call.
        sinks: ``(H_q,)`` attention sinks, as for the decode call; head ``head``'s joins after the merges.
        source: ``"reference"``, or ``"triton"``: every step also carries the decode kernel's numbers
            (``step.kernel``, ``step.kernel_diff``; :mod:`.kernel_trace_decode`), the replay made at the kernel's
            ``BLOCK_N`` (``block_n`` rounded up to a power of two >= 16) and split ranges; contiguous caches, no
            sinks, the kernel's merge order; float32 or float16 on a CPU (Triton's interpreter).

    Returns:
        A :class:`DecodeReplay`, computed in float64 for float64 inputs and float32 otherwise; the oracle
        ``O_final`` is always dense float64.

    Raises:
        AttentionTypeError, AttentionValueError (also ``TypeError``, ``ValueError``): a bad argument, named.
    """
    q, k_cache, v_cache, k, v = check_cache_inputs(q, k_cache, v_cache, k, v, paged=block_table is not None)
    B, H_q, N_new, _ = q.shape
    table = check_block_table(block_table, B, q.device)
    H_kv = k_cache.shape[1]
    N_max = check_page_shapes(k_cache, table)[1] if table is not None else k_cache.shape[2]
    if N_new == 0:
        raise AttentionValueError(f"q must hold at least one new query to replay, got q of shape {tuple(q.shape)}")
    b = check_index("batch_index", batch_index, B, f"batch size B={B}")
    h = check_index("head", head, H_q, f"H_q={H_q} query heads")
    capacity = "k_cache.shape[2]" if table is None else "block_table.shape[1] * page_size"
    lengths = check_cache_seqlens(cache_seqlens, B, N_max, q.device, capacity=capacity)
    n = lengths[b]
    N_new_kv = 0 if k is None else k.shape[2]
    check_room([n], N_new_kv, N_max)
    if table is not None:
        check_block_ids(table[b : b + 1].cpu(), [n + N_new_kv], k_cache.shape[2], k_cache.shape[0])
    _, block_n = validate_block_sizes(N_new, block_n)
    splits = check_num_splits(num_splits) or default_num_splits(q, k_cache, n + N_new_kv)
    if source not in ("reference", "triton"):
        raise AttentionValueError(f"source must be 'reference' or 'triton', got {source!r}")
    if source == "triton":  # the cap on the splits of the kernel's BLOCK_N (launch.triton_decode's)
        splits = min(splits, -(-N_max // kernel_block_n(block_n)))
    order = check_merge_order(merge_order, splits)
    if source == "triton" and order != sorted(order):
        raise AttentionValueError(f'source="triton": the kernel merges its splits in order, got merge_order {order}')
    slopes = check_decode_alibi(alibi_slopes, B, H_q, q.device)
    sinks = check_sinks(sinks, H_q, q.device)
    sink = None if sinks is None else sinks[h].reshape(1).double()  # (1,): the replayed head's sink_h
    slope = None if slopes is None else (slopes[b, h] if slopes.dim() == 2 else slopes[h]).reshape(1)
    settings = _Settings(
        causal=check_bool("causal", causal),
        scale=check_scale(scale, q.shape[3]),
        window=check_window(window),
        softcap=check_softcap(softcap),
        alibi_slopes=slope,
    )

    kernel, note = None, ""
    if source == "triton":  # the kernel's trace first: it refuses what it does not run before any work
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
        s = settings
        step = DecodeStep(s.causal, s.scale, s.window, s.softcap, splits, "triton", seqlens, slopes, table, None, sinks)
        kernel, note = run_decode_trace(q, k_cache, v_cache, k, v, step, batch=b, head=h, block_n=block_n)
        block_n = kernel.block_n
    L = n + N_new_kv
    dt = compute_dtype(q.dtype)  # float64 for float64 inputs, else float32, as the references
    h_kv = h // (H_q // H_kv)
    pages: tuple[int, ...] = ()
    if table is None:
        keys, values = k_cache[b, h_kv].clone(), v_cache[b, h_kv].clone()  # (N_max, D), (N_max, D_v): a copy
    else:  # the element's cached keys [0, n) gathered from its pages into a copy; slots past them stay 0
        element = element_caches(k_cache, v_cache, table[b : b + 1])[0]
        pages = element.pages[: -(-(n + N_new_kv) // k_cache.shape[2])]
        keys, values = k_cache.new_zeros(N_max, k_cache.shape[3]), v_cache.new_zeros(N_max, v_cache.shape[3])
        if n:
            old_k, old_v = element.read(0, n)  # (1, H_kv, n, D), (1, H_kv, n, D_v)
            keys[:n], values[:n] = old_k[0, h_kv], old_v[0, h_kv]
    if k is not None and v is not None:
        keys[n:L], values[n:L] = k[b, h_kv], v[b, h_kv]  # the step's write, into the copy
    q1 = q[b, h][None, None]  # (1, 1, N_new, D): one head of one batch element
    k1, v1 = keys[None, None, :L], values[None, None, :L]  # (1, 1, L, D), (1, 1, L, D_v)

    # The oracle: dense float64 attention over [0, L), the same mask contract in global positions.
    q64, k64, v64 = q1.double(), k1.double(), v1.double()
    whole = replace(_options(q64, k64, v64, settings, offset=L - N_new), sinks=sink)
    O_final, lse_final = dense_forward(q64, k64, v64, whole)  # (1, 1, N_new, D_v), (1, 1, N_new)
    O_final, lse_final = O_final[0, 0], lse_final[0, 0]
    visible = torch.zeros(N_new, N_max, dtype=torch.bool, device=q.device)  # unused slots: never seen
    allowed, bias = whole.mask.dense(q.device)  # broadcastable to the scores (1, 1, N_new, L)
    visible[:, :L] = True
    if allowed is not None:
        visible[:, :L] &= torch.broadcast_to(allowed, (1, 1, N_new, L))[0, 0]
    if bias is not None:
        visible[:, :L] &= ~torch.isneginf(torch.broadcast_to(bias, (1, 1, N_new, L))[0, 0])

    # The keys some row's window reaches, cut into ranges exactly as decode.py cuts them.
    left = settings.window[0]
    lo = 0 if left < 0 else min(max(0, L - N_new - left), L)
    ranges = (
        tuple((lo + a, lo + c) for a, c in split_ranges(L - lo, splits)) if kernel is None else kernel.ranges(lo, L)
    )
    qc, kc, vc = q1.to(dt), k1.to(dt), v1.to(dt)
    parts = tuple(
        _split(s, r, qc, kc, vc, O_final, settings, block_n=block_n) for s, r in enumerate(ranges) if r[0] < r[1]
    )
    if parts:
        merges, O, lse = fold_merges([(p.index, p.O_s, p.lse_s) for p in parts], order, O_final)
    else:  # no key to see: O = 0, lse = -inf, as the decode returns
        merges, O, lse = (), torch.zeros_like(O_final, dtype=dt), torch.full((N_new,), float("-inf"), dtype=dt)
    if sink is not None:  # once per row, after every split
        merged = tuple(s for s in order if any(p.index == s for p in parts))
        last = merge_sink(len(merges), merged, O, lse, sink, O_final)
        merges, O, lse = (*merges, last), last["O"], last["lse"]
    if kernel is not None:  # each split's updates read its records, each merge the kernel's partials
        parts, merges = kernel.attach(parts, merges)
    return DecodeReplay(
        cache_len=n,
        N_new_kv=N_new_kv,
        N_new=N_new,
        N_max=N_max,
        block_n=block_n,
        num_splits=splits,
        keys=(lo, L),
        ranges=ranges,
        splits=parts,
        merges=merges,
        O=O,
        lse=lse,
        O_final=O_final,
        lse_final=lse_final,
        visible=visible,
        causal=whole.causal,
        window=(whole.mask.left, whole.mask.right),
        softcap=whole.mask.softcap,
        alibi_slope=None if slope is None else float(slope),
        scale=whole.scale,
        batch_index=b,
        head=h,
        page_size=None if table is None else k_cache.shape[2],
        pages=pages,
        sink=None if sink is None else float(sink),
        source=source,
        note=note,
        kernel=kernel,
    )
