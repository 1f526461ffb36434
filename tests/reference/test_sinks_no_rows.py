"""Attention sinks with no query row at all (``N_q = 0``; varlen with ``total_q = 0``, as an empty chunk of a
chunked prefill gives): empty outputs and zero gradients on every backend, as without sinks; the sink's
gradient is a sum over no row. Before, every tiled backward failed reshaping its 0 rows."""

from __future__ import annotations

import pytest
import torch

import flashattn_teach as fa

BACKENDS = ["auto", "dense", "query_major", "key_major", "parallel"]
H, N_k, D = 4, 5, 8


def leaves(q_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(q_shape, generator=g, dtype=torch.float64)
    k, v = (torch.randn(kv_shape, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, sinks)]


def assert_zero_gradients(out: torch.Tensor, lse: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    grads = torch.autograd.grad((out.sum(), lse.sum()), tensors)
    for t, g in zip(tensors, grads, strict=True):
        torch.testing.assert_close(g, torch.zeros_like(t), rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_with_no_query_row_give_empty_outputs_and_zero_gradients(backend: str) -> None:
    q, k, v, sinks = leaves((2, H, 0, D), (2, H, N_k, D))
    out, lse = fa.flash_attention(q, k, v, sinks=sinks, backend=backend, return_lse=True)
    assert out.shape == (2, H, 0, D) and lse.shape == (2, H, 0)
    assert_zero_gradients(out, lse, [q, k, v, sinks])


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_sinks_with_no_query_row_give_empty_outputs_and_zero_gradients(backend: str) -> None:
    q, k, v, sinks = leaves((0, H, D), (N_k, H, D))
    out, lse = fa.flash_attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q=torch.tensor([0, 0], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, N_k], dtype=torch.int32),
        max_seqlen_q=0,
        max_seqlen_k=N_k,
        sinks=sinks,
        backend=backend,
        return_lse=True,
    )
    assert out.shape == (0, H, D)
    assert_zero_gradients(out, lse, [q, k, v, sinks])
