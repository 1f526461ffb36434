"""A decode step in which no row sees a key (``cache_seqlens = 0`` and no new keys, or ``cache_leftpad ==
cache_seqlens``) still gives ``O`` attached to ``q`` (and the caches, the sinks), with the gradients of the
softmax's definition: zeros, and with sinks the sink's own (all of a row's weight is on its sink, ``O = 0``,
``lse = sink_h``), as ``flash_attention`` with ``N_k = 0`` and torch's SDPA give. Judged against a float64
reference written here from the definition."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import flashattn_teach as fa

B, H_q, H_kv, N_new, N_max, D = 2, 4, 2, 3, 6, 8


def reference(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, lo: list[int], hi: list[int]
) -> tuple[Tensor, Tensor]:
    """float64 ``(O, lse)``: row softmax over keys ``[lo[b], hi[b])`` and the head's sink (a column of
    score ``sink_h`` and value 0); a row with neither gives ``O = 0``, ``lse = -inf``."""
    G = H_q // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    S = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H_q, N_new, D) @ (B, H_q, D, N_max) -> (B, H_q, N_new, N_max)
    j = torch.arange(N_max)
    seen = torch.stack([(j >= a) & (j < b) for a, b in zip(lo, hi, strict=True)])[:, None, None, :]
    S = S.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        S = torch.cat([S, sinks.reshape(1, H_q, 1, 1).expand(B, H_q, N_new, 1)], dim=-1)
    lse = torch.logsumexp(S, dim=-1)  # (B, H_q, N_new)
    P = torch.exp(S - lse[..., None]).nan_to_num(0.0)[..., :N_max]  # nan: a row of -inf only
    return P @ v, lse  # (B, H_q, N_new, N_max) @ (B, H_q, N_max, D)


def loss_grads(O: Tensor, lse: Tensor, leaves: list[Tensor]) -> list[Tensor]:
    g = torch.Generator().manual_seed(3)
    dO = torch.randn(O.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    loss = (O * dO).sum() + torch.where(torch.isfinite(lse), lse * dlse, 0.0).sum()
    return list(torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("backend", ["auto", "dense", "query_major", "key_major", "parallel"])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("case", ["empty_cache", "leftpad_equals_seqlens"])
def test_step_that_sees_no_key_gives_the_gradients_of_the_definition(case: str, with_sinks: bool, backend: str) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H_q, N_new, D, generator=g, dtype=torch.float64, requires_grad=True)
    k_cache = torch.randn(B, H_kv, N_max, D, generator=g, dtype=torch.float64, requires_grad=True)
    v_cache = torch.randn(B, H_kv, N_max, D, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(H_q, generator=g, dtype=torch.float64, requires_grad=True) if with_sinks else None
    if case == "empty_cache":
        seqlens, leftpad, lo = torch.zeros(B, dtype=torch.int32), None, [0, 0]
    else:
        seqlens = torch.tensor([4, 2], dtype=torch.int32)
        leftpad, lo = seqlens.clone(), [4, 2]
    O, lse = fa.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, cache_leftpad=leftpad, sinks=sinks, backend=backend, return_lse=True
    )
    O_ref, lse_ref = reference(q, k_cache, v_cache, sinks, lo, seqlens.tolist())
    torch.testing.assert_close(O, O_ref)
    torch.testing.assert_close(lse, lse_ref)
    leaves = [q, k_cache, v_cache] + ([sinks] if sinks is not None else [])
    grads = loss_grads(O, lse, leaves)
    for got, want in zip(grads, loss_grads(O_ref, lse_ref, leaves), strict=True):
        torch.testing.assert_close(got, want)
    if sinks is not None:  # the control: the sink's gradient is the lse's weight, not zero
        assert bool(grads[3].abs().min() > 0)


def test_step_with_new_keys_only_for_q_still_attaches_q() -> None:
    """With ``k, v`` the caches are written, not differentiated: ``q`` alone is attached (``N_new_kv = 0``
    new keys: nothing visible)."""
    q = torch.randn(1, H_q, 1, D, requires_grad=True)
    k_cache, v_cache = torch.randn(1, H_kv, N_max, D), torch.randn(1, H_kv, N_max, D)
    k, v = torch.randn(1, H_kv, 0, D), torch.randn(1, H_kv, 0, D)
    O = fa.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=0)
    O.sum().backward()
    assert q.grad is not None and torch.equal(q.grad, torch.zeros_like(q))
    assert torch.equal(O, torch.zeros_like(O))
