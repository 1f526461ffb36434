"""Split-KV decoding (Flash-Decoding) in Triton: the kernels behind ``flash_attention_with_kvcache``.

A decode step has ``N_new`` new queries (often 1) per head against a long cache, so the prefill kernel's
grid of ``(query block, batch, head)`` programs would be ``B x H_q`` programs of one row each. Here
(Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"):

    program (b, h_kv, i, s)   rows: the G = H_q / H_kv query heads of key/value head h_kv times the
                              N_new new queries, row r = g N_new + n (query head h_kv G + g, query n),
                              BLOCK_M of them (block i); so each cached key is read once per h_kv
                              keys: split s of batch element b's range, in BLOCK_N-key blocks j

    decode_split_fwd    B x H_kv x cdiv(G N_new, BLOCK_M) x num_splits programs, each the online
                        softmax (FA2 Alg. 1) over its split, writing a partial (O_s, lse_s)
    decode_combine      one program per query row: the exact merge of the num_splits partials,
                        split after split (merge.py's merge_attention_states, one level up)

With one split the first kernel writes the final ``O`` and ``lse`` itself and the combine does not run.

Lengths come from the device: ``L_b = cache_seqlens[b] + N_new_kv`` is loaded by each program, so one
compiled kernel serves every cache length and no host synchronisation is needed. Query row n of batch
element b sits at position ``p = L_b - N_new + n`` and sees key j iff (``decode.py``'s contract)

    j < L_b   and   p - LEFT <= j <= p + RIGHT          (causal folded in as RIGHT = 0; open: UNBOUNDED)

and ALiBi adds ``-slope_h |p - j|``. The keys some row may see, ``[lo, L_b)`` with ``lo = max(0, p_0 -
LEFT)``, are cut into ``num_splits`` ranges of whole key blocks (the last one short, trailing ones empty);
within a split, :func:`_split_key_runs` finds the blocks every row sees whole (no mask) and the ones a
diagonal or the split's end cuts (masked), as :mod:`.masking` does for the prefill kernels.

Paged caches (``PAGED``, flash-attn's ``block_table``): key ``j`` of batch element b lives in page
``block_table[b, j // PAGE_SIZE]`` at slot ``j % PAGE_SIZE`` of ``K (num_blocks, H_kv, PAGE_SIZE, D)``, so
each key of a block gets its own row address (:func:`.pages._page_slots`, 64-bit) from the pages' strides: any
page size, and flash-attn's ``(num_blocks, PAGE_SIZE, H_kv, D)`` storage as a transposed view. Pages of at
least ``BLOCK_N`` keys hold a block in two pages at most: two block ids a block (``WIDE_PAGES``). The ids
of the next block are read one iteration ahead (:func:`.pages._block_ids`), so that the K and V loads' addresses
wait for no load of the same iteration and the compiler still pipelines them (``python -m
flashattn_teach.tools.kernels.decode --paged 256 --loops``: the shared memory of two stages in flight, as
for contiguous caches). Block ids are clamped to ``[0, num_blocks)``: a CUDA table is never read on the
host. ``LEFTPAD`` (flash-attn's ``cache_leftpad``): keys before ``cache_leftpad[b]`` are padding, so ``lo``
starts there. ``SINKS``: row ``r`` of head h counts one more key, of score ``sink_h`` and value 0; split 0
starts its rows' state from it (``m_i = sink_h log2(e), l_i = 1``), so the sink enters each row once, also
through the combine. ``BLOCK_D2`` (DeepSeek's MLA, ``D = 192``): the queries and keys as two lane groups of
128 and 64 (:mod:`.tiles`, ``triton/lanes.py``), ``S = Q[:, :128] K_j[:, :128]^T + Q[:, 128:] K_j[:, 128:]^T``
(two MMAs into one accumulator) rather than one padded to 256; 0 compiles none of it.

Like the prefill kernels the scores are kept in log2 units: ``s2 = scale log2(e) q.k`` and
``lse = ln 2 (m_i + log2 l_i)``; softcap and ALiBi modify ``s2`` (:func:`~.masking._modify_scores`).
FlexAttention's ``score_mod`` and ``mask_mod`` (:mod:`.usermods`) never reach these kernels:
``flash_attention_with_kvcache`` takes neither.
"""

