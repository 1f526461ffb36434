"""Attention over packed variable-length sequences: flash-attn's ``flash_attn_varlen_func``.

A batch of sequences of different lengths is stored back to back, without padding::

    q (total_q, H_q, D)    k (total_k, H_kv, D)    v (total_k, H_kv, D_v)
    sequence b: query rows cu_seqlens_q[b] : cu_seqlens_q[b + 1], keys cu_seqlens_k[b] : cu_seqlens_k[b + 1]

and each sequence attends only within itself. The packed tensors are viewed (no copy) as one batch element
``(H, total, D)`` and run by the same tiled CPU paths as :func:`flashattn_teach.flash_attention`, with the
packed sequences in the mask contract (:mod:`flashattn_teach.masks.packed`): the tiles off the block diagonal are
never visited,
so the work is ``O(sum_b len_q[b] len_k[b])`` up to tiles cut by sequence boundaries, and no tensor of
``total_q x total_k`` elements is built (except by ``backend="dense"``, the oracle).

Dropout follows from that view: the keep mask of :mod:`flashattn_teach.dropout` is drawn for the packed
``total_q x total_k`` score matrix of one batch element, so weight ``P[h, i, j]`` (query head h, packed
query row i, packed key column j) has the counter::

    counter = offset + (h * total_q + i) * total_k + j,     i = cu_seqlens_q[b] + i',  j = cu_seqlens_k[b] + j'

for row i' and column j' of sequence b. Every (head, row, column) has its own counter, so no two sequences
share draws (counters per sequence, ``((b H_q + h) len_q[b] + i') len_k[b] + j'``, would collide when the
lengths differ). The CPU paths draw it as for any ``(H, total, D)`` input; the Triton kernels, which run a
sequence per program in its own coordinates, shift the offset by the sequence's start rows
(:func:`flashattn_teach.triton.kernels.dropout._packed_dropout`), and draw the same bits.
"""

from __future__ import annotations

from typing import Annotated, Literal, overload

import torch
from torch import Tensor
from typing_extensions import Unpack

from .._autocast import cast_inputs
from .._options import PackedKeywords, make_options, make_packed_options
from .._validate.inputs import check_bool
from .._validate.keywords import Default, collects_keywords
from .._validate.varlen import PackedBounds, check_max_seqlen_type, check_packed_qkv
from ..dispatch import planner, public_backend, runner
from ..ops import varlen as ops_varlen
from ..ops.attention import traceable
from ..serving.varlen_pages import gather_paged_keys


class VarlenKeywords(PackedKeywords, total=False):
    """:func:`flash_attention_varlen`'s keywords: the shared ones a packed call takes
    (:class:`flashattn_teach._options.PackedKeywords`), a paged cache's ``block_table`` and the backend."""

    block_table: Annotated[Tensor | None, Default(None)]  # (B, max_blocks): k, v are page pools
    backend: Annotated[str, Default("auto")]


# The one pair of signatures kept written out: return_lse decides the result's type, which mypy reads from them.
@overload
def flash_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    return_lse: Literal[False] = False,
    **options: Unpack[VarlenKeywords],
) -> Tensor: ...
@overload
def flash_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    return_lse: Literal[True],
    **options: Unpack[VarlenKeywords],
) -> tuple[Tensor, Tensor]: ...


