"""Attention sinks on every CPU backend: ``O``, ``lse`` and the gradients of ``q, k, v`` and the sinks against
the float64 oracle of ``sink_oracle.py`` (the sink as one more score column, softmax, column dropped), with
causal masking, a window with softcap, grouped-query heads, ``D != D_v``, rows that see no key (``lse`` is
then the sink, ``O`` 0), dropout (``lse`` undropped), packed sequences, any tiling (a property), forward-mode
AD and torch.compile; the negative controls show that an oracle without the sink is far from the result."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flashattn_teach as fa
from flashattn_teach import dropout as dp
from flashattn_teach._options import make_options
from flashattn_teach.dispatch import planner
from flashattn_teach.errors import AttentionValueError
from flashattn_teach.reference import parallel
from flashattn_teach.reference.autograd import ORDERS
from flashattn_teach.reference.online import tiled_attention

from sink_oracle import grads_of, sink_oracle

CPU_BACKENDS = ["parallel", "query_major", "key_major", "dense"]
B, H_Q, H_KV, D, D_V = 2, 4, 2, 8, 6
TOL = dict(rtol=1e-10, atol=1e-10)

# name: (N_q, N_k, keywords of the call and of the oracle)
CASES = {
    "plain": (13, 11, {}),
    "causal": (13, 11, {"causal": True}),
    "window_softcap": (13, 11, {"window": (5, 2), "softcap": 3.0}),
    # bottom-right with N_q > N_k: rows 0..3 see no key
    "empty_rows": (13, 9, {"causal": True, "causal_align": "bottom_right"}),
    # batch element 0 has no key at all
    "seqlens_k": (13, 11, {"seqlens_k": torch.tensor([0, 7])}),
}


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 4 x 3 on every tiled backend, and the parallel path on its pool, so the state crosses tiles."""
    monkeypatch.setattr(parallel, "MIN_PARALLEL_SCORES", 0)
    for name, (order, _, _) in dict(planner.TILED).items():
        monkeypatch.setitem(planner.TILED, name, (order, 4, 3))
    monkeypatch.setattr(planner, "FEW_ROWS", 0)


def _leaves(N_q: int, N_k: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_Q, N_q, D, generator=g)
    k = torch.randn(B, H_KV, N_k, D, generator=g)
    v = torch.randn(B, H_KV, N_k, D_V, generator=g)
    sinks = torch.randn(H_Q, generator=g) * 2  # some large: the sink takes much of some rows
    return [t.to(dtype).requires_grad_() for t in (q, k, v, sinks)]


def assert_grads_match(O, lse, O_ref, lse_ref, leaves, label: str) -> None:
    """The gradients of q, k, v and the sinks through the call and through the oracle, for the same dO, dlse."""
    got, want = grads_of(O, lse, leaves), grads_of(O_ref, lse_ref, leaves)
    for name, g, w in zip(("q", "k", "v", "sinks"), got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL, msg=f"{label}: d{name}")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.usefixtures("small_tiles")
