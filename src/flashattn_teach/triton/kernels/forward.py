"""Changes from core/kernel.py (``_forward_kernel``): strided inputs, grouped-query heads, ``D_v != D``,
fp8 inputs and a chosen dot precision; configs tuned per GPU and head dim (a head dim of two lane groups, TMA
loads on Hopper, warp specialisation); the mask contract's variants as constexpr flags (window, softcap, ALiBi,
``seqlens_k``, masks, FlexAttention mods, dropout, sinks, packed sequences); 64-bit offsets for any size.

The fused FlashAttention forward kernel (Dao 2023, FlashAttention-2 Alg. 1) in Triton.

One program owns one query block ``i`` (``BLOCK_M`` rows of one (batch, head)). It loads ``Q_i`` once,
then streams key/value blocks ``j`` through :func:`_attn_fwd_inner`, which carries the online-softmax
state ``(acc, l_i, m_i)`` of :mod:`flashattn_teach.core.online_softmax`, and finally writes ``O_i`` and
``lse_i``. Nothing of size ``N_q x N_k`` ever leaves the chip.

The softmax runs in base 2 with ``qk_scale = scale * log2(e)`` (passed by the launcher):

    exp(scale * q.k - m) = exp2(qk_scale * q.k - m2),      m2 = m * log2(e)

so each exponential is one FFMA and one ``ex2`` instruction, the running max is kept in these log2 units
(it is taken over the raw scores and scaled once per row), and ``lse = ln(2) * (m2_i + log2(l_i))``.

Causal masking splits the key loop in two stages (see :mod:`flashattn_teach.masks.causal`): key blocks wholly
below the diagonal run without a mask (and without bounds checks), blocks that straddle it and the ragged
last block run masked, and blocks wholly above it are never visited. On Hopper the key and value blocks
arrive by TMA (the tensor memory accelerator) from tensor descriptors; elsewhere through pointers.

The variants of the mask contract (a sliding window, softcap, ALiBi, ``seqlens_k``) are ``tl.constexpr``
flags, each compiled in only when a call uses it (:mod:`.masking`): a window adds a third, masked stage
before the unmasked one, for the key blocks its left side cuts; ``seqlens_k[b]`` takes the place of
``N_k`` (and, bottom-right, gives the diagonal offset ``seqlens_k[b] - N_q``); softcap and ALiBi modify
each score after scaling it. FlexAttention's ``score_mod`` and ``mask_mod`` arrive compiled, as
``tl.constexpr`` functions, and a block mask as a table of tile kinds (:mod:`.usermods`): the stages stay
as they are, a SKIP tile inside them is passed over, and ``mask_mod`` runs on PARTIAL tiles only.

With ``WS`` (sm_90, 16-bit inputs; :func:`flashattn_teach.triton.tma.ws_reason` says when) triton's pass
warp-specialises the key loop: the program's 4 warps become 12, a producer warpgroup that issues the TMA
copies of ``K_j, V_j`` into a ring of shared-memory buffers and two consumer warpgroups of 64 query rows
each that compute, handing buffers over by mbarriers and named barriers instead of CTA-wide ones. The
pass takes a kernel with a single loop whose loads all come from tensor descriptors made in the kernel
(host descriptors and pointer loads fail it), so that build makes its own descriptors of ``Q, K, V`` and
visits every key block in one loop. That loop is masked, giving up the unmasked stage's cheaper iterations,
unless ``EVEN_N`` (set by the launcher: not causal, no window or ``seqlens_k``, ``N_k`` a multiple of
``BLOCK_N``) says that every row sees every key of every block.

The backward kernels import two pieces from here: ``LOG2E`` and the key range of a query block.
The constants ``LOG2E`` and ``LN2`` live in :mod:`.masking`, with the score units they convert.
"""

from __future__ import annotations

import triton
from triton import language as tl

from .dropout import _packed_dropout
from .forward_inner import LN2, LOG2E, _attn_fwd_inner
from .grid import INDEX, program_block
from .masking import _sequence, _window_key_range
from .records import Strided
from .tiles import _load_block, _load_block_hi, _store_block


