"""Launchers: validate (with the checks every backend shares), allocate, choose a configuration, launch.

The kernels see four-dimensional ``(B, H, N, D)`` tensors with arbitrary strides. User tensors in torch's
``(..., H, N, D)`` layout are brought there by :func:`to_4d`, which is a view (no copy) whenever the
leading dimensions allow it: a ``(B, N, H, D)`` tensor transposed to ``(B, H, N, D)`` is passed as is.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .._layout import pad_rank
from .._validate.fp8 import Fp8Descale
from .._validate.inputs import AttentionShapes
from ..errors import AttentionValueError
from ..masks.causal import diagonal_offset
from .configs import (
    TEST_CONFIG,
    AttentionConfig,
    arch_of,
    block_d,
    check_backward_config,
    dot_precision,
    fused_backward,
    lane_groups,
    shipped_config,
)
from .devices import launches_on_device
from .flags import kernel_flags
from .forward_trace import ForwardTrace, traced_tile
from .kernels.records import Descales, DkdvTensors, DqTensors, ForwardTensors, Lse, RowStats, split, strided
from .provenance import as_tried
from .tma import descriptor, ensure_scratch_allocator, forward_tile, launch_tile
from .trace_backward import BackwardTrace, check_trace, check_trace_tile
from .variants import PLAIN, KernelVariants


def default_config(
    q: Tensor, s: AttentionShapes, variants: KernelVariants = PLAIN, *, tried: bool = True
) -> AttentionConfig:
    """The shipped configuration for these inputs (and variants), without the paths no GPU has run unless
    they are switched on (:func:`.provenance.as_tried`; ``tried=False``: the table's row, all of them); the
    fixed test configuration in the interpreter."""
    if q.device.type != "cuda":
        return TEST_CONFIG
    return arch_config(arch_of(q.device), q.dtype, s, variants, tried=tried)


def arch_config(
    arch: str, dtype: torch.dtype, s: AttentionShapes, variants: KernelVariants = PLAIN, *, tried: bool = True
) -> AttentionConfig:
    """:func:`default_config` for a GPU generation (``"sm90"`` or ``"sm80"``) and dtype, asked of no device."""
    row = shipped_config(
        s.D, dtype, arch, variants=variants.used, dropout=variants.has_dropout, head_dim_v=s.D_v,
        attn_mask=variants.attn_mask is not None,
    )  # fmt: skip
    return as_tried(row) if tried else row


def to_4d(t: Tensor, s: AttentionShapes, heads: int) -> Tensor:
    """``(*batch, heads, N, X)`` (or ``(N, X)``, or with broadcast batch dims) -> ``(B, heads, N, X)``."""
    t = pad_rank(t, max(s.rank, 3))
    t = t.expand(*s.batch, heads, t.shape[-2], t.shape[-1])
    B = 1
    for b in s.batch:
        B *= b
    return t.reshape(B, heads, t.shape[-2], t.shape[-1])


def descale_record(descale: Fp8Descale) -> Descales:
    """An FP8 call's :class:`~.records.Descales`: the three contiguous, so that one pair of strides serves them."""
    q, k, v, stride_b, stride_h = descale.kernel_args()
    return Descales(q, k, v, stride_b, stride_h)


def stats(t: Tensor) -> Lse:
    """A row statistic of the call's rows, ``(B, H_q, N_q)`` contiguous fp32 (lse, lse2, delta), as the
    kernels read it: its pointer and its head stride (``(1, H_q, total_q)`` with packed sequences)."""
    return Lse(t, t.shape[-1])


def _grid_lengths(s: AttentionShapes, variants: KernelVariants) -> tuple[int, int]:
    """``(N_q, N_k)`` as the kernels take them: the longest sequences with packed sequences (the grid's
    extent; each program reads its own lengths), else the shapes'."""
    if variants.varlen:
        return variants.max_seqlen_q, variants.max_seqlen_k
    return s.N_q, s.N_k


def _offset(s: AttentionShapes, causal_align: str, variants: KernelVariants) -> int:
    """The kernels' ``OFFSET``: the diagonal offset, or with packed sequences or ``seqlens_k`` 1 for
    bottom-right alignment and 0 for top-left (each program multiplies it by its sequence's ``N_k - N_q``,
    or by its batch element's ``seqlens_k[b] - N_q``: flash-attn aligns to each one's own length)."""
    if variants.varlen or variants.has_seqlens:
        return int(causal_align == "bottom_right")
    return diagonal_offset(s.N_q, s.N_k, causal_align)


def check_tile_offsets(kernel: str, block_rows: int, **tensors: Tensor) -> None:
    """Refuse tensors whose offsets inside one tile (``block_rows`` rows) overflow int32: the kernels move
    each block's base pointer in 64-bit arithmetic but index within a tile in 32-bit."""
    for name, t in tensors.items():
        _, _, stride_n, stride_x = t.stride()
        span = (block_rows - 1) * abs(stride_n) + (t.shape[-1] - 1) * abs(stride_x)
        if span >= 2**31:
            raise AttentionValueError(
                f"{name} {tuple(t.shape)} with strides {t.stride()}: a {kernel} tile of {block_rows} rows spans "
                f"{span} elements, beyond 32-bit offsets; pass a contiguous tensor (.contiguous())"
            )


@launches_on_device
def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: AttentionShapes,
    *,
    causal: bool,
    causal_align: str,
    config: AttentionConfig,
    variants: KernelVariants = PLAIN,
    descale: Fp8Descale | None = None,
    sinks: Tensor | None = None,
    trace: ForwardTrace | None = None,
) -> tuple[Tensor, Tensor]:
    """``q (B, H_q, N_q, D)``, ``k (B, H_kv, N_k, D)``, ``v (B, H_kv, N_k, D_v)`` -> ``O (B, H_q, N_q, D_v)``
    in q's dtype and ``lse (B, H_q, N_q)`` in float32. ``variants``: window, softcap, ALiBi, ``seqlens_k``
    (a window carries causal in its right side, so ``causal`` is then ignored). ``descale``: an FP8 call's
    factors (e4m3 inputs, checked by :mod:`flashattn_teach._validate.fp8`): ``O`` is then bfloat16, as FA3's.
    ``sinks (H_q,)``: attention sinks, read in fp32 (``lse`` includes them). ``trace``: :mod:`.forward_trace`."""
    import triton

    from .kernels.forward import LOG2E, attn_fwd

    B = q.shape[0]
    fp8 = descale is not None
    o = torch.empty((B, s.H_q, s.N_q, s.D_v), dtype=torch.bfloat16 if fp8 else q.dtype, device=q.device)
    lse = torch.empty((B, s.H_q, s.N_q), dtype=torch.float32, device=q.device)
    var = variants.varlen
    c, ws = (traced_tile(config, variants, fp8), False) if trace else forward_tile(config.forward, q, k, v, variants)
    D_pad, D2 = lane_groups(s.D)
    if D2 and not ws:  # a split head dim's lane groups: by in-kernel descriptors or pointers (kernels/tiles.py)
        c = c.by_pointers()
    if ws:
        tma = True  # by descriptors the kernel makes
    else:
        c, tma = launch_tile(c, k, v, varlen=var)
    check_tile_offsets("forward", c.BLOCK_M, q=q, o=o)
    check_tile_offsets("forward", c.BLOCK_N, k=k, v=v)
    N_q, N_k = _grid_lengths(s, variants)
    Dv_pad = block_d(s.D_v)
    if ws and q.device.type == "cuda":
        ensure_scratch_allocator()  # the kernel makes its own descriptors (see attn_fwd)
    host_descriptors = tma and not ws
    K_src = descriptor(k, c.BLOCK_N, D_pad) if host_descriptors else k
    V_src = descriptor(v, c.BLOCK_N, Dv_pad) if host_descriptors else v
    # one program per (query block, batch, head), the query block fastest (see attn_fwd)
    grid = (triton.cdiv(N_q, c.BLOCK_M) * variants.batch(B) * s.H_q,)
    # without score modifiers the scale's sign moves into Q and |scale| into the exponent (see attn_fwd); the
    # FP8 build moves the sign of scale * qd * kd itself
    signed = variants.modifies_scores or fp8
    flags = kernel_flags(
        variants, causal=causal, config=config, block_d2=D2, precision=dot_precision(q.dtype), trace=trace is not None
    )
    attn_fwd[grid](
        *split(
            ForwardTensors(
                strided(q, varlen=var),
                strided(K_src, k.stride(), varlen=var),
                strided(V_src, v.stride(), varlen=var),
                strided(o, varlen=var),
            )
        ),
        stats(lse),
        H_q=s.H_q,
        N_q=N_q,
        N_k=N_k,
        GROUP=s.group,
        qk_scale=(s.scale if signed else abs(s.scale)) * LOG2E.value,
        bounds=variants.bounds(_offset(s, causal_align, variants)),
        terms=variants.score_terms(),
        dropout=variants.dropout_args(),
        packed=variants.packed(),
        mods=variants.mods_record(q.device, c.BLOCK_M, c.BLOCK_N, N_q, N_k, listed=True),
        descales=None if descale is None else descale_record(descale),
        SINK=None if sinks is None else sinks.to(torch.float32).contiguous(),
        trace=trace,
        HEAD_DIM=s.D,
        HEAD_DIM_V=s.D_v,
        BLOCK_D=D_pad,
        BLOCK_DV=Dv_pad,
        BLOCK_M=c.BLOCK_M,
        BLOCK_N=c.BLOCK_N,
        F=flags._replace(TMA=host_descriptors),
        NEGATE_Q=s.scale < 0 and not signed,
        WS=ws,
        # the specialised build's one loop needs no mask when every row sees every key of every block
        EVEN_N=ws and N_k % c.BLOCK_N == 0 and not (causal or variants.window or variants.has_seqlens),
        FP8=fp8,
        SINKS=sinks is not None,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
    )
    return o, lse


