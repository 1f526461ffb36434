"""The forward and backward of ``loops.py`` and ``backward.py`` as Triton kernels, one block per program.
``core`` never imports this file (nor triton): ``from flashattn_teach.core import kernel``. On a CPU it runs in
Triton's interpreter when ``TRITON_INTERPRET=1`` is set before triton is imported.

Forward (FA2 Alg. 1), a program per query block ``i``: ``Q_i`` loaded once, key blocks streamed through
:func:`_forward_inner` in two stages, ``MASK=False`` over the blocks every row sees whole, then ``MASK=True``
over the rest (the causal diagonal, the short last block). Scores live in base 2, ``exp(x) = exp2(x LOG2E)``,
with the scale folded into ``qk_scale = scale * LOG2E``; accumulation is float32; ``lse`` is stored in base e.

Backward (FA2 Alg. 2), three launches: :func:`_delta_kernel` (``delta_i = rowsum(dO_i * O_i)``), then
:func:`_dkdv_kernel` (a program per key block, ``dK_j, dV_j`` on chip) and :func:`_dq_kernel` (a program per
query block), both recomputing ``P_ij`` and ``dS_ij`` with :func:`_probs_and_ds`: each output has one writer,
no atomics. Any ``N`` (loads past the end read zeros), ``D <= 2^k`` lanes, ``D_v = D``. On a GPU float32 inputs
multiply in TF32 (``tl.dot``'s default).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from triton import language as tl

from ..errors import AttentionValueError
from .dense import check_inputs

LOG2E = tl.constexpr(1.44269504)  # 1/ln 2: exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.69314718)  # ln 2: log(x) = log2(x) * LN2


@triton.jit
def _rows(start, n_rows, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Offsets of rows ``[start, start + BLOCK)`` of a contiguous ``(n_rows, HEAD_DIM)`` matrix, and where they
    fall inside it: ``(BLOCK, BLOCK_D)`` each."""
    rows, lanes = start + tl.arange(0, BLOCK), tl.arange(0, BLOCK_D)
    return rows[:, None] * HEAD_DIM + lanes[None, :], (rows[:, None] < n_rows) & (lanes[None, :] < HEAD_DIM)