@triton.jit
def _causal_key_range(start_m, N_k, OFFSET, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key columns for query rows ``[start_m, start_m + BLOCK_M)``: ``[0, full_end)`` need no mask,
    ``[full_end, end)`` do. Query row r sees key c iff ``c <= r + OFFSET`` (causal) and ``c < N_k``.
    ``end`` is :func:`flashattn_teach.masks.causal.key_end` of the block's rows."""
    if CAUSAL:
        # last key seen by the last row, plus one; clamped so rows that see nothing give an empty range
        end = tl.minimum(tl.maximum(start_m + BLOCK_M + OFFSET, 0), N_k)
        # a block [c0, c0 + BLOCK_N) is fully visible to row start_m iff c0 + BLOCK_N <= start_m + OFFSET + 1
        full_end = (tl.maximum(start_m + OFFSET + 1, 0) // BLOCK_N) * BLOCK_N
        full_end = tl.minimum(full_end, (N_k // BLOCK_N) * BLOCK_N)
    else:
        end = N_k
        full_end = (N_k // BLOCK_N) * BLOCK_N
    return full_end, tl.maximum(end, full_end)


@triton.jit
def attn_fwd(
    ptr,
    stride,
    LSE,
    H_q,
    N_q,
    N_k,
    GROUP,
    qk_scale,
    bounds,
    terms,
    dropout,
    packed,
    mods,
    descales,
    SINK,
    trace,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F: tl.constexpr,
    NEGATE_Q: tl.constexpr,
    WS: tl.constexpr = False,
    EVEN_N: tl.constexpr = False,
    FP8: tl.constexpr = False,
    SINKS: tl.constexpr = False,
):
    """One-dimensional grid of ``cdiv(N_q, BLOCK_M) * B * H_q`` programs, the query block fastest. The
    records are :mod:`flashattn_teach.triton.kernels.records`'; a record or field that is None is never read. ``F``:
    the variant flags (:class:`flashattn_teach.triton.flags.Flags`), read ``F.CAUSAL``, ``F.WINDOW``, ...

    ``ptr, stride``: the tensors' pointers and strides (:func:`~.records.split` of a
    :class:`~.records.ForwardTensors`), made again into ``Q, O (B, H_q, N_q, .)``, ``K, V (B, H_kv, N_k, .)``
    (:class:`~.records.Strided`) in the first lines: any strides, and with
    ``TMA`` the pointers of ``K, V`` are tensor descriptors of blocks ``(1, 1, BLOCK_N, BLOCK_D)``; ``LSE``
    (:class:`~.records.Lse`) ``(B, H_q, N_q)`` contiguous fp32. Query head h reads key/value head h //
    GROUP. ``qk_scale = |scale| * log2(e)``; ``NEGATE_Q`` when the scale is negative (``scale * S = |scale| *
    (-Q) K^T``); with ``SOFTCAP`` or ``ALIBI`` instead ``qk_scale = scale * log2(e)`` and Q as given.

    ``bounds`` (:class:`~.records.Bounds`, :mod:`.masking`): ``WINDOW`` with ``LEFT, RIGHT`` (causal folded
    in, ``CAUSAL`` then False); ``SEQLENS`` with ``SEQLENS_K (B,)`` int32, and ``OFFSET`` then 1 for
    bottom-right alignment and 0 for top-left (``off_b = OFFSET * (seqlens_k[b] - N_q)``: each batch element
    aligned to its own length, as flash-attn does). ``terms`` (:class:`~.records.ScoreTerms`): ``SOFTCAP``
    with ``softcap_log2 = softcap * log2(e)``; ``ALIBI`` with its slopes; ``BOOL_MASK`` (uint8, nonzero:
    visible) or ``ADD_MASK`` with the mask ``(B, H_q, N_q, N_k)`` at any strides (0 where it broadcasts).
    ``DROPOUT`` with ``dropout`` (:class:`~.records.Dropout`).

    ``SCORE_MOD``, ``MASK_MOD`` (:mod:`.usermods`): the user's functions, compiled, with their captured
    tensors in ``mods`` (:class:`~.records.UserMods`); ``KINDS`` with its ``kinds (B|1, H_q|1, cdiv(N_q,
    BLOCK_M), cdiv(N_k, BLOCK_N))`` int8, a block mask's tile kinds at this launch's tiles; with ``LISTED``
    the key loop is one masked stage over its ``tiles``, :func:`flashattn_teach.triton.variants.tile_list`
    of those kinds: a SKIP tile takes no iteration. The launcher passes none of them with ``VARLEN`` or
    ``WS``.

    ``SINKS``: attention sinks, ``SINK (H_q,)`` fp32, one logit per query head in the units of the scaled
    scores (:mod:`flashattn_teach._validate.sinks`): each row's state starts with it as a key of value 0.

    ``VARLEN``: packed sequences (:class:`~.records.Packed`). The tensors are the ``(1, H, total, .)`` views
    of the packed ones, passed with batch strides 0; ``b`` is the sequence, ``N_q, N_k`` are
    ``max_seqlen_q, max_seqlen_k`` (the grid's extent), ``OFFSET`` is 1 for bottom-right alignment and 0 for
    top-left, and ``LSE`` is ``(H_q, total_q)``, row stride ``LSE.stride_h`` (without ``VARLEN``, ``N_q``).
    Each program moves its bases to the sequence's start rows (:func:`_sequence`).

    ``FP8`` (FA3's FP8 forward, :mod:`flashattn_teach._validate.fp8`): ``Q, K, V`` e4m3, ``O`` bf16, and
    ``descales`` (:class:`~.records.Descales`); ``qk_scale = scale * log2(e)``, signed (``NEGATE_Q``
    False). Both products run on e4m3 operands (P_ij is cast to V's dtype in the loop) with fp32
    accumulators. Not with ``VARLEN`` or ``WS``.

    ``BLOCK_D2 > 0``: ``HEAD_DIM`` is two lane groups, ``BLOCK_D`` then ``BLOCK_D2`` lanes (:mod:`.tiles`),
    the second through pointers or, with ``WS``, by its own in-kernel descriptors (not with ``TMA``).

    ``TRACE`` (issue 39; the launcher then runs the pointer path, neither ``TMA`` nor ``WS``): the programs of
    head ``(trace.b, trace.h)`` store each key block's state into ``trace`` (:mod:`.trace`); None otherwise.
    """
    # the tensors come as their pointers, then their strides (records.split: ptxas's schedule follows the layout)
    Q = Strided(ptr.Q, *stride.Q)
    K = Strided(ptr.K, *stride.K)
    V = Strided(ptr.V, *stride.V)
    O = Strided(ptr.O, *stride.O)
    n_blocks = tl.cdiv(N_q, BLOCK_M)
    # causal: the longest key ranges start first (all heads' or each head's: GRID_ORDER), the short ones fill the tail
    i, pid_bh = program_block(
        tl.program_id(0),
        n_blocks,
        tl.num_programs(0) // n_blocks,
        N_k,
        ORDER=F.GRID_ORDER if F.CAUSAL else INDEX,
        LONGEST_LAST=True,
        ROW_BYTES=2 * (HEAD_DIM + HEAD_DIM_V),
    )
    start_m = i * BLOCK_M
    b = pid_bh // H_q
    h = pid_bh % H_q
    h_kv = h // GROUP
    OFFSET = bounds.OFFSET
    Q_ptr, K_ptr, V_ptr, O_ptr = Q.ptr, K.ptr, V.ptr, O.ptr
    LSE_head = LSE.ptr + pid_bh.to(tl.int64) * LSE.stride_h  # lse (B, H_q, N_q) contiguous
    # the dropout counter's (offset, b * H_q + h, N_q, N_k) (flashattn_teach.dropout)
    drop_offset, drop_bh, drop_N_q, drop_N_k = dropout.offset, pid_bh, N_q, N_k
    if F.VARLEN:
        q_start, k_start, N_q, N_k, OFFSET = _sequence(packed.cu_seqlens_q, packed.cu_seqlens_k, b, OFFSET)
        if start_m >= N_q:
            return  # a query block past this sequence's end (the grid spans the longest one)
        if F.DROPOUT:  # counters of the packed matrix, one batch element: head h, rows and columns shifted
            n_seq = tl.num_programs(0) // (n_blocks * H_q)
            drop_offset, drop_N_q, drop_N_k = _packed_dropout(
                packed.cu_seqlens_q, packed.cu_seqlens_k, n_seq, q_start, k_start, dropout.offset
            )
            drop_bh = h
        # the batch strides are 0: the sequence's start rows move the bases instead
        Q_ptr = Q_ptr + q_start * Q.stride_n
        O_ptr = O_ptr + q_start * O.stride_n
        K_ptr = K_ptr + k_start * K.stride_n
        V_ptr = V_ptr + k_start * V.stride_n
        LSE_head = LSE.ptr + h.to(tl.int64) * LSE.stride_h + q_start  # lse (H_q, total_q)
    # 64-bit: batch and head offsets of large tensors overflow int32
    Q_head = Q_ptr + b.to(tl.int64) * Q.stride_b + h.to(tl.int64) * Q.stride_h
    O_head = O_ptr + b.to(tl.int64) * O.stride_b + h.to(tl.int64) * O.stride_h
    if WS:
        # descriptors of this head's (N_k, D) keys and values, made here: the warp specialiser needs them
        # in the kernel (launch.py gives triton a scratch allocator for them); rows past N_k read zeros
        K_src = tl.make_tensor_descriptor(
            K_ptr + b.to(tl.int64) * K.stride_b + h_kv.to(tl.int64) * K.stride_h,
            shape=[N_k, HEAD_DIM],
            strides=[K.stride_n, 1],
            block_shape=[BLOCK_N, BLOCK_D],
        )
        V_src = tl.make_tensor_descriptor(
            V_ptr + b.to(tl.int64) * V.stride_b + h_kv.to(tl.int64) * V.stride_h,
            shape=[N_k, HEAD_DIM_V],
            strides=[V.stride_n, 1],
            block_shape=[BLOCK_N, BLOCK_DV],
        )
    elif F.TMA:
        K_src = K_ptr
        V_src = V_ptr
    else:
        K_src = K_ptr + b.to(tl.int64) * K.stride_b + h_kv.to(tl.int64) * K.stride_h
        V_src = V_ptr + b.to(tl.int64) * V.stride_b + h_kv.to(tl.int64) * V.stride_h

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_q = offs_m < N_q
    # Q_i: (BLOCK_M, BLOCK_D), loaded once and kept on chip for the whole key loop
    Q_block = Q_head + tl.cast(start_m, tl.int64) * Q.stride_n
    if WS:  # the pass takes no pointer load into the producer: Q_i by a descriptor too
        Q_desc = tl.make_tensor_descriptor(
            Q_head, shape=[N_q, HEAD_DIM], strides=[Q.stride_n, 1], block_shape=[BLOCK_M, BLOCK_D]
        )
        q = Q_desc.load([start_m, 0])  # rows past N_q and lanes past HEAD_DIM read 0
    else:
        q = _load_block(
            Q_block, offs_m - start_m, offs_d, Q.stride_n, Q.stride_d, in_q, HEAD_DIM, BLOCK_D, ROWS_OK=False
        )
    # with BLOCK_D2 the head dim's second lane group (.tiles), of Q_i and of each K_j: with WS by boxes of
    # BLOCK_D2 lanes read at lane BLOCK_D, else through pointers (not by host descriptors); otherwise unread
    q2 = q
    K2_src = K_src
    if F.BLOCK_D2 > 0:
        tl.static_assert(not F.TMA, "a split head dim's second lane group has no host descriptor")
        if WS:
            q2 = tl.make_tensor_descriptor(
                Q_head, shape=[N_q, HEAD_DIM], strides=[Q.stride_n, 1], block_shape=[BLOCK_M, F.BLOCK_D2]
            ).load([start_m, BLOCK_D])
            K2_src = tl.make_tensor_descriptor(
                K_ptr + b.to(tl.int64) * K.stride_b + h_kv.to(tl.int64) * K.stride_h,
                shape=[N_k, HEAD_DIM],
                strides=[K.stride_n, 1],
                block_shape=[BLOCK_N, F.BLOCK_D2],
            )
        else:
            q2 = _load_block_hi(
                Q_block, offs_m - start_m, Q.stride_n, Q.stride_d, in_q, HEAD_DIM, BLOCK_D, F.BLOCK_D2, ROWS_OK=False
            )
    if NEGATE_Q:
        q = -q
        q2 = -q2
    if FP8:
        # the descales join the scale: scale * q.k * qd * kd = (scale * qd * kd) * q_fp8.k_fp8 (FA3)
        descale_at = b * descales.stride_b + h_kv * descales.stride_h
        qk_scale = qk_scale * tl.load(descales.q + descale_at) * tl.load(descales.k + descale_at)
        # the loop needs qk_scale >= 0 (its row max is taken before scaling): a negative product's sign
        # moves into Q, exactly, by flipping e4m3's sign bit (the host never reads the descales: no sync)
        flip = tl.where(qk_scale < 0, 0x80, 0).to(tl.uint8)
        q = (q.to(tl.uint8, bitcast=True) ^ flip).to(q.dtype, bitcast=True)
        if F.BLOCK_D2 > 0:
            q2 = (q2.to(tl.uint8, bitcast=True) ^ flip).to(q2.dtype, bitcast=True)
        qk_scale = tl.abs(qk_scale)

    if SINKS:
        # the sink as the row's first key, of score sink_h and value 0 (online_softmax.init_state): m_i is
        # sink_h in log2 units and l_i = exp2(m_i - m_i) = 1; the loop and the epilogue are unchanged
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINK + h) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    MASK_head = None
    if F.BOOL_MASK or F.ADD_MASK:
        MASK_head = terms.mask + b.to(tl.int64) * terms.mask_stride_b + h.to(tl.int64) * terms.mask_stride_h
    n_keys = N_k  # the keys that exist for this batch element
    if F.SEQLENS:
        n_keys = tl.minimum(tl.load(bounds.SEQLENS_K + b), N_k)  # keys past this batch element's length are invisible
        # OFFSET is the alignment (1: bottom-right, 0: top-left): off_b = seqlens_k[b] - N_q, flash-attn's
        OFFSET = OFFSET * (n_keys - N_q)
    if F.ALIBI:
        slope_log2 = tl.load(terms.alibi + b * terms.alibi_stride_b + h * terms.alibi_stride_h) * LOG2E
    else:
        slope_log2 = 0.0

    KINDS_row = None
    if F.KINDS:
        KINDS_row = mods.kinds + b * mods.kinds_stride_b + h * mods.kinds_stride_h + i * mods.kinds_stride_m
    LIST_row = None
    if F.LISTED:
        LIST_row = mods.tiles + b * mods.tiles_stride_b + h * mods.tiles_stride_h + i * mods.tiles_stride_m
    if F.WINDOW:
        begin, full_begin, full_end, end = _window_key_range(
            start_m, n_keys, OFFSET, bounds.LEFT, bounds.RIGHT, BLOCK_M, BLOCK_N
        )
    else:
        begin = 0
        full_begin = 0
        full_end, end = _causal_key_range(start_m, n_keys, OFFSET, BLOCK_M, BLOCK_N, F.CAUSAL)
    # The key loop's stages, one call site (unrolled: each stage its own inlined loop):
    #   0  LISTED: the block mask's visited tiles, all masked (the causal, window and length bounds still
    #      apply); WS: every key block in one loop (with a second loop in the kernel, specialised or not, the
    #      pass fails), masked unless EVEN_N says every row sees every key of every block (not causal, no
    #      window, no seqlens_k, N_k a multiple of BLOCK_N); WINDOW: the blocks some row's left bound cuts
    #   1  the key blocks every row fully sees, unmasked                    (not with WS or LISTED)
    #   2  the diagonal and the ragged last block, masked                   (not with WS or LISTED)
    for stage in tl.static_range(3):
        if (stage == 0 and (F.LISTED or F.WINDOW or WS)) or (stage > 0 and not (WS or F.LISTED)):
            if stage == 0:
                if F.LISTED:
                    lo, hi = 0, tl.load(LIST_row)  # entries of the tile list, not keys
                else:
                    lo, hi = begin, end if WS else full_begin
            elif stage == 1:
                lo, hi = full_begin, full_end
            else:
                lo, hi = full_end, end
            acc, l_i, m_i = _attn_fwd_inner(
                acc,
                l_i,
                m_i,
                q=q,
                q2=q2,
                K_src=K_src,
                K2_src=K2_src,
                V_src=V_src,
                K=K,
                V=V,
                b=b,
                h=h,
                h_kv=h_kv,
                start_n=lo,
                end_n=hi,
                offs_m=offs_m,
                N_k=n_keys,
                qk_scale=qk_scale,
                OFFSET=OFFSET,
                bounds=bounds,
                terms=terms,
                slope_log2=slope_log2,
                dropout=dropout,
                drop_offset=drop_offset,
                drop_bh=drop_bh,
                drop_N_q=drop_N_q,
                drop_N_k=drop_N_k,
                MASK_head=MASK_head,
                offs_m0=start_m,
                mods=mods,
                KINDS_row=KINDS_row,
                LIST_row=LIST_row,
                trace=trace,
                HEAD_DIM=HEAD_DIM,
                HEAD_DIM_V=HEAD_DIM_V,
                BLOCK_D=BLOCK_D,
                BLOCK_DV=BLOCK_DV,
                BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
                F=F,
                MASK=stage == 2 or (stage == 0 and (F.LISTED or not EVEN_N)),
                WS=WS,
            )

    # Epilogue (FA2 Alg. 1 lines 12-13): O_i = acc / l_i, lse_i = m_i + log(l_i).
    # A row that saw no key has l_i = 0 and acc = 0: it gets O = 0 and lse = -inf (with SINKS, l_i = 1 and
    # lse = sink_h).
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    if FP8:
        o = o * tl.load(descales.v + descale_at)  # O = vd * (P_fp8 V_fp8) / l: V's descale, once per row
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    tl.store(LSE_head + offs_m, lse, mask=in_q)
    O_block = O_head + tl.cast(start_m, tl.int64) * O.stride_n
    o = o.to(O_ptr.dtype.element_ty)
    _store_block(O_block, o, offs_m - start_m, offs_dv, O.stride_n, O.stride_d, in_q, HEAD_DIM_V)
