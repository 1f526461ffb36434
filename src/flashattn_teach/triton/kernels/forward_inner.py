"""Changes from core/kernel.py (``_forward_inner``): the same update in base 2, with the mask contract's score
features and masks per tile, dropout on the weights, TMA or warp-specialised loads, and a split head dim.

The key/value loop of the Triton forward: one query block's online softmax over a range of key blocks.

:func:`_attn_fwd_inner` carries ``(acc, l_i, m_i)`` of :mod:`flashattn_teach.core.online_softmax` through the key
blocks ``j`` of one stage of :mod:`.forward`'s loop (masked or not, by ``tl.constexpr``), in base 2:

    S_ij = Q_i K_j^T,   m_new = max(m_i, rowmax(S_ij) qk_scale),   P_ij = exp2(S_ij qk_scale - m_new)
    l_i  = exp2(m_i - m_new) l_i + rowsum(P_ij),      acc = exp2(m_i - m_new) acc + P_ij V_j

:func:`_load_kv_block` brings ``K_j`` and ``V_j`` in, by TMA descriptors on Hopper or through pointers.
With ``BLOCK_D2 > 0`` the head dim is two lane groups (:mod:`.tiles`; 192 = 128 + 64) and ``S_ij`` is two
MMAs into one accumulator (its second lane group through pointers, or with ``WS`` by its own box).
"""

from __future__ import annotations

import triton
from triton import language as tl

from .dropout import _dropout_keep
from .masking import LN2, LOG2E, _attn_mask_tile, _in_window, _modify_scores
from .tiles import _load_block, _load_block_hi, _load_tile_tma
from .trace import _trace_block
from .usermods import KIND_PARTIAL, KIND_SKIP, _mask_mod_visible, _score_mod

__all__ = ["LN2", "LOG2E", "_attn_fwd_inner", "_load_kv_block"]


@triton.jit
def _load_kv_block(
    src,
    b,
    h,
    start,
    N,
    stride_n,
    stride_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TMA: tl.constexpr,
    MASK: tl.constexpr,
    WS: tl.constexpr,
):
    """Key (or value) block ``j``, rows ``[start, start + BLOCK_N)`` of head ``(b, h)``: (BLOCK_N, BLOCK_D).

    With ``TMA`` ``src`` is a ``(B, H, N, D)`` tensor descriptor, with ``WS`` an ``(N, D)`` one of head
    ``(b, h)`` made in the kernel: the copy engine fetches the box into shared memory and fills rows
    ``>= N`` and lanes ``>= D`` with zeros, with no address arithmetic in the loop. Otherwise ``src``
    points at head ``(b, h)``; the block's base advances in 64-bit (``N x stride_n`` may pass 2^31) and
    the in-tile offsets stay 32-bit. Rows are masked only when ``MASK`` (a ragged last block can occur
    only in the masked stage), lanes only when ``HEAD_DIM < BLOCK_D``.
    """
    if WS:
        return src.load([start, 0])  # a descriptor of head (b, h) alone, made in the kernel
    elif TMA:
        return _load_tile_tma(src, b, h, start, BLOCK_N, BLOCK_D)
    else:
        rows = tl.arange(0, BLOCK_N)
        block = src + tl.cast(start, tl.int64) * stride_n
        lanes = tl.arange(0, BLOCK_D)
        return _load_block(
            block, rows, lanes, stride_n, stride_d, start + rows < N, HEAD_DIM, BLOCK_D, ROWS_OK=not MASK
        )