def test_sinks_match_the_float64_oracle_forward_and_backward(backend: str, case: str) -> None:
    N_q, N_k, kw = CASES[case]
    leaves = _leaves(N_q, N_k)
    O, lse = fa.flash_attention(*leaves[:3], sinks=leaves[3], backend=backend, return_lse=True, **kw)
    O_ref, lse_ref = sink_oracle(*leaves, **kw)
    torch.testing.assert_close(O, O_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)
    assert_grads_match(O, lse, O_ref, lse_ref, leaves, f"{backend} {case}")
    # negative control: the same call's oracle without the sink is far off
    O_plain, _ = sink_oracle(*leaves[:3], None, **kw)
    assert (O - O_plain).abs().max() > 1e-2


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_row_that_sees_no_key_gives_zero_and_lse_equal_to_its_sink(backend: str) -> None:
    N_q, N_k, kw = CASES["seqlens_k"]
    q, k, v, sinks = (t.detach() for t in _leaves(N_q, N_k))
    O, lse = fa.flash_attention(q, k, v, sinks=sinks, backend=backend, return_lse=True, **kw)
    assert torch.equal(O[0], torch.zeros_like(O[0]))  # batch element 0 has no key
    assert torch.equal(lse[0], sinks[:, None].expand(H_Q, N_q))


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.usefixtures("small_tiles")
def test_dropout_drops_key_weights_only_and_lse_stays_undropped(backend: str, causal: bool) -> None:
    p, seed = 0.3, 1234
    leaves = _leaves(13, 11)
    torch.manual_seed(seed)  # the call draws its key from torch's default generator
    O, lse = fa.flash_attention(
        *leaves[:3], sinks=leaves[3], causal=causal, dropout_p=p, backend=backend, return_lse=True
    )
    torch.manual_seed(seed)
    O_ref, lse_ref = sink_oracle(*leaves, causal=causal, key=dp.draw(p))
    torch.testing.assert_close(O, O_ref, **TOL)
    torch.testing.assert_close(lse, sink_oracle(*leaves, causal=causal)[1], **TOL)  # undropped
    assert_grads_match(O, lse, O_ref, lse_ref, leaves, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_sinks_get_their_gradient_in_their_dtype_when_q_k_v_need_none(backend: str) -> None:
    q, k, v, _ = (t.detach() for t in _leaves(13, 11))
    sinks = torch.randn(H_Q, generator=torch.Generator().manual_seed(5)).requires_grad_()  # float32 sinks
    O = fa.flash_attention(q, k, v, sinks=sinks, causal=True, backend=backend)
    (dsink,) = torch.autograd.grad(O.square().sum(), sinks)
    s64 = sinks.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(sink_oracle(q, k, v, s64, causal=True)[0].square().sum(), s64)
    assert dsink.dtype == torch.float32
    torch.testing.assert_close(dsink, want.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.usefixtures("small_tiles")
def test_varlen_sinks_match_the_oracle_per_sequence(backend: str) -> None:
    """Packed sequences, one of them without keys (its rows: lse = sink), bottom-right causal."""
    lengths = [(5, 7), (3, 0), (9, 6)]
    g = torch.Generator().manual_seed(2)
    qs = [torch.randn(H_Q, n, D, generator=g, dtype=torch.float64) for n, _ in lengths]
    ks = [torch.randn(H_KV, n, D, generator=g, dtype=torch.float64) for _, n in lengths]
    vs = [torch.randn(H_KV, n, D_V, generator=g, dtype=torch.float64) for _, n in lengths]
    sinks = torch.randn(H_Q, generator=g, dtype=torch.float64)
    leaves = [torch.cat(ts, dim=1).transpose(0, 1).contiguous().requires_grad_() for ts in (qs, ks, vs)]
    leaves.append(sinks.requires_grad_())
    cu_q = torch.tensor([0, 5, 8, 17], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 7, 13], dtype=torch.int32)
    O, lse = fa.flash_attention_varlen(
        *leaves[:3], cu_q, cu_k, 9, 7, causal=True, sinks=leaves[3], backend=backend, return_lse=True
    )
    q, k, v = leaves[:3]
    parts = []
    for b in range(3):
        rows, cols = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        # (len, H, D) -> (1, H, len, D)
        O_b, lse_b = sink_oracle(
            *(t[s].transpose(0, 1)[None] for t, s in ((q, rows), (k, cols), (v, cols))),
            sinks,
            causal=True,
            causal_align="bottom_right",
        )
        parts.append((O_b[0].transpose(0, 1), lse_b[0]))
    O_ref = torch.cat([o for o, _ in parts], dim=0)  # (total_q, H_q, D_v)
    lse_ref = torch.cat([lse_b for _, lse_b in parts], dim=1)  # (H_q, total_q)
    torch.testing.assert_close(O, O_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)
    assert torch.equal(lse[:, 5:8], sinks.detach()[:, None].expand(H_Q, 3))  # the sequence without keys
    assert_grads_match(O, lse, O_ref, lse_ref, leaves, backend)


@given(
    N_q=st.integers(1, 12),
    N_k=st.integers(0, 12),
    block_m=st.integers(1, 8),
    block_n=st.integers(1, 8),
    order=st.sampled_from(ORDERS),
    causal=st.booleans(),
)
def test_sinks_match_the_oracle_for_any_tiling(
    N_q: int, N_k: int, block_m: int, block_n: int, order: str, causal: bool
):
    leaves = _leaves(N_q, N_k, seed=N_q * 13 + N_k)
    q, k, v, sinks = leaves
    opts = make_options(q, k, v, causal=causal, causal_align="bottom_right", enable_gqa=True, sinks=sinks)
    O, lse = tiled_attention(q, k, v, opts, order=order, block_m=block_m, block_n=block_n)
    O_ref, lse_ref = sink_oracle(*leaves, causal=causal, causal_align="bottom_right")
    torch.testing.assert_close(O, O_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)
    for got, want in zip(grads_of(O, lse, leaves), grads_of(O_ref, lse_ref, leaves), strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_forward_mode_ad_carries_the_sinks_tangent() -> None:
    q, k, v, sinks = (t.detach() for t in _leaves(13, 11))
    tangents = tuple(torch.randn_like(t) for t in (q, k, v, sinks))

    def ours(q, k, v, s):
        return fa.flash_attention(q, k, v, sinks=s, causal=True, return_lse=True)

    def oracle(q, k, v, s):
        return sink_oracle(q, k, v, s, causal=True)

    (_, _), (tO, tlse) = torch.func.jvp(ours, (q, k, v, sinks), tangents)
    (_, _), (tO_ref, tlse_ref) = torch.func.jvp(oracle, (q, k, v, sinks), tangents)
    torch.testing.assert_close(tO, tO_ref, **TOL)
    torch.testing.assert_close(tlse, tlse_ref, **TOL)


def test_torch_func_grad_and_vmap_over_the_sinks() -> None:
    q, k, v, sinks = (t.detach() for t in _leaves(13, 11))

    def loss(fn):
        return lambda s, q: fn(q, k, v, s).square().sum()

    def ours(q, k, v, s):
        return fa.flash_attention(q, k, v, sinks=s, causal=True)

    def oracle(q, k, v, s):
        return sink_oracle(q, k, v, s, causal=True)[0]

    got = torch.func.grad(loss(ours), argnums=(0, 1))(sinks, q)
    want = torch.func.grad(loss(oracle), argnums=(0, 1))(sinks, q)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    many = torch.randn(3, H_Q, generator=torch.Generator().manual_seed(9), dtype=torch.float64)  # (3, H_q)
    O = torch.func.vmap(lambda s: ours(q, k, v, s))(many)  # (3, B, H_q, N_q, D_v)
    torch.testing.assert_close(O, torch.stack([oracle(q, k, v, s) for s in many]), **TOL)


def test_compiled_call_is_the_op_with_eager_values_and_gradients() -> None:
    leaves = [t.float() if t.is_floating_point() else t for t in _leaves(13, 11)]
    leaves = [t.detach().requires_grad_() for t in leaves]
    ops_seen = []

    def backend(gm, example_inputs):
        ops_seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def f(q, k, v, s):
        return fa.flash_attention(q, k, v, sinks=s, causal=True, return_lse=True)

    O, lse = torch.compile(f, backend=backend, fullgraph=True)(*leaves)
    assert torch.ops.flashattn_teach.attention.default in ops_seen
    O_e, lse_e = f(*leaves)
    torch.testing.assert_close(O, O_e, rtol=0, atol=0)
    for got, want in zip(grads_of(O, lse, leaves), grads_of(O_e, lse_e, leaves), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_bfloat16_error_at_most_twice_plain_pytorchs() -> None:
    """flash-attn's rule for low precision: against float64 on the same rounded inputs, at most about twice
    the error of plain PyTorch (the sink column, softmax, column dropped) computed in bfloat16."""
    q, k, v, sinks = (t.detach().to(torch.bfloat16) for t in _leaves(64, 80, dtype=torch.float32))
    O = fa.flash_attention(q, k, v, sinks=sinks.float(), causal=True)
    exact, _ = sink_oracle(*(t.double() for t in (q, k, v, sinks)), causal=True)
    plain, _ = sink_oracle(q, k, v, sinks, causal=True)  # the oracle's own ops, in bfloat16 throughout
    err, err_torch = (O.double() - exact).abs().max(), (plain.double() - exact).abs().max()
    assert err <= 2 * err_torch + 1e-3, (float(err), float(err_torch))


def test_sinks_of_another_shape_are_refused_by_name() -> None:
    q, k, v, _ = (t.detach() for t in _leaves(5, 5))
    with pytest.raises(AttentionValueError, match=r"sinks must have shape \(4,\).*got \(2\)"):
        fa.flash_attention(q, k, v, sinks=torch.zeros(2, dtype=q.dtype))
    with pytest.raises(AttentionValueError, match=r"sinks must have shape \(4,\)"):
        fa.flash_attention_varlen(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
            torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32), 5, 5,
            sinks=torch.zeros(4, 1),
        )  # fmt: skip


@pytest.mark.parametrize("fn", ["online_attention", "key_major_attention", "dense_attention"])
def test_the_reference_functions_take_sinks(fn: str) -> None:
    q, k, v, sinks = (t.detach() for t in _leaves(13, 11))
    tiles = {} if fn == "dense_attention" else {"block_m": 4, "block_n": 3}
    O, lse = getattr(fa.reference, fn)(q, k, v, sinks=sinks, enable_gqa=True, causal=True, return_lse=True, **tiles)
    O_ref, lse_ref = sink_oracle(q, k, v, sinks, causal=True)
    torch.testing.assert_close(O, O_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, **TOL)
