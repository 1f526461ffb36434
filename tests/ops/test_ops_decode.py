"""The decode op: torch.library's own checks (the in-place cache write declared), one graph for a compiled
decode loop over many steps and cache lengths, and the same outputs and caches as eager."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch._dynamo.testing

import flashattn_teach as ft
from flashattn_teach.serving import ops as ops_decode

B, H_Q, H_KV, D, N_MAX = 2, 4, 2, 8, 24
STEPS = 6


def _step_inputs(g, N_new=1, dtype=torch.float32):
    q = torch.randn(B, H_Q, N_new, D, generator=g, dtype=dtype)
    k = torch.randn(B, H_KV, N_new, D, generator=g, dtype=dtype)
    v = torch.randn(B, H_KV, N_new, D, generator=g, dtype=dtype)
    return q, k, v


def _caches(g, dtype=torch.float32):
    return torch.randn(B, H_KV, N_MAX, D, generator=g, dtype=dtype), torch.randn(
        B, H_KV, N_MAX, D, generator=g, dtype=dtype
    )


def _opcheck_cases():
    g = torch.Generator().manual_seed(0)
    kc, vc = _caches(g, torch.float64)
    q, k, v = _step_inputs(g, N_new=2, dtype=torch.float64)
    lens = torch.tensor([5, 11])
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    append = (q, kc, vc, k, v, lens, None, True, None, None, None, 0, "auto", None)
    no_append = (q, kc, vc, None, None, lens, None, False, 0.3, None, None, 2, "query_major", None)
    variants = (q, kc, vc, k, v, lens.int(), slopes, True, None, [4, 0], 2.0, 3, "key_major", None)
    # what a call under torch.autocast hands the op: q cast to bfloat16, the caches and k, v in their own dtype
    kc32, vc32, k32, v32 = (t.float() for t in (kc, vc, k, v))
    autocast = (q.bfloat16(), kc32, vc32, k32, v32, lens, None, True, None, None, None, 0, "auto", torch.bfloat16)
    return {"append": append, "no_append": no_append, "variants": variants, "autocast": autocast}


@pytest.mark.parametrize("case", sorted(_opcheck_cases()))
def test_opcheck_passes(case):
    torch.library.opcheck(ops_decode.attention_with_kvcache, _opcheck_cases()[case])


def _decode(q, k_cache, v_cache, k, v, lens):
    return ft.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, window=(7, 0), num_splits=2)


@pytest.mark.parametrize("lengths", ["tensor", "int"])
def test_compiled_decode_loop_is_one_graph_for_every_step(lengths):
    """A decode loop: the caches grow by one key per step; compiled, it is one graph (no recompile per
    step), its outputs and its in-place cache writes those of the eager loop."""
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(_decode, backend=counter, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    kc, vc = _caches(g)
    kc_eager, vc_eager = kc.clone(), vc.clone()
    start = torch.tensor([3, 9]) if lengths == "tensor" else 3
    for s in range(STEPS):
        q, k, v = _step_inputs(g)
        lens = start + s
        torch.testing.assert_close(compiled(q, kc, vc, k, v, lens), _decode(q, kc_eager, vc_eager, k, v, lens))
        torch.testing.assert_close((kc, vc), (kc_eager, vc_eager), atol=0, rtol=0)
    assert counter.frame_count == 1
    assert torch.ops.flashattn_teach.attention_with_kvcache.default in _graph_targets(q, kc, vc, k, v, lens)


def _graph_targets(*args):
    """The functions of the graph dynamo records for one call of ``_decode``."""
    targets = []

    def backend(gm, _):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_decode, backend=backend, dynamic=True, fullgraph=True)(*args)
    assert len(targets) < 20  # the traced loops over batch elements and ranges give hundreds of nodes
    return targets


def test_compiled_write_reaches_the_caches_after_functionalization():
    """aot_eager functionalizes the in-place write (the caches are graph inputs it copies back into)."""
    compiled = torch.compile(_decode, backend="aot_eager", dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(2)
    kc, vc = _caches(g)
    kc_eager, vc_eager = kc.clone(), vc.clone()
    for lens in (torch.tensor([0, 4]), torch.tensor([1, 5]), torch.tensor([2, 6])):
        q, k, v = _step_inputs(g)
        torch.testing.assert_close(compiled(q, kc, vc, k, v, lens), _decode(q, kc_eager, vc_eager, k, v, lens))
        torch.testing.assert_close((kc, vc), (kc_eager, vc_eager), atol=0, rtol=0)


def test_compiled_call_checks_cache_seqlens():
    compiled = torch.compile(_decode, backend="eager", dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    kc, vc = _caches(g)
    q, k, v = _step_inputs(g)
    with pytest.raises(Exception, match="cache_seqlens must have shape"):
        compiled(q, kc, vc, k, v, torch.tensor([1, 2, 3]))


def test_eager_calls_and_gradients_do_not_go_through_the_op(monkeypatch):
    """Eager calls never use the op, and a compiled call that needs a gradient (into q, with no new keys)
    is traced through: the op is not differentiated."""

    def fail(*args):
        raise AssertionError("the decode op was used")

    g = torch.Generator().manual_seed(4)
    kc, vc = _caches(g)
    q, _, _ = _step_inputs(g)
    monkeypatch.setattr(ops_decode, "attention_with_kvcache", fail)
    ft.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([4, 7]))
    assert not ops_decode.traceable(q.requires_grad_(), kc, vc, None, None, None)
    with torch.no_grad():
        assert ops_decode.traceable(q, kc, vc, None, None, None)


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU code needs a C++ compiler")
def test_inductor_writes_the_caches_as_eager():
    """torch.compile's default backend: inductor re-inplaces the functionalized write into the caches."""
    compiled = torch.compile(_decode, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(5)
    kc, vc = _caches(g)
    kc_eager, vc_eager = kc.clone(), vc.clone()
    for lens in (torch.tensor([0, 4]), torch.tensor([1, 5])):
        q, k, v = _step_inputs(g)
        torch.testing.assert_close(compiled(q, kc, vc, k, v, lens), _decode(q, kc_eager, vc_eager, k, v, lens))
        torch.testing.assert_close((kc, vc), (kc_eager, vc_eager), atol=0, rtol=0)


def test_export_with_dynamic_batch_and_cache_size():
    class Step(torch.nn.Module):
        def forward(self, q, k_cache, v_cache, k, v, lens):
            return _decode(q, k_cache, v_cache, k, v, lens)

    batch, n_max = torch.export.Dim("B", max=64), torch.export.Dim("N_max", min=2, max=4096)
    g = torch.Generator().manual_seed(6)
    args = (*_step_inputs(g)[:1], *_caches(g), *_step_inputs(g)[1:], torch.tensor([3, 5]))
    dims = ({0: batch}, {0: batch, 2: n_max}, {0: batch, 2: n_max}, {0: batch}, {0: batch}, {0: batch})
    exported = torch.export.export(Step(), args, dynamic_shapes=dims)
    q, k, v = (torch.randn(3, H, 1, D, generator=g) for H in (H_Q, H_KV, H_KV))
    k_cache, v_cache = (torch.randn(3, H_KV, 50, D, generator=g) for _ in range(2))
    lens = torch.tensor([0, 17, 49])
    expected_caches = (k_cache.clone(), v_cache.clone())
    expected = _decode(q, *expected_caches, k, v, lens)
    torch.testing.assert_close(exported.module()(q, k_cache, v_cache, k, v, lens), expected)
    torch.testing.assert_close((k_cache, v_cache), expected_caches, atol=0, rtol=0)


# ------------------------------------------------------- compiled calls that need a gradient


def _decode_variants(q, k_cache, v_cache, lens):
    slopes = torch.tensor([[0.5, 0.25, 0.125, 0.0625], [0.3, 0.2, 0.1, 0.05]])  # (B, H_q)
    return ft.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, causal=True, window=(5, 1), softcap=2.0, alibi_slopes=slopes,
        return_lse=True,
    )  # fmt: skip


