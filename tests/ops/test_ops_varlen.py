"""The varlen op: torch.library's own checks, one compiled graph for different packings (numbers and
lengths of sequences, totals, max_seqlen), and the same values and gradients as eager."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import flashattn_teach as ft
from flashattn_teach.ops import varlen as ops_varlen

H_Q, H_KV, D = 4, 2, 8
# B + 1 in {3, 5, 6}, never H_Q or D: torch's duck sizing would tie cu_seqlens' size to an equal head count
PACKINGS = ([3, 9, 4, 1, 2], [7, 2], [5, 5, 6, 2], [12, 3, 3, 1, 1])


def _packed(lengths_q, lengths_k, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(sum(lengths_q) * 100 + len(lengths_q))
    cu_q = torch.tensor([0, *lengths_q]).cumsum(0)
    cu_k = torch.tensor([0, *lengths_k]).cumsum(0)
    q = torch.randn(sum(lengths_q), H_Q, D, generator=g, dtype=dtype)
    k = torch.randn(sum(lengths_k), H_KV, D, generator=g, dtype=dtype)
    v = torch.randn(sum(lengths_k), H_KV, D, generator=g, dtype=dtype)
    q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


def _opcheck_cases():
    q, k, v, cu_q, cu_k, m_q, m_k = _packed([2, 0, 5], [4, 3, 6], dtype=torch.float64, grad=True)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    plain = (q, k, v, cu_q, cu_k, m_q, m_k, None, False, "bottom_right", None, None, None, "auto")
    variants = (q, k, v, cu_q.int(), cu_k, m_q + 3, m_k, slopes, True, "top_left", 0.3, [2, 0], 2.0, "query_major")
    return {"plain": plain, "variants": variants}


@pytest.mark.parametrize("case", sorted(_opcheck_cases()))
def test_opcheck_passes(case):
    torch.library.opcheck(ops_varlen.attention_varlen, _opcheck_cases()[case])


def _varlen(q, k, v, cu_q, cu_k, m_q, m_k):
    return ft.flash_attention_varlen(q, k, v, cu_q, cu_k, m_q, m_k, causal=True, window=(5, 0), softcap=3.0)


def test_compile_makes_one_graph_for_every_packing():
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(_varlen, backend=counter, dynamic=True, fullgraph=True)
    for lengths in PACKINGS:
        args = _packed(lengths, lengths)
        torch.testing.assert_close(compiled(*args), _varlen(*args), atol=1e-6, rtol=1e-5)
    assert counter.frame_count == 1
    targets = []

    def backend(gm, _):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_varlen, backend=backend, dynamic=True, fullgraph=True)(*args)
    assert torch.ops.flashattn_teach.attention_varlen.default in targets
    assert len(targets) < 20  # traced through, the per-sequence checks and tiles give hundreds of nodes


def test_compiled_gradients_match_eager():
    def loss(*args):
        return _varlen(*args).square().sum()

    compiled = torch.compile(loss, backend="aot_eager", dynamic=True, fullgraph=True)
    for lengths_q, lengths_k in (([3, 9, 4, 0], [5, 9, 2, 3]),):
        q, k, v, *bounds = _packed(lengths_q, lengths_k, dtype=torch.float64, grad=True)
        expected = torch.autograd.grad(loss(q, k, v, *bounds), (q, k, v))
        got = torch.autograd.grad(compiled(q, k, v, *bounds), (q, k, v))
        for e, g_ in zip(expected, got, strict=True):
            torch.testing.assert_close(g_, e, atol=1e-10, rtol=1e-10)


def test_compiled_call_checks_shapes():
    compiled = torch.compile(_varlen, backend="eager", dynamic=True, fullgraph=True)
    q, k, v, *bounds = _packed([3, 4], [3, 4])
    with pytest.raises(Exception, match=r"q and k must have the same head dimension D"):
        compiled(q[..., :4], k, v, *bounds)
    with pytest.raises(Exception, match=r"cu_seqlens_q must be 1-D"):
        compiled(q, k, v, bounds[0][None], *bounds[1:])


def test_eager_calls_do_not_go_through_the_op(monkeypatch):
    def fail(*args):
        raise AssertionError("eager call used the custom op")

    monkeypatch.setattr(ops_varlen, "attention_varlen", fail)
    _varlen(*_packed([3, 4], [3, 4]))


def test_export_with_dynamic_packing():
    class Varlen(torch.nn.Module):
        def forward(self, q, k, v, cu_q, cu_k, m_q, m_k):
            return _varlen(q, k, v, cu_q, cu_k, m_q, m_k)

    total, bounds = torch.export.Dim("total", min=2, max=10_000), torch.export.Dim("B_plus_1", min=2, max=100)
    dims = (
        {0: total},
        {0: total},
        {0: total},
        {0: bounds},
        {0: bounds},
        torch.export.Dim.DYNAMIC,
        torch.export.Dim.DYNAMIC,
    )
    exported = torch.export.export(Varlen(), _packed(*PACKINGS[:1] * 2), dynamic_shapes=dims)
    args = _packed(PACKINGS[2], PACKINGS[2])
    torch.testing.assert_close(exported.module()(*args), _varlen(*args), atol=1e-6, rtol=1e-5)