@collects_keywords(causal_align="bottom_right")
def flash_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    options: VarlenKeywords,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over ``B`` packed sequences, each attending only within itself (flash-attn's varlen).

    Args:
        q: ``(total_q, H_q, D)``; k: ``(total_k, H_kv, D)``; v: ``(total_k, H_kv, D_v)``; ``H_q`` a
            multiple of ``H_kv`` (grouped-query attention as in flash-attn: query head h reads key/value
            head ``h // (H_q // H_kv)``).
        cu_seqlens_q, cu_seqlens_k: int32 or int64 ``(B + 1,)``: 0, then the end of each sequence on the
            packed axis (``cu_seqlens_q[-1] = total_q``); empty sequences are allowed.
        max_seqlen_q, max_seqlen_k: at least the longest query and key sequence (checked; the CPU paths
            take the lengths from ``cu_seqlens``).
        causal: causal masking within each sequence. ``causal_align`` defaults to ``"bottom_right"``, as
            flash-attn's varlen functions align it per sequence (query i' of sequence b sees keys
            ``j' <= i' + len_k[b] - len_q[b]``, the decode-step convention); note that
            :func:`flashattn_teach.flash_attention` defaults to ``"top_left"``, torch's. With equal query
            and key lengths the two agree.
        scale: softmax scale, default ``1 / sqrt(D)``.
        window: ``(left, right)``, flash-attn's sliding window in each sequence's own coordinates
            (-1: unbounded); the causal offset above is its diagonal.
        softcap: scores become ``softcap * tanh(score / softcap)`` before any bias or mask.
        alibi_slopes: ``(H_q,)`` or ``(B, H_q)``: ``-slope * |i' + off_b - j'|`` added to the scores, in
            each sequence's coordinates. Not differentiated except by ``backend="dense"``.
        dropout_p: zero each attention weight with this probability and scale the rest by
            ``1 / (1 - dropout_p)`` (``lse`` stays undropped), as :func:`flashattn_teach.flash_attention`;
            the keep mask is drawn over the packed matrix (see the module's docstring), the same on every
            backend, and drawn again by the backward.
        deterministic: a bitwise reproducible backward, as :func:`flashattn_teach.flash_attention`'s.
        sinks: attention sinks ``(H_q,)``, one logit per query head counted in every row's softmax as a key
            of value zero, as :func:`flashattn_teach.flash_attention`'s (``lse = sink_h`` for a row that
            sees no key). Under ``torch.compile`` a call with sinks runs the eager path (the packed op does
            not carry them).
        block_table: int32 (or int64) ``(B, max_blocks)``, flash-attn's paged KV cache (vLLM's chunked
            prefill): ``k (num_blocks, H_kv, page_size, D)`` and ``v (num_blocks, H_kv, page_size, D_v)``
            are then page pools (this library's head-major layout; flash-attn's ``(num_blocks, page_size,
            H_kv, D)`` pools are passed as ``.transpose(1, 2)``, a view; any page size from 1), and sequence
            b's ``n_b = cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` keys are positions ``[0, n_b)`` of its pages:
            key j at page ``block_table[b, j // page_size]``, slot ``j % page_size``. Checked first: the
            table has a row per sequence, ``n_b <= max_blocks * page_size``, and the ids of the pages read
            lie in ``[0, num_blocks)`` (read on the host on every device, as ``cu_seqlens_k`` is; entries
            past a sequence's pages may hold anything). The keys are then gathered into one packed
            ``(total_k, H_kv, D)`` copy (:mod:`flashattn_teach.serving.varlen_pages`: those keys alone) and run
            as above on every backend: the Triton prefill kernel does not walk pages itself (the decode
            kernel of :func:`flashattn_teach.flash_attention_with_kvcache` does). Read-only (nothing is
            appended), and differentiable into the pools through the gather. Under ``torch.compile`` the
            checks and the gather break the graph (they read ``cu_seqlens_k`` and the table on the host).
        backend: ``"auto"`` (the fused Triton kernels for CUDA tensors they can run, else the threaded
            CPU path, or the query-major reference under a torch.func transform or for other CUDA
            tensors), ``"triton"`` (raises, with the reason, where the kernels cannot run the call),
            ``"parallel"``, ``"query_major"``, ``"key_major"`` or ``"dense"`` (the oracle, holding
            ``H_q x total_q x total_k`` scores).
        return_lse: also return ``lse`` of shape ``(H_q, total_q)`` (flash-attn's layout), float32
            (float64 for float64 inputs).

    Returns:
        ``O`` of shape ``(total_q, H_q, D_v)`` in ``q``'s dtype and, with ``return_lse``, ``lse``.
        Differentiable with respect to ``q, k, v`` (the pools, with ``block_table``) by autograd. A query
        row that sees no key (a window or a bottom-right causal offset can leave one) gives 0 and
        ``lse = -inf`` (``sink_h`` with sinks).
    """
    block_table = options["block_table"]
    if block_table is not None:  # k, v are page pools: gather the keys into the packed layout, then as below
        k, v = gather_paged_keys(q, k, v, cu_seqlens_k, block_table)
    q, k, v = cast_inputs(q, k, v)  # after the gather: autocast casts the keys read, not the whole pools
    lse_wanted = check_bool("return_lse", return_lse)
    backend = public_backend(options["backend"])
    bounds = PackedBounds(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    alibi_slopes = options["alibi_slopes"]
    if torch.compiler.is_compiling() and traceable(None, alibi_slopes):
        # One opaque op in the graph: the bounds stay tensors, so a new packing does not recompile. The
        # arguments that need no look into the bounds are checked here, as in eager mode; the op checks the
        # rest when it runs. What the op does not carry (sinks) runs eagerly, below.
        check_packed_qkv(q, k, v)
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            check_max_seqlen_type(name, value)
        qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))
        opts = make_options(qh, kh, vh, options, enable_gqa=True, alibi_slopes=None)  # the op checks the slopes
        args = ops_varlen.of_call(bounds, alibi_slopes, opts, backend, scale_given=options["scale"] is not None)
        if args is not None:
            O, lse = ops_varlen.call(q, k, v, args)
            return (O, lse) if lse_wanted else O
    qh, kh, vh, opts = make_packed_options(q, k, v, bounds, options)
    O, lse = runner.run(planner.plan(qh, kh, vh, opts, backend), qh, kh, vh, opts)
    O = O.transpose(0, 1).contiguous()  # (H_q, total_q, D_v) -> (total_q, H_q, D_v), flash-attn's layout
    return (O, lse) if lse_wanted else O
