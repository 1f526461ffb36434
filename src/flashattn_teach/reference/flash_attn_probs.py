"""flash-attn's ``S_dmask``: the attention weights a call with dropout used, and which of them it dropped.

flash-attn's ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``; ``S_dmask`` is meant for
tests: its kernel writes each weight relative to a running row maximum, with the sign bit set where dropout
zeroed it, and only when ``dropout_p > 0`` (an empty tensor otherwise). Here, for query row ``i`` and key
``j`` of head ``h``::

    S_ij        the scaled, capped and biased score (flashattn_teach.reference.dense's definition)
    m_i         = max_j S_ij over the keys row i sees (0 for a row that sees none)
    S_dmask_ij  = exp(S_ij - m_i)   if kept,   -exp(S_ij - m_i)   if dropped,   0 if not visible

so ``|S_dmask_ij| * exp(m_i - lse_i)`` is the softmax weight ``P_ij``: the convention of a kernel whose one
key block spans the whole row (``flashattn_teach.flash_attn_interface._get_block_size_n`` says so to
flash-attn's test helpers). The keep mask is :mod:`flashattn_teach.dropout`'s, at the counters the call drew
(rebuilt from torch's generator state before the call), so the signs are exactly
the weights the call dropped. It holds all ``N_q x N_k`` weights: for tests, as flash-attn says of its own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._layout import compute_dtype
from .._options import PackedKeywords, make_options
from ..dropout import DropoutKey, counters, draw, keep_mask
from .scores import soft_cap


def _replayed_key(state: Tensor, dropout_p: float) -> DropoutKey:
    """The dropout key a call drew first thing from torch's default generator, whose state before the call
    was ``state`` (:func:`flashattn_teach.dropout.draw`)."""
    generator = torch.Generator()
    generator.set_state(state)
    return draw(dropout_p, generator)


def signed_weights(
    qh: Tensor,
    kh: Tensor,
    options: PackedKeywords,
    *,
    alibi_slopes: Tensor | None,
    rng_state: Tensor,
    bh: Tensor,
    rows: Tensor,
    cols: Tensor,
    counter_shape: tuple[int, int],
) -> Tensor:
    """``S_dmask`` of one call or one packed sequence, ``(..., H_q, N_q, N_k)`` in ``qh``'s dtype.

    ``qh (..., H_q, N_q, D)``, ``kh (..., H_kv, N_k, D)``, ``options`` the call's (masks aligned bottom-right as
    flash-attn's), with ``alibi_slopes`` those of these rows (one packed sequence's); ``bh``, ``rows``,
    ``cols`` the dropout counters' coordinates of these weights (broadcastable to the scores) and
    ``counter_shape`` the ``(N_q, N_k)`` they count in (a packed call's ``(total_q, total_k)``); ``rng_state``:
    ``torch.get_rng_state()`` just before the call, whose dropout key is drawn again from it.
    """
    # the weights before dropout: the sign carries it, from the key drawn again below
    opts = make_options(qh, kh, kh, options, enable_gqa=True, alibi_slopes=alibi_slopes, dropout_p=0.0)
    s = opts.shapes
    dt = compute_dtype(qh.dtype)
    qc, kc = qh.detach().to(dt), kh.detach().to(dt)
    if s.group > 1:
        kc = kc.repeat_interleave(s.group, dim=-3)  # query head h reads key head h // G
    S = torch.matmul(qc * s.scale, kc.transpose(-2, -1))  # (..., N_q, D) @ (..., D, N_k) -> (..., N_q, N_k)
    if opts.mask.softcap is not None:
        S = soft_cap(S, opts.mask.softcap)
    visible, bias = opts.mask.dense(qh.device)
    if bias is not None:
        S = S + bias
    if visible is not None:
        S = S.masked_fill(~visible, float("-inf"))
    m = S.amax(dim=-1, keepdim=True)  # (..., N_q, 1)
    m = m.masked_fill(torch.isneginf(m), 0.0)  # a row that sees nothing: exp(-inf - 0) = 0, not NaN
    weights = torch.exp(S - m)  # (..., N_q, N_k), 0 where not visible
    key = _replayed_key(rng_state, options.get("dropout_p", 0.0))
    kept = keep_mask(key, counters(key, bh, rows, cols, *counter_shape))
    return torch.where(kept, weights, -weights).to(qh.dtype)