@launches_on_device
def backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    dlse: Tensor | None,
    s: AttentionShapes,
    *,
    causal: bool,
    causal_align: str,
    config: AttentionConfig,
    variants: KernelVariants = PLAIN,
    deterministic: bool = False,
    trace: BackwardTrace | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients in the kernels' layout: ``dq (B, H_q, N_q, D)``, ``dk, dv (B, H_kv, N_k, .)``, each in
    its input's dtype. With grouped-query attention ``dk, dv`` are already summed over the group.
    ``variants`` as the forward's.

    The one-kernel backward (``config.backward_fused``) runs unless ``deterministic``, the config has no
    such tile or ``N_q`` is below its ``BLOCK_M`` (:func:`fused_backward`); otherwise the dK/dV and dQ
    kernels. Each kernel runs on a one-dimensional grid of ``n_blocks * B * H`` programs (see :mod:`.backward`).
    ``trace``: the kernels' trace build (:mod:`.trace_backward`) fills it, through pointers."""
    import triton

    from .kernels.backward import attn_bwd_preprocess
    from .kernels.backward_dkdv import attn_bwd_dkdv
    from .kernels.backward_dq import attn_bwd_dq
    from .kernels.forward import LOG2E

    dkdv_config, dq_config = check_backward_config(config, q, s)
    check_trace(trace, s, variants, q.shape[0])
    B = q.shape[0]
    (D_pad, D2), Dv_pad = lane_groups(s.D), block_d(s.D_v)
    offset = _offset(s, causal_align, variants)
    var = variants.varlen
    N_q, N_k = _grid_lengths(s, variants)
    n_seq = variants.batch(B)
    qk_scale = s.scale * LOG2E.value
    flags = kernel_flags(
        variants, causal=causal, config=config, block_d2=D2, precision=dot_precision(q.dtype), trace=trace is not None
    )

    # delta = rowsum(dO * O) and lse2 = lse * log2(e) (+inf for a row that saw no key), as lse: (B, H_q, N_q)
    delta = torch.empty((B, s.H_q, s.N_q), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    c = config.backward_preprocess
    check_tile_offsets("backward_preprocess", c.BLOCK_M, o=o, do=do)
    row_stats = RowStats(lse2, delta, lse2.shape[-1], None if trace is None else trace.buffer)  # as lse, or packed
    attn_bwd_preprocess[(triton.cdiv(s.N_q, c.BLOCK_M) * B * s.H_q,)](
        strided(o),
        strided(do),
        lse.contiguous(),
        row_stats,
        H_q=s.H_q,
        N_q=s.N_q,
        HEAD_DIM_V=s.D_v,
        BLOCK_DV=Dv_pad,
        BLOCK_M=c.BLOCK_M,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
    )
    if dlse is not None:
        # a gradient into lse adds dlse_i * P_ij to dS_ij, i.e. delta_i -= dlse_i
        delta -= dlse.to(torch.float32)

    dk = torch.empty((B, s.H_kv, s.N_k, s.D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, s.H_kv, s.N_k, s.D_v), dtype=v.dtype, device=v.device)
    fused = fused_backward(config, deterministic, s.N_q)
    # the one-kernel backward adds dQ partials into a zeroed fp32 buffer (B, H_q, N_q, D); the other path has none
    dq_acc = torch.zeros((B, s.H_q, s.N_q, s.D), dtype=torch.float32, device=q.device) if fused else None
    tile = config.backward_fused if fused and config.backward_fused is not None else dkdv_config
    c, tma = launch_tile(tile.by_pointers() if D2 or trace else tile, q, do, varlen=var)  # Q_i, dO_i by TMA
    check_trace_tile(trace, "backward_dkdv", c)
    check_tile_offsets("backward_dkdv", c.BLOCK_M, q=q, do=do)
    check_tile_offsets("backward_dkdv", c.BLOCK_N, k=k, v=v)
    q_src = descriptor(q, c.BLOCK_M, D_pad) if tma else q
    do_src = descriptor(do, c.BLOCK_M, Dv_pad) if tma else do
    # one launch computing dK and dV, or (``split``) one for dK and one for dV
    # the dK/dV loop runs a group's heads in one flat loop: over a list of query tiles only when one list
    # serves them all (kinds broadcast over heads, or no group)
    kinds = variants.tile_kinds(c.BLOCK_M, c.BLOCK_N)
    listed_columns = kinds is not None and (s.group == 1 or kinds.shape[1] == 1)
    for with_dk, with_dv in ((True, False), (False, True)) if c.split else ((True, True),):
        attn_bwd_dkdv[(triton.cdiv(N_k, c.BLOCK_N) * n_seq * s.H_kv,)](
            *split(
                DkdvTensors(
                    strided(q_src, q.stride(), varlen=var),
                    strided(k, varlen=var),
                    strided(v, varlen=var),
                    strided(do_src, do.stride(), varlen=var),
                    strided(dk, varlen=var),
                    strided(dv, varlen=var),
                    None if dq_acc is None else strided(dq_acc, varlen=var),
                )
            ),
            row_stats,
            H_q=s.H_q,
            H_kv=s.H_kv,
            N_q=N_q,
            N_k=N_k,
            GROUP=s.group,
            scale=s.scale,
            qk_scale=qk_scale,
            bounds=variants.bounds(offset),
            terms=variants.score_terms(),
            dropout=variants.dropout_args(),
            packed=variants.packed(),
            mods=variants.mods_record(q.device, c.BLOCK_M, c.BLOCK_N, N_q, N_k, listed=listed_columns, columns=True),
            HEAD_DIM=s.D,
            HEAD_DIM_V=s.D_v,
            BLOCK_D=D_pad,
            BLOCK_DV=Dv_pad,
            BLOCK_M=c.BLOCK_M,
            BLOCK_N=c.BLOCK_N,
            F=flags._replace(TMA=tma, LISTED=listed_columns),
            WITH_DK=with_dk,
            WITH_DV=with_dv,
            DQ_ATOMIC=fused,
            SCORE_GRAD=variants.score_grad_fn,
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )
    if dq_acc is not None:
        # torch's cast (one elementwise pass, bandwidth-bound, which a kernel of ours would not beat); for
        # fp32 inputs the buffer is dQ itself
        return dq_acc.to(q.dtype), dk, dv

    dq = torch.empty((B, s.H_q, s.N_q, s.D), dtype=q.dtype, device=q.device)
    c, tma = launch_tile(dq_config.by_pointers() if D2 or trace else dq_config, k, v, varlen=var)  # K_j, V_j too
    check_trace_tile(trace, "backward_dq", c)
    if trace is not None:  # triton 3.6's pipeliner fails the traced dQ loop (make_ttgir); one stage, the same numbers
        c = replace(c, num_stages=1)
    check_tile_offsets("backward_dq", c.BLOCK_M, q=q, do=do)
    check_tile_offsets("backward_dq", c.BLOCK_N, k=k, v=v)
    k_src = descriptor(k, c.BLOCK_N, D_pad) if tma else k
    v_src = descriptor(v, c.BLOCK_N, Dv_pad) if tma else v
    attn_bwd_dq[(triton.cdiv(N_q, c.BLOCK_M) * n_seq * s.H_q,)](
        *split(
            DqTensors(
                strided(q, varlen=var),
                strided(k_src, k.stride(), varlen=var),
                strided(v_src, v.stride(), varlen=var),
                strided(do, varlen=var),
                strided(dq, varlen=var),
            )
        ),
        row_stats,
        H_q=s.H_q,
        N_q=N_q,
        N_k=N_k,
        GROUP=s.group,
        scale=s.scale,
        qk_scale=qk_scale,
        bounds=variants.bounds(offset),
        terms=variants.score_terms(),
        dropout=variants.dropout_args(),
        packed=variants.packed(),
        mods=variants.mods_record(q.device, c.BLOCK_M, c.BLOCK_N, N_q, N_k, listed=True),
        HEAD_DIM=s.D,
        HEAD_DIM_V=s.D_v,
        BLOCK_D=D_pad,
        BLOCK_DV=Dv_pad,
        BLOCK_M=c.BLOCK_M,
        BLOCK_N=c.BLOCK_N,
        F=flags._replace(TMA=tma),
        SCORE_GRAD=variants.score_grad_fn,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
    )
    return dq, dk, dv