from __future__ import annotations

import triton
from triton import language as tl

from .forward import LN2, LOG2E
from .masking import _in_window, _modify_scores
from .pages import _block_ids, _page_slots
from .records import Partials, Strided
from .tiles import _load_block, _load_block_hi, _store_block
from .trace_decode import _trace_block, _trace_rows


@triton.jit
def _split_key_runs(split_begin, split_end, p_first, p_last, LEFT, RIGHT, BLOCK_N: tl.constexpr):
    """``(begin, full_begin, full_end, end)`` of the keys ``[split_begin, split_end)`` for rows at positions
    ``p_first..p_last``: ``[begin, full_begin)`` and ``[full_end, end)`` are masked runs (a row's left or
    right bound, or the split's ragged end, cuts their blocks), ``[full_begin, full_end)`` holds whole
    blocks every row sees. Block starts are ``split_begin`` plus multiples of ``BLOCK_N``."""
    # one past the last key some row sees: the last row's right bound
    end = tl.minimum(split_end, tl.maximum(p_last + RIGHT + 1, split_begin))
    # the first key some row sees (the first row's left bound), rounded down to a block of the split
    first = tl.maximum(p_first - LEFT, split_begin)
    begin = split_begin + ((first - split_begin) // BLOCK_N) * BLOCK_N
    # a block at c0 lies within every row's left bound iff c0 >= p_last - LEFT
    full_begin = split_begin + tl.cdiv(tl.maximum(p_last - LEFT - split_begin, 0), BLOCK_N) * BLOCK_N
    full_begin = tl.minimum(full_begin, end)
    # ... and within every row's right bound and the split iff c0 + BLOCK_N <= min(p_first + RIGHT + 1, split_end)
    right = tl.minimum(p_first + RIGHT + 1, split_end)
    full_end = split_begin + (tl.maximum(right - split_begin, 0) // BLOCK_N) * BLOCK_N
    return tl.minimum(begin, end), full_begin, tl.maximum(full_end, full_begin), end


@triton.jit
def _decode_inner(
    acc,  # (BLOCK_M, BLOCK_DV) fp32, the unnormalised output
    l_i,  # (BLOCK_M,) fp32, running denominator
    m_i,  # (BLOCK_M,) fp32, running max of the log2-unit scores
    q,  # (BLOCK_M, BLOCK_D), the rows' queries
    q2,  # with BLOCK_D2: their second lane group (BLOCK_M, BLOCK_D2); otherwise unread
    K_head,  # key and value head (b, h_kv) of the caches; paged: head h_kv of page 0
    V_head,
    K,  # the caches' records, for their strides (paged: stride_b steps a page)
    V,
    pages,  # records.Pages, or None
    table,  # paged: batch element b's row of the block table
    start_n,
    end_n,
    split_end,
    pos,  # (BLOCK_M,) int32, each row's position p
    LEFT,
    RIGHT,
    qk_scale,
    softcap_log2,
    slope_log2,  # (BLOCK_M, 1) fp32, each row's ALiBi slope times log2(e)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAGED: tl.constexpr,
    WIDE_PAGES: tl.constexpr,
    MASK: tl.constexpr,
    trace=None,  # TRACE: where the rows' records go (.trace_decode._trace_rows)
    TRACE: tl.constexpr = False,
):
    """Fold key/value blocks ``[start_n, end_n)`` into ``(acc, l_i, m_i)`` (FA2 Alg. 1 lines 6-10).
    ``MASK``: scores of keys a row does not see, or past ``split_end``, become -inf (and are not read).
    ``PAGED``: each key's row found through the block table (:func:`_block_ids`, :func:`_page_slots`).
    ``BLOCK_D2 > 0``: the query/key head dim is two lane groups (:mod:`.tiles`; 192 = 128 + 64), each
    ``S = Q K_j^T`` two MMAs into one accumulator, the second group's keys read at the same rows."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_j = tl.arange(0, BLOCK_N)
    if PAGED:  # the block ids one block ahead, so that the K and V loads' addresses wait for no load
        page0, page1 = _block_ids(
            table, start_n, split_end, pages.stride_n, pages.PAGE_SIZE, pages.num_blocks, BLOCK_N, WIDE_PAGES
        )
    for start in tl.range(start_n, end_n, BLOCK_N):
        cols = start + offs_j
        in_split = cols < split_end
        # K_j: (BLOCK_N, BLOCK_D); S = Q K_j^T: (BLOCK_M, BLOCK_D) @ (BLOCK_D, BLOCK_N) -> (BLOCK_M, BLOCK_N)
        if PAGED:  # the keys of a block may lie in several pages: one 64-bit row offset per key
            page, slot = _page_slots(page0, page1, start, cols, pages.PAGE_SIZE, WIDE_PAGES)
            K_rows, k_rows, stride_kr = K_head, page * K.stride_b + slot * K.stride_n, 1
        else:
            K_rows, k_rows, stride_kr = K_head + tl.cast(start, tl.int64) * K.stride_n, offs_j, K.stride_n
        k = _load_block(K_rows, k_rows, offs_d, stride_kr, K.stride_d, in_split, HEAD_DIM, BLOCK_D, ROWS_OK=not MASK)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if BLOCK_D2 > 0:  # S += Q[:, BLOCK_D:] K_j[:, BLOCK_D:]^T: (BLOCK_M, BLOCK_D2) @ (BLOCK_D2, BLOCK_N)
            k2 = _load_block_hi(K_rows, k_rows, stride_kr, K.stride_d, in_split, HEAD_DIM, BLOCK_D, BLOCK_D2, not MASK)
            s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
        # s2 = scale log2(e) q.k, scaled before the max (the scale may be negative)
        s = s * qk_scale
        if SOFTCAP or ALIBI:
            s, _ = _modify_scores(s, pos[:, None], cols[None, :], 0, softcap_log2, slope_log2, SOFTCAP, ALIBI)
        if MASK:
            visible = in_split[None, :] & _in_window(pos[:, None], cols[None, :], 0, LEFT, RIGHT)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key yet keeps m = -inf: subtract 0 there, not (-inf) - (-inf)
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_new_safe[:, None])  # exp2(-inf) = 0 for invisible keys
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_new_safe = m_new
            # P = exp2(s2 - m_new): every row sees a finite score in an unmasked block
            p = tl.math.exp2(s - m_new[:, None])
        # alpha = exp(m_old - m_new) rescales what was accumulated under the old max; l = alpha l + rowsum(P)
        alpha = tl.math.exp2(m_i - m_new_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        # V_j: (BLOCK_N, BLOCK_DV); acc = alpha acc + P V_j: (BLOCK_M, BLOCK_N) @ (BLOCK_N, BLOCK_DV)
        if PAGED:
            v_rows = page * V.stride_b + slot * V.stride_n
            v = _load_block(V_head, v_rows, offs_dv, 1, V.stride_d, in_split, HEAD_DIM_V, BLOCK_DV, ROWS_OK=not MASK)
        else:
            V_block = V_head + tl.cast(start, tl.int64) * V.stride_n
            v = _load_block(
                V_block, offs_j, offs_dv, V.stride_n, V.stride_d, in_split, HEAD_DIM_V, BLOCK_DV, ROWS_OK=not MASK
            )
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
        if TRACE:
            _trace_block(trace, s, m_i, l_i, alpha, acc, start, BLOCK_N)
        if PAGED:
            page0, page1 = _block_ids(
                table,
                start + BLOCK_N,
                split_end,
                pages.stride_n,
                pages.PAGE_SIZE,
                pages.num_blocks,
                BLOCK_N,
                WIDE_PAGES,
            )
    return acc, l_i, m_i


@triton.jit
def decode_split_fwd(
    ptr,
    stride,
    lengths,
    pages,
    terms,
    SINK,
    H_kv,
    GROUP,
    num_splits,
    qk_scale,
    LEFT,
    RIGHT,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAGED: tl.constexpr,
    WIDE_PAGES: tl.constexpr,
    LEFTPAD: tl.constexpr,
    SINKS: tl.constexpr,
    Trace=None,
    TRACE: tl.constexpr = False,
):
    """Grid ``(B * H_kv * cdiv(GROUP * N_new, BLOCK_M), num_splits)``; the records of :mod:`.records`,
    the tensors as ``ptr, stride`` (:func:`~.records.split` of a :class:`~.records.DecodeTensors`), made again
    in the first lines.

    ``Q (B, H_q, N_new, D)``; ``K, V (B, H_kv, N_max, .)``, the caches; ``O (num_splits, B, H_q, N_new,
    D_v)`` and ``LSE (num_splits, B, H_q, N_new, 1)`` (:class:`~.records.Partials`): fp32 partials, or with
    one split the final outputs viewed with a leading axis of 1, any strides. ``lengths``
    (:class:`~.records.CacheLengths`): ``cache_seqlens (B,)`` int32, clamped here to ``[0, N_max -
    N_new_kv]`` so no key is read past the cache; with ``LEFTPAD`` ``cache_leftpad (B,)`` int32, clamped
    here to ``[0, L_b]``. ``qk_scale = scale log2(e)``; ``LEFT, RIGHT``: the window with causal folded in;
    ``terms`` (:class:`~.records.ScoreTerms`): ALiBi slopes with ``ALIBI``, ``softcap_log2 = softcap
    log2(e)`` with ``SOFTCAP``. ``PAGED``: ``K, V (num_blocks, H_kv, PAGE_SIZE, .)`` (``stride_b`` steps a
    page), ``pages`` (:class:`~.records.Pages`), ``N_max = max_blocks PAGE_SIZE``; ``WIDE_PAGES``:
    ``PAGE_SIZE >= BLOCK_N`` (:func:`_block_ids`). ``SINKS``: ``SINK (H_q,)`` fp32, contiguous.
    ``BLOCK_D2 > 0``: ``HEAD_DIM`` is ``BLOCK_D`` then ``BLOCK_D2`` lanes (:mod:`.tiles`); the values'
    ``BLOCK_DV`` stays one padded group. ``TRACE``: the trace build, ``Trace`` a
    :class:`~.trace_decode.DecodeTraceRecord` (None, a constant, without it)."""
    # the tensors come as their pointers, then their strides (records.split: ptxas's schedule follows the layout)
    Q = Strided(ptr.Q, *stride.Q)
    K = Strided(ptr.K, *stride.K)
    V = Strided(ptr.V, *stride.V)
    O = Partials(ptr.O, *stride.O)
    LSE = Partials(ptr.LSE, *stride.LSE)
    N_new = lengths.N_new
    m_blocks = tl.cdiv(GROUP * N_new, BLOCK_M)
    pid = tl.program_id(0)
    s = tl.program_id(1)
    i = pid % m_blocks
    b = pid // m_blocks // H_kv
    h_kv = pid // m_blocks % H_kv

    # L_b = cache_seqlens[b] + N_new_kv; query row n at position p = L_b - N_new + n
    L = tl.minimum(tl.maximum(tl.load(lengths.cache_seqlens + b), 0), lengths.N_max - lengths.N_new_kv)
    L = L + lengths.N_new_kv
    p_first = L - N_new
    # the keys some row sees: [lo, L), cut into num_splits ranges of whole blocks
    lo = tl.minimum(tl.maximum(p_first - LEFT, 0), L)
    if LEFTPAD:  # keys [0, cache_leftpad[b]) are padding; split boundaries start at or after it
        lo = tl.maximum(lo, tl.minimum(tl.maximum(tl.load(lengths.cache_leftpad + b), 0), L))
    blocks_per_split = tl.cdiv(tl.cdiv(L - lo, BLOCK_N), num_splits)
    split_begin = tl.minimum(lo + s * blocks_per_split * BLOCK_N, L)
    split_end = tl.minimum(split_begin + blocks_per_split * BLOCK_N, L)

    # this block's rows r = g N_new + n: query head h = h_kv GROUP + g, query n
    rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < GROUP * N_new
    h = h_kv * GROUP + rows // N_new
    n = rows % N_new
    pos = p_first + n
    # the positions of the block's rows: the whole [p_first, L) unless the block holds fewer than N_new rows
    p_lo = tl.min(tl.where(in_rows, pos, L), 0)
    p_hi = tl.max(tl.where(in_rows, pos, p_first), 0)

    # Q rows: (BLOCK_M, BLOCK_D), loaded once; each row its own (head, query), at a 64-bit offset from Q
    q_rows = b.to(tl.int64) * Q.stride_b + h.to(tl.int64) * Q.stride_h + n.to(tl.int64) * Q.stride_n
    q = _load_block(Q.ptr, q_rows, tl.arange(0, BLOCK_D), 1, Q.stride_d, in_rows, HEAD_DIM, BLOCK_D, ROWS_OK=False)
    q2 = q  # with BLOCK_D2 the queries' second lane group (BLOCK_M, BLOCK_D2); otherwise unread
    if BLOCK_D2 > 0:
        q2 = _load_block_hi(Q.ptr, q_rows, 1, Q.stride_d, in_rows, HEAD_DIM, BLOCK_D, BLOCK_D2, ROWS_OK=False)
    if ALIBI:
        slopes = tl.load(terms.alibi + b * terms.alibi_stride_b + h * terms.alibi_stride_h, mask=in_rows, other=0.0)
        slope_log2 = (slopes * LOG2E)[:, None]
    else:
        slope_log2 = tl.zeros([BLOCK_M, 1], dtype=tl.float32)

    table = None
    if PAGED:  # pages hold keys of any batch element: b enters through its row of the block table
        K_head = K.ptr + h_kv.to(tl.int64) * K.stride_h
        V_head = V.ptr + h_kv.to(tl.int64) * V.stride_h
        table = pages.table + b.to(tl.int64) * pages.stride_b
    else:
        K_head = K.ptr + b.to(tl.int64) * K.stride_b + h_kv.to(tl.int64) * K.stride_h
        V_head = V.ptr + b.to(tl.int64) * V.stride_b + h_kv.to(tl.int64) * V.stride_h
    if SINKS:  # the sink as a key of score sink_h and value 0, folded in once per row: by split 0
        sink = tl.load(SINK + h, mask=in_rows, other=0.0) * LOG2E
        m_i = tl.where(s == 0, sink, float("-inf"))
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + (s == 0).to(tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    trace = None
    if TRACE:  # the traced head's rows (.trace_decode)
        trace = _trace_rows(Trace, b, h, n, in_rows, s, split_begin, N_new, BLOCK_N + 3 + BLOCK_DV)
    begin, full_begin, full_end, end = _split_key_runs(split_begin, split_end, p_lo, p_hi, LEFT, RIGHT, BLOCK_N)
    # three runs: the blocks a left bound cuts (masked), those every row sees whole, those a right bound or
    # the split's end cuts (masked); the loop is unrolled, each run its own inlined loop
    for run in tl.static_range(3):
        acc, l_i, m_i = _decode_inner(
            acc,
            l_i,
            m_i,
            q=q,
            q2=q2,
            K_head=K_head,
            V_head=V_head,
            K=K,
            V=V,
            pages=pages,
            table=table,
            start_n=begin if run == 0 else full_begin if run == 1 else full_end,
            end_n=full_begin if run == 0 else full_end if run == 1 else end,
            split_end=split_end,
            pos=pos,
            LEFT=LEFT,
            RIGHT=RIGHT,
            qk_scale=qk_scale,
            softcap_log2=terms.softcap_log2,
            slope_log2=slope_log2,
            HEAD_DIM=HEAD_DIM,
            HEAD_DIM_V=HEAD_DIM_V,
            BLOCK_D=BLOCK_D,
            BLOCK_D2=BLOCK_D2,
            BLOCK_DV=BLOCK_DV,
            BLOCK_N=BLOCK_N,
            SOFTCAP=SOFTCAP,
            ALIBI=ALIBI,
            DOT_PRECISION=DOT_PRECISION,
            PAGED=PAGED,
            WIDE_PAGES=WIDE_PAGES,
            MASK=run != 1,
            trace=trace,
            TRACE=TRACE,
        )

    # Epilogue (FA2 Alg. 1 lines 12-13): O = acc / l_i, lse = m_i + log(l_i); a row that saw no key of
    # this split (l_i = 0, acc = 0) gets O = 0 and lse = -inf, which the combine weighs 0 (with sinks,
    # split 0 has l_i >= 1 there: O = 0, lse = sink_h)
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    lse_rows = s.to(tl.int64) * LSE.stride_s + b.to(tl.int64) * LSE.stride_b + h.to(tl.int64) * LSE.stride_h
    lse_rows = lse_rows + n * LSE.stride_n
    tl.store(LSE.ptr + lse_rows, lse, mask=in_rows)
    o_rows = s.to(tl.int64) * O.stride_s + b.to(tl.int64) * O.stride_b + h.to(tl.int64) * O.stride_h + n * O.stride_n
    o = o.to(O.ptr.dtype.element_ty)
    _store_block(O.ptr, o, o_rows, tl.arange(0, BLOCK_DV), 1, O.stride_d, in_rows, HEAD_DIM_V)


@triton.jit
def decode_combine(
    O_PART,
    LSE_PART,
    O,
    LSE,
    stride_o_split,
    stride_lse_split,
    num_splits,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Grid ``(rows,)``: row r of the contiguous ``O (rows, D_v)``, ``LSE (rows,)`` from the fp32 partials
    ``O_PART (num_splits, rows, D_v)``, ``LSE_PART (num_splits, rows)`` (contiguous), merged split after split:

        m' = max(m, lse_s),   l' = exp(m - m') l + exp(lse_s - m'),   acc' = exp(m - m') acc + exp(lse_s - m') O_s

    the online softmax with each split as one "key" of weight ``exp(lse_s)`` and value ``O_s``; at the end
    ``O = acc / l``, ``lse = m + log l`` (``-inf`` and ``O = 0`` for a row no split saw)."""
    r = tl.program_id(0).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_d = offs_dv < HEAD_DIM_V
    lse_ptr = LSE_PART + r
    o_ptrs = O_PART + r * HEAD_DIM_V + offs_dv
    m = tl.full([], float("-inf"), dtype=tl.float32)
    l_r = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for _ in tl.range(0, num_splits):
        lse_s = tl.load(lse_ptr)
        m_new = tl.maximum(m, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse_s - m_safe)  # 0 for a split this row saw nothing of
        l_r = l_r * alpha + w
        acc = acc * alpha + w * tl.load(o_ptrs, mask=in_d, other=0.0)
        m = m_new
        lse_ptr += stride_lse_split
        o_ptrs += stride_o_split
    empty = l_r == 0.0
    tl.store(LSE + r, tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l_r))))
    tl.store(O + r * HEAD_DIM_V + offs_dv, (acc / tl.where(empty, 1.0, l_r)).to(O.dtype.element_ty), mask=in_d)