@triton.jit
def _load_rows(base, start, n_rows, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    at, ok = _rows(start, n_rows, HEAD_DIM, BLOCK, BLOCK_D)
    return tl.load(base + at, mask=ok, other=0.0)  # zeros past either end


@triton.jit
def _store_rows(base, x, start, n_rows, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    at, ok = _rows(start, n_rows, HEAD_DIM, BLOCK, BLOCK_D)
    tl.store(base + at, x.to(base.dtype.element_ty), mask=ok)  # float32 rounded to the output's dtype


@triton.jit
def _visible(offs_m, offs_n, N_K, CAUSAL: tl.constexpr):
    """True where query row ``offs_m`` may see key ``offs_n``: a real key, at or before the row if causal."""
    ok = offs_n[None, :] < N_K
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= offs_m[:, None])
    return ok


@triton.jit
def _key_stages(r0, N_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """``(full, end)`` for the query block at row ``r0``: keys ``[0, full)`` need no mask, ``[full, end)`` do."""
    full = N_K // BLOCK_N * BLOCK_N  # the short last key block is masked
    end = N_K
    if CAUSAL:
        full = tl.minimum(full, (r0 + 1) // BLOCK_N * BLOCK_N)  # a key block ending at or before row r0
        end = tl.minimum(N_K, r0 + BLOCK_M)  # keys after the block's last row are above the diagonal
    return full, end


@triton.jit
def _trace_tile(Trace, s, m_i, l_i, alpha, acc, c0, N_K, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The trace build's record of key block ``j = c0 / BLOCK_N`` for this program's rows, float32, after the
    update: ``Trace[i, j, row, :] = [s (BLOCK_N) | m_i | l_i | alpha | acc (BLOCK_D)]``, with ``s = S_ij LOG2E``
    and ``m_i`` in base 2 (times ``LN2`` for base e) and ``acc`` unnormalised. Head ``(b, h) = (0, 0)`` only."""
    BLOCK_M: tl.constexpr = s.shape[0]
    W: tl.constexpr = BLOCK_N + 3 + BLOCK_D  # one record row
    if tl.program_id(1) == 0:
        j = c0 // BLOCK_N
        rec = Trace + ((tl.program_id(0) * tl.cdiv(N_K, BLOCK_N) + j) * BLOCK_M + tl.arange(0, BLOCK_M)) * W  # rows
        tl.store(rec[:, None] + tl.arange(0, BLOCK_N)[None, :], s)  # (BLOCK_M, BLOCK_N)
        tl.store(rec + BLOCK_N, m_i)  # (BLOCK_M,)
        tl.store(rec + BLOCK_N + 1, l_i)
        tl.store(rec + BLOCK_N + 2, alpha)
        tl.store(rec[:, None] + BLOCK_N + 3 + tl.arange(0, BLOCK_D)[None, :], acc)  # (BLOCK_M, BLOCK_D)


@triton.jit
def _forward_inner(
    acc, l_i, m_i, q, K_head, V_head, start, end, offs_m, N_K, qk_scale, Trace,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
    TRACE: tl.constexpr,
):  # fmt: skip
    """Fold key blocks ``[start, end)`` into ``(acc, l_i, m_i)``: ``online_softmax.update`` in base 2."""
    for c0 in range(start, end, BLOCK_N):
        k = _load_rows(K_head, c0, N_K, HEAD_DIM, BLOCK_N, BLOCK_D)  # (BLOCK_N, BLOCK_D)
        v = _load_rows(V_head, c0, N_K, HEAD_DIM, BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N) = S_ij * LOG2E, float32
        if MASK:
            s = tl.where(_visible(offs_m, c0 + tl.arange(0, BLOCK_N), N_K, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: avoid -inf - -inf
        p = tl.math.exp2(s - m_safe[:, None])  # P_ij = exp(S_ij - m_new)
        alpha = tl.math.exp2(m_i - m_safe)  # exp(m_old - m_new), 0 before the first key
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # P_ij in the inputs' dtype for the MMA
        m_i = m_new
        if TRACE:
            _trace_tile(Trace, s, m_i, l_i, alpha, acc, c0, N_K, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
    return acc, l_i, m_i


@triton.jit
def _forward_kernel(
    Q, K, V, O, LSE, N_Q, N_K, qk_scale, Trace,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, TRACE: tl.constexpr = False,
):  # fmt: skip
    r0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # (b, h) flattened; int64: B H N D may pass 2^31
    Q_head, O_head = Q + bh * N_Q * HEAD_DIM, O + bh * N_Q * HEAD_DIM
    kv = (K + bh * N_K * HEAD_DIM, V + bh * N_K * HEAD_DIM)
    offs_m = r0 + tl.arange(0, BLOCK_M)
    q = _load_rows(Q_head, r0, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D)  # (BLOCK_M, BLOCK_D), loaded once
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full, end = _key_stages(r0, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _forward_inner(
        acc, l_i, m_i, q, *kv, 0, full, offs_m, N_K, qk_scale, Trace,
        HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASK=False, CAUSAL=CAUSAL, TRACE=TRACE,
    )  # fmt: skip
    acc, l_i, m_i = _forward_inner(
        acc, l_i, m_i, q, *kv, full, end, offs_m, N_K, qk_scale, Trace,
        HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASK=True, CAUSAL=CAUSAL, TRACE=TRACE,
    )  # fmt: skip
    empty = l_i == 0.0  # a row that saw no key: O = 0, lse = -inf
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)  # m + log l, back to base e
    _store_rows(O_head, acc / l_safe[:, None], r0, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D)
    tl.store(LSE + bh * N_Q + offs_m, lse, mask=offs_m < N_Q)


@triton.jit
def _delta_kernel(O, DO, DELTA, N_Q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """The preprocess: ``delta_i = rowsum(dO_i * O_i)`` (FA2 Alg. 2 line 4), float32."""
    r0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    o = _load_rows(O + bh * N_Q * HEAD_DIM, r0, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D).to(tl.float32)
    do = _load_rows(DO + bh * N_Q * HEAD_DIM, r0, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D).to(tl.float32)
    offs_m = r0 + tl.arange(0, BLOCK_M)
    tl.store(DELTA + bh * N_Q + offs_m, tl.sum(o * do, 1), mask=offs_m < N_Q)


@triton.jit
def _probs_and_ds(q, k, v, do, lse, delta, offs_m, offs_n, N_K, qk_scale, MASK: tl.constexpr, CAUSAL: tl.constexpr):
    """``core.backward.tile_terms`` in base 2: ``P_ij = exp2(S_ij LOG2E - lse_i LOG2E)``, ``dS_ij = P_ij *
    (dO_i V_j^T - delta_i)``, both ``(BLOCK_M, BLOCK_N)`` float32. ``lse = +inf`` on rows past ``N_Q`` and
    rows that saw no key, so their ``P`` is 0."""
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASK:
        s = tl.where(_visible(offs_m, offs_n, N_K, CAUSAL), s, float("-inf"))
    p = tl.math.exp2(s - lse[:, None] * LOG2E)
    dp = tl.dot(do, tl.trans(v))  # (BLOCK_M, BLOCK_N)
    return p, p * (dp - delta[:, None])


@triton.jit
def _load_stats(LSE_head, DELTA_head, offs_m, N_Q):
    """``lse_i`` (``+inf`` where there is no row or the row saw no key) and ``delta_i``, ``(BLOCK_M,)``."""
    lse = tl.load(LSE_head + offs_m, mask=offs_m < N_Q, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    return lse, tl.load(DELTA_head + offs_m, mask=offs_m < N_Q, other=0.0)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v, Q_head, DO_head, LSE_head, DELTA_head, start, end, offs_n, N_Q, N_K, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
):  # fmt: skip
    for r0 in range(start, end, BLOCK_M):  # query block i
        offs_m = r0 + tl.arange(0, BLOCK_M)
        q = _load_rows(Q_head, r0, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D)
        do = _load_rows(DO_head, r0, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D)
        lse, delta = _load_stats(LSE_head, DELTA_head, offs_m, N_Q)
        p, ds = _probs_and_ds(q, k, v, do, lse, delta, offs_m, offs_n, N_K, qk_scale, MASK=MASK, CAUSAL=CAUSAL)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do)  # dV_j += P_ij^T dO_i
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q)  # dK_j += dS_ij^T Q_i (times scale at the end)
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, N_Q, N_K, scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):  # fmt: skip
    """A program per key block ``j``. Keys past ``N_K`` read as zeros and meet only their own rows of
    ``dK_j, dV_j``, never stored, so only the causal diagonal needs a mask here."""
    c0 = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    offs_n = c0 + tl.arange(0, BLOCK_N)
    k = _load_rows(K + bh * N_K * HEAD_DIM, c0, N_K, HEAD_DIM, BLOCK_N, BLOCK_D)
    v = _load_rows(V + bh * N_K * HEAD_DIM, c0, N_K, HEAD_DIM, BLOCK_N, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    heads = (Q + bh * N_Q * HEAD_DIM, DO + bh * N_Q * HEAD_DIM, LSE + bh * N_Q, DELTA + bh * N_Q)
    start = 0
    if CAUSAL:  # rows before key c0 see none of this block; blocks from row c0 + BLOCK_N - 1 on see all of it
        start = c0 // BLOCK_M * BLOCK_M
        diag_end = tl.minimum((c0 + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M * BLOCK_M, N_Q)
        dk, dv = _dkdv_inner(
            dk, dv, k, v, *heads, start, diag_end, offs_n, N_Q, N_K, qk_scale,
            HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, MASK=True, CAUSAL=True,
        )  # fmt: skip
        start = tl.maximum(start, diag_end)
    dk, dv = _dkdv_inner(
        dk, dv, k, v, *heads, start, N_Q, offs_n, N_Q, N_K, qk_scale,
        HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, MASK=False, CAUSAL=CAUSAL,
    )  # fmt: skip
    _store_rows(DK + bh * N_K * HEAD_DIM, dk * scale, c0, N_K, HEAD_DIM, BLOCK_N, BLOCK_D)  # scale sum dS^T Q
    _store_rows(DV + bh * N_K * HEAD_DIM, dv, c0, N_K, HEAD_DIM, BLOCK_N, BLOCK_D)


@triton.jit
def _dq_inner(
    dq, q, do, lse, delta, K_head, V_head, start, end, offs_m, N_K, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
):  # fmt: skip
    for c0 in range(start, end, BLOCK_N):  # key block j
        k = _load_rows(K_head, c0, N_K, HEAD_DIM, BLOCK_N, BLOCK_D)
        v = _load_rows(V_head, c0, N_K, HEAD_DIM, BLOCK_N, BLOCK_D)
        offs_n = c0 + tl.arange(0, BLOCK_N)
        _, ds = _probs_and_ds(q, k, v, do, lse, delta, offs_m, offs_n, N_K, qk_scale, MASK=MASK, CAUSAL=CAUSAL)
        dq += tl.dot(ds.to(k.dtype), k)  # dQ_i += dS_ij K_j (times scale at the end)
    return dq


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, N_Q, N_K, scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):  # fmt: skip
    """A program per query block ``i``, the forward's stages: keys past ``N_K`` would add to ``dQ_i``."""
    r0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    offs_m = r0 + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + bh * N_Q * HEAD_DIM, r0, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D)
    do = _load_rows(DO + bh * N_Q * HEAD_DIM, r0, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D)
    lse, delta = _load_stats(LSE + bh * N_Q, DELTA + bh * N_Q, offs_m, N_Q)
    kv = (K + bh * N_K * HEAD_DIM, V + bh * N_K * HEAD_DIM)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full, end = _key_stages(r0, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _dq_inner(
        dq, q, do, lse, delta, *kv, 0, full, offs_m, N_K, qk_scale,
        HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASK=False, CAUSAL=CAUSAL,
    )  # fmt: skip
    dq = _dq_inner(
        dq, q, do, lse, delta, *kv, full, end, offs_m, N_K, qk_scale,
        HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASK=True, CAUSAL=CAUSAL,
    )  # fmt: skip
    _store_rows(DQ + bh * N_Q * HEAD_DIM, dq * scale, r0, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D)  # scale sum_j dS K


def _launch_sizes(q: Tensor, v: Tensor, block_m: int, block_n: int) -> dict[str, int]:
    """The constexprs shared by every launch, checked: blocks are powers of two >= 16 (``tl.dot``'s minimum)."""
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise AttentionValueError(f"{name} must be a power of two >= 16, got {size}; try 64")
    if v.shape[-1] != q.shape[-1]:
        raise AttentionValueError(f"the kernel needs v's head dim D_v = D = {q.shape[-1]}, got {v.shape[-1]}")
    D = q.shape[-1]
    return {"HEAD_DIM": D, "BLOCK_D": max(16, triton.next_power_of_2(D)), "BLOCK_M": block_m, "BLOCK_N": block_n}


def triton_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None, *, block_m=64, block_n=64,
    trace: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(O (B, H, N_q, D), lse (B, H, N_q) float32)`` as :func:`~flashattn_teach.core.dense.dense_attention`.
    ``trace``: a float32 buffer of :func:`trace_shape` that the trace build fills for head ``(0, 0)``."""
    scale = check_inputs(q, k, v, scale)
    sizes = _launch_sizes(q, v, block_m, block_n)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, N_Q, _ = q.shape
    O = torch.empty_like(q)
    lse = torch.empty((B, H, N_Q), dtype=torch.float32, device=q.device)
    if O.numel():
        grid = (triton.cdiv(N_Q, block_m), B * H)
        want = trace_shape(N_Q, k.shape[2], q.shape[-1], block_m, block_n)
        if trace is not None and (trace.shape != want or trace.dtype != torch.float32 or not trace.is_contiguous()):
            got = f"{trace.dtype} {tuple(trace.shape)}"
            raise AttentionValueError(f"trace must be contiguous float32 of shape {want} (trace_shape), got {got}")
        args = (q, k, v, O, lse, N_Q, k.shape[2], scale * LOG2E.value, trace)  # trace None: a constant, no argument
        _forward_kernel[grid](*args, CAUSAL=causal, TRACE=trace is not None, **sizes)
    return O, lse


def trace_shape(N_q: int, N_k: int, D: int, block_m: int, block_n: int) -> tuple[int, int, int, int]:
    """The trace buffer, float32: ``(T_r, T_c, BLOCK_M, BLOCK_N + 3 + BLOCK_D)``, one record per (program ``i``,
    key block ``j``) of :func:`_trace_tile`; records of key blocks a program skips are left as they were."""
    T_r, T_c = triton.cdiv(N_q, block_m), triton.cdiv(N_k, block_n)
    return T_r, T_c, block_m, block_n + 3 + max(16, triton.next_power_of_2(D))


def triton_backward(
    q: Tensor, k: Tensor, v: Tensor, O: Tensor, dO: Tensor, lse: Tensor, causal: bool = False,
    scale: float | None = None, *, block_m: int = 64, block_n: int = 64,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dq, dk, dv)`` as :func:`~flashattn_teach.core.backward.flash_backward`, from the forward's ``O, lse``."""
    scale = check_inputs(q, k, v, scale)
    sizes = _launch_sizes(q, v, block_m, block_n)
    q, k, v, O, dO = (t.contiguous() for t in (q, k, v, O, dO))
    lse = lse.to(torch.float32).contiguous()
    B, H, N_Q, _ = q.shape
    N_K = k.shape[2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if not q.numel() or not k.numel():
        return dq, dk, dv
    delta = torch.empty_like(lse)
    rows = (triton.cdiv(N_Q, block_m), B * H)
    _delta_kernel[rows](O, dO, delta, N_Q, HEAD_DIM=sizes["HEAD_DIM"], BLOCK_D=sizes["BLOCK_D"], BLOCK_M=block_m)
    args = (N_Q, N_K, scale, scale * LOG2E.value)
    _dkdv_kernel[(triton.cdiv(N_K, block_n), B * H)](q, k, v, dO, lse, delta, dk, dv, *args, CAUSAL=causal, **sizes)
    _dq_kernel[rows](q, k, v, dO, lse, delta, dq, *args, CAUSAL=causal, **sizes)
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):  # type: ignore[override]
        O, lse = triton_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, O, lse)
        ctx.causal, ctx.scale = causal, scale
        return O

    @staticmethod
    def backward(ctx, dO):  # type: ignore[override]
        q, k, v, O, lse = ctx.saved_tensors
        dq, dk, dv = triton_backward(q, k, v, O, dO, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None) -> Tensor:
    """``O`` of :func:`triton_forward`, differentiable: its backward is :func:`triton_backward`."""
    return _Attention.apply(q, k, v, causal, scale)
