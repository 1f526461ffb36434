"""The FP8 (e4m3) forward, emulated on the CPU: every rounding the Triton kernel makes, and no other.

FlashAttention-3's FP8 forward (Shah et al. 2024, Sec. 3.3) takes ``q, k, v`` in e4m3 with float32
descales per (batch, key/value head) (:mod:`flashattn_teach._validate.fp8`). On the tensor cores the two
products take e4m3 operands and accumulate in fp32; between them the weights ``P_ij`` are rounded to e4m3,
the one rounding the 16-bit kernels do not make (theirs go to bf16 or fp16). Per query block ``i`` and key
block ``j``, with ``qd, kd, vd`` the block's (batch, key/value head) factors:

    S_ij = (q_i k_j^T) * scale * qd * kd             fp8 values, exact in fp32; fp32 product
    m_new, alpha, P_ij, l_i                          the online softmax (flashattn_teach.core.online_softmax)
    acc  = alpha * acc + e4m3(P_ij) V_j             l_i sums the unrounded P_ij, as the kernel does
    O_i  = vd * acc / l_i,   lse_i = m_i + log(l_i)

The e4m3 values of ``q, k, v`` are exact in float32, so upcasting them is no rounding; fp32 sums of the
products differ from the tensor cores' only in their order. ``P_ij`` depends on the running max, that is
on the key tiles: the emulation matches a kernel launched at the same ``BLOCK_N``. The mask contract
(causal, window, softcap, ALiBi, ``seqlens_k``) applies tile by tile as on every CPU path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._layout import to_grouped
from .._options import AttentionOptions
from .._validate.fp8 import FP8_DTYPE
from ..core.online_softmax import finalize, init_state, update
from .scores import bias_and_mask, soft_cap

# P_ij's rounding depends on the key tiles (the running max when each is folded in): the emulation rounds as
# a kernel launched with BLOCK_N keys does. Query rows are independent, so BLOCK_M changes no result, only
# how many rows each tile op takes (256: a few times faster than 64 at N = 2048 on this machine's CPU).
BLOCK_M = 256
BLOCK_N = 64


def round_e4m3(P_ij: Tensor) -> Tensor:
    """``P_ij`` rounded to e4m3 (round to nearest even, as the kernel's cvt.rn), back in float32."""
    return P_ij.to(FP8_DTYPE).to(torch.float32)


def fp8_forward(
    q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, *, block_m: int = BLOCK_M, block_n: int = BLOCK_N
) -> tuple[Tensor, Tensor]:
    """``q (B, H_q, N_q, D)``, ``k (B, H_kv, N_k, D)``, ``v (B, H_kv, N_k, D_v)`` in e4m3 (or sizes 1 that
    broadcast to those, as torch's), with ``opts.descale`` -> ``O (B, H_q, N_q, D_v)`` bfloat16 and
    ``lse (B, H_q, N_q)`` float32 (natural log, of the descaled scores; ``-inf`` and ``O = 0`` for a row that
    sees no key)."""
    s, d = opts.shapes, opts.descale
    if d is None:
        raise ValueError("fp8_forward needs an FP8 call's options (opts.descale is None)")
    B, H_kv, G = s.batch[0], s.H_kv, s.group
    # (B, H_q, N_q, D) -> (B, H_kv, G, N_q, D): the query heads of key/value head h_kv share its factors;
    # inputs of batch 1 or one head are expanded to the call's sizes first, as torch broadcasts them
    qg, kg, vg = to_grouped(q, k, v, s)  # e4m3 -> float32, exact
    # scale * qd * kd and vd, one per (b, h_kv): (B, H_kv) -> (B, H_kv, 1, 1, 1)
    score_scale = (s.scale * d.q * d.k).reshape(B, H_kv, 1, 1, 1)
    vd = d.v.reshape(B, H_kv, 1, 1, 1)
    tiling = opts.mask.tiling(block_m, block_n)
    softcap = opts.mask.softcap
    lead = qg.shape[:-2]
    # attention sinks (H_q,) -> (1, H_kv, G, 1): each row's state starts at its head's sink (init_state)
    sink = None if opts.sinks is None else opts.sinks.to(torch.float32).reshape(1, H_kv, G, 1)
    O_blocks, lse_blocks = [qg.new_empty((*lead, 0, s.D_v))], [qg.new_empty((*lead, 0))]
    for i, (r0, r1) in enumerate(tiling.row_blocks):  # query block i
        q_i = qg[..., r0:r1, :]  # (B, H_kv, G, Br, D)
        m_i, l_i, acc = init_state((*lead, r1 - r0), s.D_v, dtype=torch.float32, device=q.device, sink=sink)
        for j in tiling.key_blocks(i):  # key block j, tiles no row sees left out
            c0, c1 = tiling.col_blocks[j]
            allowed, bias = tiling.tile(i, j, q.device)
            # the fp8 product in fp32, then its one scale: (..., Br, D) @ (..., D, Bc) -> (..., Br, Bc)
            S_ij = torch.matmul(q_i, kg[..., c0:c1, :].transpose(-2, -1)) * score_scale
            if softcap is not None:
                S_ij = soft_cap(S_ij, softcap)
            S_ij = bias_and_mask(S_ij, allowed, bias)
            # P_ij reaches V_j rounded to e4m3 (the second fp8 product); l_i sums it unrounded
            m_i, l_i, acc = update(m_i, l_i, acc, S_ij, vg[..., c0:c1, :], round_e4m3)
        O_i, lse_i = finalize(m_i, l_i, acc)
        O_blocks.append(O_i * vd)  # the value descale, once per output row (the kernel's epilogue)
        lse_blocks.append(lse_i)
    O = torch.cat(O_blocks, dim=-2).reshape(B, s.H_q, s.N_q, s.D_v)  # (B, H_kv, G, N_q, D_v) -> (B, H_q, ...)
    lse = torch.cat(lse_blocks, dim=-1).reshape(B, s.H_q, s.N_q)
    return O.to(torch.bfloat16), lse
