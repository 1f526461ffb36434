"""Decoding against a KV cache, with split-KV (Flash-Decoding): flash-attn's ``flash_attn_with_kvcache``.

A decode step appends ``N_new_kv`` new keys and values to each batch element's cache and attends its
``N_new`` new queries (often 1) over everything cached so far. Batch element ``b`` holds
``cache_seqlens[b]`` valid entries before the step and ``L_b = cache_seqlens[b] + N_new_kv`` after it;
the keys are cut into ``num_splits`` ranges, each range gives a partial result, and the partials are merged
exactly (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"). One step,
``cache_seqlens[b] = 5``, ``N_new = N_new_kv = 2``, ``num_splits = 3``, ``N_max = 10``::

    k_cache[b]  | k0 k1 k2 k3 k4 | n0 n1 | .  .  . |      (v_cache[b] alike)
                  old entries     new     unused
                  0               5       7 = L_b      k, v written in place at [5, 7);
                                                       cache_seqlens is left as it was (5)

    split ranges of [0, L_b), ceil(7 / 3) = 3 keys each, the last one short; each range is attended
    alone, masked in global key positions, and the partial results are merged in any order:

        s = 0  keys [0, 3)  k0 k1 k2  ->  (O_0, lse_0) --+
                                                         +-- merge --> (O_01, lse_01) --+
        s = 1  keys [3, 6)  k3 k4 n0  ->  (O_1, lse_1) --+                              +-- merge --> (O, lse)
                                                                                        |    of q[b] over [0, L_b)
        s = 2  keys [6, 7)  n1        ->  (O_2, lse_2) ---------------------------------+

    merge (merge_attention_states):  lse = log(exp(lse_a) + exp(lse_b))
                                     O   = exp(lse_a - lse) O_a + exp(lse_b - lse) O_b

    causal, bottom-right per batch element: query row i sits at position L_b - N_new + i (x: visible)
                keys 0 1 2 3 4 5 6
        q 0 (at 5)   x x x x x x .        row 0 sees nothing of split 2: its lse_2 = -inf, and the
        q 1 (at 6)   x x x x x x x        merge ignores that partial for row 0

Masks in global key positions: query row ``i`` of batch element ``b`` sees key ``j < L_b`` iff
``j <= L_b - N_new + i`` (causal) and ``L_b - N_new + i - left <= j <= L_b - N_new + i + right``
(``window``), and ALiBi adds ``-slope * |L_b - N_new + i - j|``: flash-attn's kvcache alignment, to each
batch element's own length, as ``flash_attention``'s ``seqlens_k`` with ``causal_align="bottom_right"``
(see :mod:`flashattn_teach.masks`). Each range ``[s0, s1)`` is run as an ordinary
call on the views ``k_cache[b, :, s0:s1]`` with the mask contract's diagonal offset set to
``L_b - N_new - s0``, which puts row ``i``'s diagonal at global key ``L_b - N_new + i``; so one spec is
built per batch element and range, and the contract itself needs no per-batch offset.

Paged caches (``block_table``, vLLM's PagedAttention, Kwon et al. 2023; flash-attn's layout): the caches
are one pool of pages ``(num_blocks, H_kv, page_size, D)``, and row ``b`` of ``block_table (B, max_blocks)``
lists the pages of batch element ``b`` in key order; key ``j`` is slot ``j % page_size`` of page
``block_table[b, j // page_size]``. ``page_size = 4``, ``cache_seqlens[b] = 9``, one new key::

    block_table[b] = [ 6,            2,            9,            * ]      (*: past L_b, never read)
    pool page         6              2              9
    slots            k0 k1 k2 k3 | k4 k5 k6 k7 | k8 n0 .  .          n0 written in place at page 9,
    key position      0  1  2  3 |  4  5  6  7 |  8  9 10 11         slot 9 % 4 = 1; every other page of
                                                                     the pool is left as it was
    a range [3, 9) reads pages 6, 2, 9 alone: (H_kv, 3 * 4, D) gathered (a view when the pages are
    consecutive and adjacent in memory), sliced to its 6 keys

With ``cache_leftpad``, element ``b``'s keys start at ``cache_leftpad[b]`` instead of 0 (the ranges cut
``[cache_leftpad[b], L_b)``); with ``sinks``, each row's sink joins after the ranges' merge as one more
partial, ``(O = 0, lse = sink_h)``, so it is counted once however many ranges there are.

On the CPU the ranges run one after another, each on the tiled CPU paths (the threaded path spreads the
heads over its workers) at decode tiles of a few query rows by 2048 keys; with one new query, the ``G``
query heads of a key/value head run as ``G`` rows of that head, so each key is read once per key/value
head (:func:`flashattn_teach.serving.ranges.decode_one`). On CUDA the Triton decode kernel
(:mod:`flashattn_teach.triton.kernels.decode`) runs
the ranges as ``B x H_kv x num_splits`` programs at once, each taking the ``G x N_new`` query rows of one
key/value head, and merges the partials in a second small kernel; :mod:`flashattn_teach.serving.splitkv` says how
many splits fill the GPU.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor
from typing_extensions import Unpack

from .._options import DecodeKeywords
from .._validate.keywords import collects_keywords
from . import ops as ops_decode
from .checks import autocast_inputs
from .step import DecodeCall, decode_step


# The one pair of signatures kept written out: return_lse decides the result's type, which mypy reads from them.
@overload
def flash_attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    *,
    return_lse: Literal[False] = False,
    **options: Unpack[DecodeKeywords],
) -> Tensor: ...
@overload
def flash_attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    *,
    return_lse: Literal[True],
    **options: Unpack[DecodeKeywords],
) -> tuple[Tensor, Tensor]: ...


@collects_keywords()
def flash_attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    *,
    options: DecodeKeywords,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """One decode step against a KV cache: append ``k, v`` in place, attend ``q`` over the valid entries.

    Args:
        q: ``(B, H_q, N_new, D)``, the new queries; ``H_q`` a multiple of ``H_kv`` (grouped-query
            attention: query head h reads key/value head ``h // (H_q // H_kv)``).
        k_cache, v_cache: ``(B, H_kv, N_max, D)`` and ``(B, H_kv, N_max, D_v)``; entries
            ``[0, cache_seqlens[b])`` of batch element ``b`` are valid, the rest unused. With
            ``block_table``: pools of pages ``(num_blocks, H_kv, page_size, D)`` and ``(num_blocks, H_kv,
            page_size, D_v)``, any ``page_size >= 1`` and any strides (flash-attn's ``(num_blocks,
            page_size, H_kv, D)`` pools are passed as their ``.transpose(1, 2)`` views, never copied).
        k, v: ``(B, H_kv, N_new_kv, D)`` and ``(B, H_kv, N_new_kv, D_v)``, or both None. Written into the
            caches IN PLACE at ``[cache_seqlens[b], cache_seqlens[b] + N_new_kv)`` (an error if that passes
            ``N_max``) before attending. ``cache_seqlens`` is not updated (as in flash-attn): add
            ``N_new_kv`` to it for the next step.
        cache_seqlens: int32/int64 ``(B,)`` on ``q``'s device, or one int for every batch element: valid
            entries before this step. Batch element ``b`` attends over keys ``[0, L_b)``,
            ``L_b = cache_seqlens[b] + N_new_kv``. Each must lie in ``[0, N_max - N_new_kv]`` (room for the
            new entries); an int or a CPU tensor is checked on every path. The Triton path reads a CUDA
            tensor's values on the device only (no host synchronisation in a decode loop): they are not
            checked there, but clamped to ``[0, N_max - N_new_kv]``, so a bad value cannot touch memory
            outside the caches, though one that leaves no room overwrites the last valid entries.
        block_table: None, or int32 (or int64) ``(B, max_blocks)`` on ``q``'s device: a paged cache (the
            module docs draw it). Key position ``j`` of batch element ``b`` is slot ``j % page_size`` of page
            ``block_table[b, j // page_size]``; each element's capacity is ``N_max = max_blocks *
            page_size``, and the new ``k, v`` are written through the table. The ids of the pages a step
            reads or writes, ``[0, ceil(L_b / page_size))`` of row ``b``, must lie in ``[0, num_blocks)``:
            checked for a CPU tensor; a CUDA one is read on the device only, and the Triton kernel clamps
            the ids. Entries past an element's pages are never read; pages the step does not touch stay
            bitwise unchanged.
        cache_leftpad: None, or int32 (or int64) ``(B,)`` on ``q``'s device (flash-attn's): the first
            ``cache_leftpad[b]`` slots of element ``b`` are padding, its valid keys ``[cache_leftpad[b],
            L_b)``. ``cache_seqlens`` still counts from slot 0, padding included, and query positions do not
            move (causal, window and ALiBi as without it). ``0 <= cache_leftpad[b] <= cache_seqlens[b]``:
            checked for a CPU tensor, clamped by the Triton kernel for a CUDA one.
        sinks: None, or a floating ``(H_q,)`` tensor on ``q``'s device: attention sinks (GPT-OSS), one
            logit per query head in every row's softmax with a zero value:
            ``lse_i = log(sum_j exp(S_ij) + exp(sink_h))`` (:mod:`flashattn_teach._validate.sinks`); in the
            units of the scaled scores, itself not scaled, softcapped or biased. Added once per row, after
            the ranges' merge. Differentiable, as ``q``.
        causal: query row i sits at position ``L_b - N_new + i`` and sees keys ``j <= L_b - N_new + i``
            (bottom-right, per batch element; the module docs draw it). Off by default, as in flash-attn's
            ``flash_attn_with_kvcache``: a step with several new queries (a prefill, speculative decoding)
            usually wants ``causal=True``; one new query sees every valid key either way.
        scale: softmax scale, default ``1 / sqrt(D)``.
        window: ``(left, right)`` around that same diagonal (-1: unbounded); causal is ``right = 0``.
        softcap: scores become ``softcap * tanh(score / softcap)`` before any bias or mask.
        alibi_slopes: ``(H_q,)`` or ``(B, H_q)``: ``-slope * |L_b - N_new + i - j|`` added to the scores.
        num_splits: how many contiguous ranges the keys are cut into: ``[0, L_b)``, or with a window's left
            side the keys some row's window reaches, ``[max(0, L_b - N_new - left), L_b)``; the same number
            of keys in each (rounded up; the Triton kernel rounds up to whole key blocks), ranges past the
            last key empty. Any count gives the same result up to rounding. ``0`` chooses: on CUDA
            flash-attn's rule from the SM count and the shapes (:mod:`flashattn_teach.serving.splitkv`; the Triton
            path takes ``N_max`` as the key length, since the lengths stay on the device), on the CPU 1,
            since the CPU paths run the ranges one after another and already spread the heads over their
            worker threads.
        backend: ``"auto"`` (for CUDA tensors the Triton decode kernel when triton is installed, no
            gradient is wanted and no torch.func transform is active, else the query-major reference; for
            CPU tensors the threaded CPU path, or the query-major reference under a torch.func transform),
            ``"triton"`` (forward only: float16, bfloat16 or float32, CUDA tensors, or CPU tensors with
            ``TRITON_INTERPRET=1``), ``"parallel"``, ``"query_major"``, ``"key_major"`` or ``"dense"`` (the
            oracle), for every range.
        return_lse: also return ``lse`` of shape ``(B, H_q, N_new)``.

    Returns:
        ``O`` of shape ``(B, H_q, N_new, D_v)`` in ``q``'s dtype and, with ``return_lse``, ``lse`` in float32
        (float64 for float64 inputs), the sink included. A row that sees no key gives 0 and ``lse = -inf``
        (``lse = sink_h`` with sinks).

    Under ``torch.autocast``, as :func:`flashattn_teach.flash_attention`: ``q`` is cast to the autocast
    dtype (float64 untouched), so ``O`` has that dtype, and the caches are read in it; ``k, v`` are cast to
    the caches' dtype instead, since they are written into the caches, the caller's storage.

    A call that raises writes nothing into the caches: every check runs before the write.

    Gradients: decoding is inference, but ``q`` and ``sinks`` are differentiable (also ``k_cache`` and
    ``v_cache`` when ``k, v`` are None, over the entries the step reads). With ``k, v`` given, the in-place write is not
    differentiated: if grad mode is on and any of ``k, v, k_cache, v_cache`` requires grad, the call
    raises instead of silently dropping that gradient.
    """
    q, k, v, autocast = autocast_inputs(q, k_cache, k, v)
    call = DecodeCall(k, v, options, return_lse, autocast)  # the step's one record, handed whole below
    # compiled: the op, or torch ops in the graph when a gradient is wanted (ops_decode.compiled_step)
    step = ops_decode.compiled_step if torch.compiler.is_compiling() else decode_step
    return step(q, k_cache, v_cache, call)
