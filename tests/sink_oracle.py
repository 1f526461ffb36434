"""The float64 oracle of attention with sinks, written from the definition and nothing of the library's code:
the scores of each (batch element, head) with one more column, the head's sink, a softmax over the row, the
column dropped (GPT-OSS's eager attention). Shared by the CPU and the Triton tests of sinks."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flashattn_teach import dropout as dp


def visible(
    B: int,
    N_q: int,
    N_k: int,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    window: tuple[int, int] | None = None,
    seqlens_k: Tensor | None = None,
) -> Tensor:
    """Bool ``(B, 1, N_q, N_k)``: query row ``i`` sits at key position ``i + off`` (``off = n_b - N_q``
    bottom-right, ``n_b`` the element's ``seqlens_k[b]`` or ``N_k``; 0 top-left) and sees ``j < n_b``, with
    ``causal`` ``j <= i + off``, with a ``window`` ``i + off - left <= j <= i + off + right`` (-1: unbounded)."""
    i, j = torch.arange(N_q)[:, None], torch.arange(N_k)[None, :]
    lengths = [N_k] * B if seqlens_k is None else [int(n) for n in seqlens_k.cpu()]
    out = torch.zeros(B, 1, N_q, N_k, dtype=torch.bool)
    for b, n in enumerate(lengths):
        off = n - N_q if causal_align == "bottom_right" else 0
        ok = j < n
        if causal:
            ok = ok & (j <= i + off)
        if window is not None:
            left, right = window
            if left >= 0:
                ok = ok & (j >= i + off - left)
            if right >= 0:
                ok = ok & (j <= i + off + right)
        out[b, 0] = ok
    return out


def sink_oracle(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor | None,
    *,
    softcap: float | None = None,
    key: dp.DropoutKey | None = None,
    **mask: object,
) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of ``q (B, H_q, N_q, D)``, ``k, v (B, H_kv, N_k, .)`` with ``sinks (H_q,)`` (None: the
    plain softmax, for the negative controls), in the inputs' dtype (pass float64), differentiable.
    ``mask``: :func:`visible`'s keywords. Dropout by ``key``: the keep mask of :mod:`flashattn_teach.dropout`
    at ``(b * H_q + h, i, j)``; ``lse`` undropped. A row that sees nothing: ``O = 0``, ``lse = sink_h``
    (``-inf`` without sinks)."""
    B, H_q, N_q, D = q.shape
    N_k = k.shape[2]
    G = H_q // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # query head h reads h // G
    S = (q @ k.transpose(-2, -1)) / math.sqrt(D)  # (B, H_q, N_q, D) @ (B, H_q, D, N_k) -> (B, H_q, N_q, N_k)
    if softcap is not None:
        S = softcap * torch.tanh(S / softcap)
    S = S.masked_fill(~visible(B, N_q, N_k, **mask), float("-inf"))  # type: ignore[arg-type]
    if sinks is not None:
        S = torch.cat([S, sinks.to(S.dtype).reshape(1, H_q, 1, 1).expand(B, H_q, N_q, 1)], dim=-1)
    empty = torch.isneginf(S).all(dim=-1, keepdim=True)  # only without sinks (or with a sink of -inf)
    S = S.masked_fill(empty, 0.0)
    lse = torch.logsumexp(S, dim=-1)  # (B, H_q, N_q)
    P = torch.softmax(S, dim=-1).masked_fill(empty, 0.0)
    if sinks is not None:
        P = P[..., :N_k]  # the sink's column has no value
    if key is not None and key.p > 0.0:
        bh = (torch.arange(B)[:, None] * H_q + torch.arange(H_q)[None, :])[..., None, None]  # (B, H_q, 1, 1)
        i, j = torch.arange(N_q)[:, None], torch.arange(N_k)[None, :]
        keep = dp.keep_mask(key, dp.counters(key, bh, i, j, N_q, N_k))  # (B, H_q, N_q, N_k)
        P = torch.where(keep, P * key.keep_scale, 0.0)
    return P @ v, lse.masked_fill(empty[..., 0], float("-inf"))  # (B, H_q, N_q, N_k) @ (B, H_q, N_k, D_v)


def grads_of(O: Tensor, lse: Tensor, leaves: list[Tensor], seed: int = 7) -> list[Tensor]:
    """Gradients of ``sum(O * dO) + sum(lse * dlse)`` (random ``dO, dlse`` of ``seed``; rows of ``lse = -inf``
    left out) into ``leaves``, zeros for a leaf the loss does not reach."""
    g = torch.Generator().manual_seed(seed)
    dO = torch.randn(O.shape, generator=g, dtype=torch.float64).to(O.device, O.dtype)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.device, lse.dtype)
    loss = (O * dO).sum() + torch.where(torch.isfinite(lse), lse * dlse, 0.0).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(t) if d is None else d for d, t in zip(grads, leaves, strict=True)]
