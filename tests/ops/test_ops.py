"""The custom ops: torch.library's own checks, one graph for every sequence length under torch.compile,
a dynamic torch.export, and the same values and gradients as eager."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import flashattn_teach as ft
from flashattn_teach.ops import attention as ops

LENGTHS = (17, 33, 64, 100, 129)


def _qkv(B, H_q, H_kv, N_q, N_k, D=16, dtype=torch.float64, grad=False):
    g = torch.Generator().manual_seed(N_q * 1000 + N_k)
    q = torch.randn(B, H_q, N_q, D, generator=g, dtype=dtype)
    k = torch.randn(B, H_kv, N_k, D, generator=g, dtype=dtype)
    v = torch.randn(B, H_kv, N_k, D, generator=g, dtype=dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _opcheck_cases():
    q, k, v = _qkv(2, 4, 2, 9, 11, grad=True)
    pad = torch.ones(2, 1, 1, 11, dtype=torch.bool)
    pad[1, ..., :4] = False
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    lengths = torch.tensor([11, 6])
    plain = (q, k, v, None, None, None, False, "top_left", None, None, None, True, "auto")
    causal = (q, k, v, None, None, None, True, "bottom_right", 0.3, None, None, True, "query_major")
    masked = (q, k, v, pad, None, None, True, "top_left", None, None, None, True, "auto")
    variants = (q, k, v, None, slopes, lengths, False, "top_left", None, [3, 1], 2.0, True, "key_major")
    seed = torch.tensor(1234567)
    dropout = (q, k, v, pad, None, None, True, "top_left", None, None, None, True, "query_major", 0.3, seed)
    # a GPT's q, k, v: one (B, N, 3 H D) projection split and transposed, so strided views with gaps
    qkv = torch.randn(2, 9, 3 * 4 * 16, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    qs, ks, vs = (t.view(2, 9, 4, 16).transpose(1, 2).requires_grad_() for t in qkv.split(64, dim=2))
    strided = (qs, ks, vs, None, None, None, True, "top_left", None, None, None, False, "auto")
    return {
        "plain": plain,
        "causal": causal,
        "masked": masked,
        "variants": variants,
        "dropout": dropout,
        "strided": strided,
    }


@pytest.mark.parametrize("case", sorted(_opcheck_cases()))
def test_opcheck_passes(case):
    torch.library.opcheck(ops.attention, _opcheck_cases()[case])


@pytest.mark.parametrize("fn", ["sdpa", "flash_attention_masked"])
def test_compile_makes_one_graph_for_five_lengths(fn):
    def sdpa(q, k, v):
        return ft.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def flash_attention_masked(q, k, v):
        pad = torch.ones(q.shape[0], 1, 1, k.shape[-2], dtype=torch.bool, device=q.device)
        pad[0, ..., :3] = False  # left padding of batch element 0
        return ft.flash_attention(q, k, v, causal=True, attn_mask=pad, window=(8, 0))

    f = {"sdpa": sdpa, "flash_attention_masked": flash_attention_masked}[fn]
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    for n in LENGTHS:
        q, k, v = _qkv(2, 4, 2, n, n, dtype=torch.float32)
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v), atol=1e-6, rtol=1e-5)
    assert counter.frame_count == 1
    assert counter.op_count == len(_graph_ops(f, (q, k, v)))  # the op, not an unrolled tile loop


def _graph_ops(f, args):
    """The nodes dynamo records for one call of ``f``."""
    gm_ops = []

    def backend(gm, _):
        gm_ops.extend(n for n in gm.graph.nodes if "call" in n.op)  # as CompileCounter counts them
        return gm.forward

    torch._dynamo.reset()
    torch.compile(f, backend=backend, dynamic=True, fullgraph=True)(*args)
    assert any(n.target is torch.ops.flashattn_teach.attention.default for n in gm_ops)
    assert len(gm_ops) < 20  # tile loops traced through give thousands of nodes
    return gm_ops


def test_compiled_backward_of_strided_views_matches_eager():
    # The backward op returns the gradients in the layout its fake promises (empty_like of q, k, v): with a
    # GPT's split-and-transposed views a contiguous gradient failed in the compiled graph.
    def f(qkv):  # qkv (B, N, 3C)
        q, k, v = (t.view(2, 8, 4, 16).transpose(1, 2) for t in qkv.split(64, dim=2))  # (B, H, N, D), strided
        return ft.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 8, 64)

    x = torch.randn(2, 8, 192, dtype=torch.float64, requires_grad=True)
    dO = torch.randn(2, 8, 64, dtype=torch.float64)
    (expected,) = torch.autograd.grad(f(x), x, dO)
    (got,) = torch.autograd.grad(torch.compile(f, backend="aot_eager", dynamic=True)(x), x, dO)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", ["auto", "dense"])
def test_compiled_gradients_match_eager(backend):
    """Also for the dense path, whose recompute in the backward op is plain torch ops, which record no graph
    below autograd unless the op turns autograd back on."""

    def loss(q, k, v):
        O = ft.flash_attention(q, k, v, causal=True, causal_align="bottom_right", softcap=3.0, backend=backend)
        return O.square().sum()

    compiled = torch.compile(loss, backend="aot_eager", dynamic=True, fullgraph=True)
    for n_q, n_k in ((5, 9), (12, 31)):
        q, k, v = _qkv(2, 4, 2, n_q, n_k, grad=True)
        expected = torch.autograd.grad(loss(q, k, v), (q, k, v))
        got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
        for e, g_ in zip(expected, got, strict=True):
            torch.testing.assert_close(g_, e, atol=1e-10, rtol=1e-10)


def test_compiled_dropout_is_one_graph_with_eager_masks_and_gradients():
    """The seed is drawn in the graph by torch's randint, as eager draws it: under the same torch seed the
    compiled forward, its gradients (the backward draws the forward's mask again) and the generator's state
    afterwards are eager's, bit for bit, for every length, in one graph. (Inductor replaces randint by its
    own generator unless ``torch._inductor.config.fallback_random``: other masks, as deterministic.)"""

    def f(q, k, v):
        return ft.flash_attention(q, k, v, causal=True, dropout_p=0.3, softcap=5.0)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    for n in (9, 17):
        q, k, v = _qkv(2, 4, 2, n, n, grad=True)
        dO = torch.randn(2, 4, n, 16, dtype=torch.float64)
        results = []
        for fn in (compiled, f):
            torch.manual_seed(5)
            O = fn(q, k, v)
            results.append((O, *torch.autograd.grad(O, (q, k, v), dO), torch.rand(())))
        got, expected = results
        assert (got[0] == 0).any()  # some weights were dropped
        for e, g_ in zip(expected, got, strict=True):
            torch.testing.assert_close(g_, e, atol=0, rtol=0)
    assert counter.frame_count == 1


def test_export_with_dynamic_batch_and_length():
    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return ft.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    B, N = torch.export.Dim("B", max=64), torch.export.Dim("N", min=2, max=4096)
    q, k, v = _qkv(2, 4, 2, 33, 33, dtype=torch.float32)
    dims = {0: B, 2: N}
    exported = torch.export.export(Attention(), (q, k, v), dynamic_shapes={"q": dims, "k": dims, "v": dims})
    q, k, v = _qkv(3, 4, 2, 70, 70, dtype=torch.float32)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(exported.module()(q, k, v), expected, atol=1e-5, rtol=1e-5)


def test_eager_calls_do_not_go_through_the_op(monkeypatch):
    def fail(*args):
        raise AssertionError("eager call used the custom op")

    monkeypatch.setattr(ops, "attention", fail)
    q, k, v = _qkv(1, 2, 2, 7, 7)
    ft.flash_attention(q, k, v, causal=True)
    ft.scaled_dot_product_attention(q, k, v)
