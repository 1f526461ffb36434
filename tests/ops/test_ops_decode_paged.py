"""The decode op and the traced compile path with a paged cache, ``cache_leftpad`` and sinks: torch.library's
checks, one graph for a compiled decode loop over a paged pool, and the eager call's outputs, pools and
gradients."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import flashattn_teach as ft
from flashattn_teach.serving import ops as ops_decode

B, H_Q, H_KV, D, PAGE, MAX_BLOCKS = 2, 4, 2, 8, 5, 6
NUM_BLOCKS = B * MAX_BLOCKS + 2


def _pools(g, dtype=torch.float32):
    # flash-attn's (num_blocks, page_size, H_kv, D) pools, seen head-major
    return tuple(torch.randn(NUM_BLOCKS, PAGE, H_KV, D, generator=g, dtype=dtype).transpose(1, 2) for _ in range(2))


def _table(g):
    return torch.randperm(NUM_BLOCKS, generator=g)[: B * MAX_BLOCKS].reshape(B, MAX_BLOCKS).to(torch.int32)


def _step(g, N_new=1, dtype=torch.float32):
    return tuple(torch.randn(B, h, N_new, D, generator=g, dtype=dtype) for h in (H_Q, H_KV, H_KV))


def test_opcheck_passes_with_pages_leftpad_and_sinks():
    g = torch.Generator().manual_seed(0)
    kc, vc = (t.contiguous() for t in _pools(g, torch.float64))  # opcheck clones its inputs: no views
    q, k, v = _step(g, N_new=2, dtype=torch.float64)
    table, lens = _table(g), torch.tensor([7, 20], dtype=torch.int32)
    pad, sinks = torch.tensor([2, 0], dtype=torch.int32), torch.randn(H_Q, generator=g, dtype=torch.float64)
    args = ops_decode.DecodeArgs(
        k=k,
        v=v,
        cache_seqlens=lens,
        alibi_slopes=None,
        causal=True,
        scale=None,
        window=None,
        softcap=None,
        num_splits=2,
        backend="query_major",
        autocast=None,
        block_table=table,
        cache_leftpad=pad,
        sinks=sinks,
    )
    torch.library.opcheck(ops_decode.attention_with_kvcache, (q, kc, vc, *ops_decode.op_args(args)))


def _decode(q, k_pool, v_pool, k, v, lens, table, pad, sinks):
    return ft.flash_attention_with_kvcache(
        q, k_pool, v_pool, k, v, cache_seqlens=lens, block_table=table, cache_leftpad=pad, sinks=sinks,
        window=(7, 0), num_splits=2, return_lse=True,
    )  # fmt: skip


@pytest.mark.parametrize("grad", [False, True], ids=["op", "traced"])
def test_compiled_paged_decode_loop_is_one_graph_with_the_eager_pools_and_outputs(grad):
    """A decode loop over a paged pool, the lengths growing by one a step: one graph, the eager call's
    outputs and pools bit for bit in the pools; with a gradient into q and sinks (the traced path), the
    eager call's gradients."""
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(_decode, backend=counter, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    kp, vp = _pools(g)
    kp_eager, vp_eager = kp.clone(), vp.clone()
    table, pad = _table(g), torch.tensor([1, 3], dtype=torch.int32)
    sinks = torch.randn(H_Q, generator=g)
    for s in range(4):
        q, k, v = _step(g)
        lens = torch.tensor([4, 12]) + s
        q_eager, sinks_eager = q.clone().requires_grad_(grad), sinks.clone().requires_grad_(grad)
        q.requires_grad_(grad)
        sinks.requires_grad_(grad)
        O, lse = compiled(q, kp, vp, k, v, lens, table, pad, sinks)
        O_eager, lse_eager = _decode(q_eager, kp_eager, vp_eager, k, v, lens, table, pad, sinks_eager)
        torch.testing.assert_close((O, lse), (O_eager, lse_eager))
        torch.testing.assert_close((kp, vp), (kp_eager, vp_eager), atol=0, rtol=0)
        if grad:
            got = torch.autograd.grad((O.sum() + lse.sum()), (q, sinks))
            want = torch.autograd.grad((O_eager.sum() + lse_eager.sum()), (q_eager, sinks_eager))
            torch.testing.assert_close(got, want)
        sinks = sinks.detach()
    assert counter.frame_count == 1


def test_compiled_traced_call_checks_block_ids_in_the_graph():
    compiled = torch.compile(_decode, backend="eager", dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(2)
    kp, vp = _pools(g)
    q, k, v = _step(g)
    table = _table(g)
    table[1, 0] = NUM_BLOCKS  # a page the step reads, past the pool
    with pytest.raises(RuntimeError, match="block_table"):
        compiled(q.requires_grad_(), kp, vp, k, v, torch.tensor([4, 12]), table, None, None)