@triton.jit
def _attn_fwd_inner(
    acc,  # (BLOCK_M, BLOCK_DV) fp32, the unnormalised output O_i
    l_i,  # (BLOCK_M,) fp32, running denominator
    m_i,  # (BLOCK_M,) fp32, running max of qk_scale * S (log2 units)
    q,  # Q_i (BLOCK_M, BLOCK_D)
    q2,  # with BLOCK_D2: Q_i's second lane group (BLOCK_M, BLOCK_D2); otherwise unread
    K_src,
    K2_src,  # with BLOCK_D2: the keys' second lane group, K_src's pointer or with WS a box of BLOCK_D2 lanes
    V_src,
    K,  # records.Strided of the keys and values, for their row and lane strides
    V,
    b,
    h,  # the query head, as the user's functions see it (int32; ``b`` is the flat batch index)
    h_kv,
    start_n,
    end_n,
    offs_m,
    N_k,
    qk_scale,
    OFFSET,
    bounds,  # records.Bounds: the window's LEFT, RIGHT
    terms,  # records.ScoreTerms: softcap_log2 and the user's attn_mask's row and column strides
    slope_log2,
    dropout,  # records.Dropout: seed, threshold, keep_scale (its offset: drop_offset)
    drop_offset,  # the dropout counters of this program: offset, (b * H_q + h), sizes N_q x N_k
    drop_bh,
    drop_N_q,
    drop_N_k,
    MASK_head,  # the user's attn_mask at (b, h), or None
    offs_m0,  # the block's first row
    mods,  # records.UserMods: the captured tensors of score_mod and mask_mod, the kinds' key-tile stride
    KINDS_row,  # the block mask's kinds of this query block (its first key tile), or None
    LIST_row,  # with LISTED: variants.tile_list's row of this query block, or None
    trace,  # with TRACE: the trace record (.trace.ForwardTrace), or None
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F: tl.constexpr,
    MASK: tl.constexpr,
    WS: tl.constexpr = False,
):
    """Fold key/value blocks ``[start_n, end_n)`` into ``(acc, l_i, m_i)`` (FA2 Alg. 1 lines 6-10). ``F``: the
    kernel's flags record (:class:`flashattn_teach.triton.flags.Flags`), passed whole.

    ``MASK`` selects the stage: False for blocks every row may fully see (no mask, no bounds check),
    True for the diagonal and the ragged last block, where scores of invisible keys become -inf.

    The row max is taken over the raw scores and scaled once per row: with ``qk_scale >= 0`` (the
    launcher negates Q for a negative scale), ``max(qk_scale * S) = qk_scale * max(S)``, so the scale
    reaches each score only inside the exponent, as one FFMA: ``P = exp2(S * qk_scale - m_new)``.
    With ``SOFTCAP``, ``ALIBI`` or an additive mask the scale must come first (tanh is not linear, the
    biases are not scaled): the scores are scaled and modified in log2 units
    (:func:`~.masking._modify_scores`), and the scale left for the exponent is 1. With a user mask
    (``BOOL_MASK``, ``ADD_MASK``, ``MASK_MOD``) every stage runs the masked arithmetic: any row may see none
    of a tile. ``SCORE_MOD`` (:mod:`.usermods`) comes last among the modifiers; since it may return -inf, the
    unmasked stage then guards its row statistics (a row whose scores are all -inf keeps ``m = -inf``).
    ``KINDS``: a block mask's tile kinds; a SKIP tile is passed over, a FULL one runs without ``MASK_MOD``.
    ``LISTED``: ``[start_n, end_n)`` counts entries of ``LIST_row`` (the tiles to visit, with their kinds)
    rather than keys; no branch then sits in the loop. ``TRACE``: each block's state after its update goes to
    ``trace`` (:func:`.trace._trace_block`), the scores as ``s * s_scale``, base 2 with the scale folded in.
    """
    nat_scale = qk_scale * LN2  # scale * q.k in natural units, for score_mod without built-in modifiers
    if F.BOOL_MASK or F.ADD_MASK:
        rows = tl.arange(0, BLOCK_M)  # in-tile offsets of the attn_mask tile, whose first row is offs_m0
        cols = tl.arange(0, BLOCK_N)
    # the unmasked stage loops over a block counter, which compiles to fewer instructions an iteration; the
    # masked stage over key offsets, since a counter there spilled registers in some tiles (docs/loop-profile.md)
    if F.LISTED:
        lo, hi, step = start_n, end_n, 1
    elif MASK:
        lo, hi, step = start_n, end_n, BLOCK_N
    else:
        lo, hi, step = 0, tl.cdiv(end_n - start_n, BLOCK_N), 1
    for it in tl.range(lo, hi, step, warp_specialize=WS):
        kind = KIND_PARTIAL
        visit = True
        if F.LISTED:
            code = tl.load(LIST_row + 1 + it)  # (j << 2) | kind
            start = (code >> 2) * BLOCK_N
            kind = code & 3
        else:
            start = it if MASK else start_n + it * BLOCK_N
            if F.KINDS:
                kind = tl.load(KINDS_row + (start // BLOCK_N) * mods.kinds_stride_n)
                visit = kind != KIND_SKIP
        if visit:  # a SKIP tile of the block mask: nothing of it is loaded or computed
            # K_j: (BLOCK_N, BLOCK_D); S_ij = Q_i K_j^T: (BLOCK_M, BLOCK_D) @ (BLOCK_D, BLOCK_N) -> (BLOCK_M, BLOCK_N)
            k = _load_kv_block(
                K_src, b, h_kv, start, N_k, K.stride_n, K.stride_d, HEAD_DIM, BLOCK_N, BLOCK_D, F.TMA, MASK, WS
            )
            s = tl.dot(q, tl.trans(k), input_precision=F.DOT_PRECISION)
            if F.BLOCK_D2 > 0:
                # S_ij += Q_i[:, BLOCK_D:] K_j[:, BLOCK_D:]^T: (BLOCK_M, BLOCK_D2) @ (BLOCK_D2, BLOCK_N)
                if WS:
                    k2 = K2_src.load([start, BLOCK_D])  # lanes [BLOCK_D, BLOCK_D + BLOCK_D2); zeros past the ends
                else:
                    rows = tl.arange(0, BLOCK_N)
                    K2_block = K2_src + tl.cast(start, tl.int64) * K.stride_n
                    in_k = start + rows < N_k
                    k2 = _load_block_hi(
                        K2_block, rows, K.stride_n, K.stride_d, in_k, HEAD_DIM, BLOCK_D, F.BLOCK_D2, ROWS_OK=not MASK
                    )
                s = tl.dot(q2, tl.trans(k2), s, input_precision=F.DOT_PRECISION)
            offs_n = start + tl.arange(0, BLOCK_N)
            if F.SOFTCAP or F.ALIBI or F.ADD_MASK:
                s, _ = _modify_scores(
                    s * qk_scale,
                    offs_m[:, None],
                    offs_n[None, :],
                    OFFSET,
                    terms.softcap_log2,
                    slope_log2,
                    F.SOFTCAP,
                    F.ALIBI,
                )
                if F.ADD_MASK:
                    bias = _attn_mask_tile(
                        MASK_head, offs_m0, start, rows[:, None], cols[None, :], terms, drop_N_q, N_k
                    )
                    s = s + bias.to(tl.float32) * LOG2E
                s_scale = 1.0
                if F.SCORE_MOD is not None:
                    s = _score_mod(s * LN2, b, h, offs_m[:, None], offs_n[None, :], mods.score_captures, F.SCORE_MOD)
                    s_scale = LOG2E
            elif F.SCORE_MOD is not None:
                # natural units straight from the product (no log2 detour); LOG2E joins the exponent's FFMA
                s = _score_mod(s * nat_scale, b, h, offs_m[:, None], offs_n[None, :], mods.score_captures, F.SCORE_MOD)
                s_scale = LOG2E
            else:
                s_scale = qk_scale
            if MASK or F.BOOL_MASK or F.ADD_MASK or F.MASK_MOD is not None:
                visible = (offs_n < N_k)[None, :]
                if F.CAUSAL:
                    visible = visible & (offs_n[None, :] <= offs_m[:, None] + OFFSET)
                if F.WINDOW:
                    visible = visible & _in_window(offs_m[:, None], offs_n[None, :], OFFSET, bounds.LEFT, bounds.RIGHT)
                if F.BOOL_MASK:
                    user = _attn_mask_tile(
                        MASK_head, offs_m0, start, rows[:, None], cols[None, :], terms, drop_N_q, N_k
                    )
                    visible = visible & (user != 0)
                if F.MASK_MOD is not None:
                    visible = _mask_mod_visible(
                        visible, kind, b, h, offs_m[:, None], offs_n[None, :], mods.mask_captures, F.MASK_MOD
                    )
                s = tl.where(visible, s, float("-inf"))
                s_max = tl.max(s, 1)
                # a row with no visible key here has s_max = -inf; keep it -inf even when qk_scale = 0
                m_new = tl.maximum(m_i, tl.where(s_max == float("-inf"), float("-inf"), s_max * s_scale))
                # a row that has seen only masked keys keeps m = -inf; subtract 0 there, not (-inf) - (-inf)
                m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                # P_ij = exp2(S * qk_scale - m_new), 0 for invisible keys (also when qk_scale = 0)
                p = tl.math.exp2(tl.where(visible, s * s_scale - m_new_safe[:, None], float("-inf")))
            elif F.SCORE_MOD is not None:
                # every key is visible but score_mod may give -inf: for a whole row too, which keeps m = -inf
                m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
                m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(s * s_scale - m_new_safe[:, None])  # exp2(-inf) = 0: no select a score
            else:
                # m_new = max(m_i, qk_scale * rowmax(S_ij)); every row sees a finite score here
                m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
                m_new_safe = m_new
                # P_ij = exp(scale * S_ij - m_new), in base 2: one FFMA and one MUFU.EX2 per score
                p = tl.math.exp2(s * s_scale - m_new[:, None])
            # alpha = exp(m_i - m_new) rescales what was accumulated under the old max
            alpha = tl.math.exp2(m_i - m_new_safe)
            # l_new = alpha * l_i + rowsum(P_ij)
            l_i = l_i * alpha + tl.sum(p, 1)
            if F.DROPOUT:
                # l_i sums the undropped P (the softmax's denominator); acc takes P * Z / (1 - p), Z the keep
                # mask drawn from the weight's (b, h, i, j), the same on every path (flashattn_teach.dropout)
                keep = _dropout_keep(
                    dropout.seed, drop_offset, drop_bh, offs_m, offs_n, drop_N_q, drop_N_k, dropout.threshold
                )
                p = tl.where(keep, p * dropout.keep_scale, 0.0)
            # V_j: (BLOCK_N, BLOCK_DV)
            v = _load_kv_block(
                V_src, b, h_kv, start, N_k, V.stride_n, V.stride_d, HEAD_DIM_V, BLOCK_N, BLOCK_DV, F.TMA, MASK, WS
            )
            # acc = alpha * acc + P_ij V_j: P is cast to V's dtype so the matmul runs on tensor cores,
            # with an fp32 accumulator. (BLOCK_M, BLOCK_N) @ (BLOCK_N, BLOCK_DV) -> (BLOCK_M, BLOCK_DV)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=F.DOT_PRECISION)
            m_i = m_new
            if F.TRACE:
                _trace_block(trace, s * s_scale, m_i, l_i, alpha, acc, b, h, offs_m0, start, BLOCK_N=BLOCK_N)
    return acc, l_i, m_i