@pytest.mark.parametrize("lengths", ["tensor", "int"])
def test_compiled_call_that_needs_a_gradient_is_one_graph_for_every_length(lengths):
    """A gradient into q: the op is not differentiated, so the step is built from torch ops in the graph
    (decode_traced.py), and still makes one graph for every step; outputs, gradients and the in-place
    writes are the eager call's."""
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(_decode, backend=counter, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(7)
    kc, vc = _caches(g)
    kc_eager, vc_eager = kc.clone(), vc.clone()
    start = torch.tensor([3, 9]) if lengths == "tensor" else 3
    for s in range(4):
        q, k, v = _step_inputs(g)
        q_eager = q.clone().requires_grad_()
        q.requires_grad_()
        lens = start + s
        O, O_eager = compiled(q, kc, vc, k, v, lens), _decode(q_eager, kc_eager, vc_eager, k, v, lens)
        torch.testing.assert_close(O, O_eager)
        torch.testing.assert_close(torch.autograd.grad(O.sum(), q), torch.autograd.grad(O_eager.sum(), q_eager))
        torch.testing.assert_close((kc, vc), (kc_eager, vc_eager), atol=0, rtol=0)
    assert counter.frame_count == 1


def test_compiled_gradients_into_the_caches_with_every_variant():
    """No new entries: q and both caches differentiated, with a window both ways, softcap and ALiBi per
    batch element, several causal queries, one of them over a cache too short to show it a key."""
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(_decode_variants, backend=counter, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(B, H_Q, 3, D, generator=g).requires_grad_()
    kc, vc = (t.requires_grad_() for t in _caches(g))
    lens = torch.tensor([1, 17])
    (O, lse), (O_eager, lse_eager) = compiled(q, kc, vc, lens), _decode_variants(q, kc, vc, lens)
    torch.testing.assert_close((O, lse), (O_eager, lse_eager))
    w = torch.randn(O.shape, generator=g)
    grads = torch.autograd.grad((O * w).sum(), (q, kc, vc))
    grads_eager = torch.autograd.grad((O_eager * w).sum(), (q, kc, vc))
    torch.testing.assert_close(grads, grads_eager)
    assert counter.frame_count == 1


def test_compiled_call_that_needs_a_gradient_checks_tensor_lengths_in_the_graph():
    compiled = torch.compile(_decode, backend="eager", dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(9)
    kc, vc = _caches(g)
    before = (kc.clone(), vc.clone())
    q, k, v = _step_inputs(g)
    with pytest.raises(RuntimeError, match=r"cache_seqlens must lie in \[0, N_max - N_new_kv\]"):
        compiled(q.requires_grad_(), kc, vc, k, v, torch.tensor([3, N_MAX]))
    torch.testing.assert_close((kc, vc), before, atol=0, rtol=0)  # checked before the write


# ------------------------------------------------------------------ the same errors as eager


COMPILED_REFUSALS = {
    "causal=1": {"causal": 1},
    "return_lse": {"return_lse": "yes"},
    "window": {"window": (-2, 0)},
    "softcap": {"softcap": -1.0},
    "num_splits": {"num_splits": -1},
    "backend": {"backend": "fast"},
    "int with no room": {"cache_seqlens": N_MAX},
    "tensor with no room": {"cache_seqlens": torch.tensor([3, N_MAX])},
    "cache_seqlens type": {"cache_seqlens": "3"},
    "heads": {"q": torch.randn(B, 3, 1, D)},
}


@pytest.mark.parametrize("grad", [False, True], ids=["op", "traced"])
@pytest.mark.parametrize("refusal", COMPILED_REFUSALS)
def test_compiled_calls_refuse_what_eager_calls_refuse_in_the_same_words(refusal, grad):
    g = torch.Generator().manual_seed(10)
    kc, vc = _caches(g)
    q, k, v = _step_inputs(g)
    args = {"q": q.requires_grad_(grad), "k_cache": kc, "v_cache": vc, "k": k, "v": v, "cache_seqlens": 3}
    args.update(COMPILED_REFUSALS[refusal])
    if grad and refusal == "tensor with no room":
        pytest.skip("checked in the graph: the test above")
    before = (kc.clone(), vc.clone())
    with pytest.raises(ft.AttentionError) as eager:
        ft.flash_attention_with_kvcache(**args)
    for fullgraph in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda: ft.flash_attention_with_kvcache(**args), backend="eager", dynamic=True, fullgraph=fullgraph
        )
        with pytest.raises(Exception) as info:
            compiled()
        if not fullgraph:  # with fullgraph=True, an error while tracing is torch's own (Unsupported)
            assert type(info.value) is type(eager.value) and str(info.value) == str(eager.value)
        torch.testing.assert_close((kc, vc), before, atol=0, rtol=0)
