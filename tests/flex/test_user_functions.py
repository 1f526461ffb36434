"""score_mod and mask_mod as arguments: what a function captures, the checks of what it returns, the
documented order of the score's parts, and the paths a call with user functions takes (torch.compile,
forward-mode AD, FlexAttention's extra arguments)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch.autograd import forward_ad

import flashattn_teach as fa
from flashattn_teach.errors import AttentionTypeError, AttentionValueError, BackendUnavailableError
from flashattn_teach.flex.captures import captured_tensors

CPU_BACKENDS = ("dense", "query_major", "key_major", "parallel")
GLOBAL_BIAS = torch.randn(4)


def _inputs(B=2, H=4, N_q=37, N_k=45, D=8, dtype=torch.float64, grad=True):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=dtype) for n in (N_q, N_k, N_k))
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


# ------------------------------------------------------------------------------------------------ captures


def test_captured_tensors_finds_closures_globals_defaults_partials_and_modules():
    closed = torch.randn(3)
    default = torch.randn(2)
    module = torch.nn.Linear(2, 2)

    def from_closure(s, b, h, q, kv):
        return s + closed[h]

    def from_global(s, b, h, q, kv):
        return s + GLOBAL_BIAS[h]

    def from_default(s, b, h, q, kv, bias=default):
        return s + bias[h]

    def with_keyword(s, b, h, q, kv, *, bias):
        return s + bias[h]

    assert captured_tensors(from_closure) == (closed,)
    assert captured_tensors(from_global) == (GLOBAL_BIAS,)
    assert captured_tensors(from_default) == (default,)
    assert captured_tensors(functools.partial(with_keyword, bias=closed)) == (closed,)
    assert set(map(id, captured_tensors(module.forward))) == {id(module.weight), id(module.bias)}


def test_captured_tensors_follows_combinators_and_counts_each_tensor_once():
    doc = torch.tensor([0, 0, 1, 1])

    def same_doc(b, h, q, kv):
        return doc[q] == doc[kv]

    def causal(b, h, q, kv):
        return q >= kv

    def both(*mods):
        def combined(b, h, q, kv):
            return functools.reduce(lambda x, y: x & y, (m(b, h, q, kv) for m in mods))

        return combined

    assert captured_tensors(both(same_doc, causal, same_doc)) == (doc,)
    assert captured_tensors(causal) == ()  # the control: a function of its arguments captures nothing


# ---------------------------------------------------------------------------------------------- the checks


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"score_mod": 3}, AttentionTypeError, "score_mod must be a function"),
        ({"mask_mod": "causal"}, AttentionTypeError, "mask_mod must be a function"),
        ({"score_mod": lambda s, b, h, q, kv: q >= kv}, AttentionTypeError, "floating-point"),
        ({"mask_mod": lambda b, h, q, kv: (q - kv).float()}, AttentionTypeError, "bool tensor"),
        ({"score_mod": lambda s, b, h, q, kv: s.repeat(2)}, AttentionValueError, "for one element"),
        ({"block_mask": torch.ones(3, 3, dtype=torch.bool)}, AttentionTypeError, "create_block_mask"),
    ],
)
def test_bad_user_functions_are_refused_by_name(kwargs, error, words):
    q, k, v = _inputs(grad=False)
    with pytest.raises(error, match=words):
        fa.flash_attention(q, k, v, backend="query_major", **kwargs)


def test_flex_attention_refuses_what_it_cannot_honour():
    q, k, v = _inputs(grad=False)
    with pytest.raises(BackendUnavailableError, match="PRESCALE_QK"):  # tuning options are accepted
        fa.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + 1, kernel_options={"PRESCALE_QK": True})
    from torch.nn.attention.flex_attention import AuxRequest

    with pytest.raises(BackendUnavailableError, match="max_scores"):
        fa.flex_attention(q, k, v, return_aux=AuxRequest(max_scores=True))
    with pytest.raises(AttentionValueError, match="query has 4 heads"):
        fa.flex_attention(q, k[:, :2], v[:, :2])  # FlexAttention's default: no GQA unless asked
    out, aux = fa.flex_attention(q, k, v, return_aux=AuxRequest(lse=True))
    out2, lse = fa.flex_attention(q, k, v, return_lse=True)
    torch.testing.assert_close(aux.lse, lse)
    torch.testing.assert_close(out, out2)


# ------------------------------------------------------------------------------------------- the order


def _by_hand(q, k, v, *, scale, softcap, slopes, score_mod, mask_mod):
    """The documented order, written out on the whole grid: scale, softcap, ALiBi, score_mod, masks."""
    B, H, N_q, _ = q.shape
    N_k = k.shape[2]
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    i = torch.arange(N_q).view(N_q, 1)
    j = torch.arange(N_k).view(1, N_k)
    S = scale * q @ k.transpose(-1, -2)
    S = softcap * torch.tanh(S / softcap)
    S = S - slopes.view(1, H, 1, 1) * (i - j).abs()
    S = score_mod(S, b, h, i, j)
    S = S.masked_fill(~mask_mod(b, h, i, j).expand_as(S), -math.inf)
    return torch.softmax(S, dim=-1).nan_to_num(0.0) @ v


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_score_mod_comes_after_the_softcap_and_the_builtin_bias_and_before_the_masks(backend):
    q, k, v = _inputs()
    slopes = torch.rand(4, dtype=torch.float64)
    temperature = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)

    def score_mod(s, b, h, q_idx, kv_idx):  # not linear: its place in the order shows
        return torch.where(s > 0, s * temperature, s) + 0.01 * b

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + b) | (kv_idx < 3)

    got = fa.flash_attention(
        q, k, v, softcap=2.0, alibi_slopes=slopes, score_mod=score_mod, mask_mod=mask_mod, backend=backend
    )
    want = _by_hand(q, k, v, scale=8**-0.5, softcap=2.0, slopes=slopes, score_mod=score_mod, mask_mod=mask_mod)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v, temperature))
    wants = torch.autograd.grad(want.square().sum(), (q, k, v, temperature))
    for g, w in zip(grads, wants, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_score_mod_that_hides_whole_rows_gives_zero_and_minus_inf_and_finite_gradients(backend):
    q, k, v = _inputs()

    def score_mod(s, b, h, q_idx, kv_idx):
        return torch.where(q_idx % 5 == 0, -math.inf, s)

    O, lse = fa.flash_attention(q, k, v, score_mod=score_mod, backend=backend, return_lse=True)
    assert torch.all(O[:, :, ::5] == 0) and torch.all(torch.isneginf(lse[:, :, ::5]))
    assert torch.all(torch.isfinite(lse[:, :, 1::5]))
    grads = torch.autograd.grad(O.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


# --------------------------------------------------------------------------------------------- the routes


def test_forward_mode_ad_with_a_score_mod_runs_on_the_dense_path_and_is_refused_by_the_tiled_loops():
    q, k, v = _inputs(grad=False)

    def score_mod(s, b, h, q_idx, kv_idx):
        return s * 1.5

    tangent = torch.randn_like(q)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(q, tangent)
        auto = forward_ad.unpack_dual(fa.flash_attention(dual, k, v, score_mod=score_mod)).tangent
        # score_mod is linear here: the tangent equals the one of attention with the scale times 1.5
        plain = forward_ad.unpack_dual(fa.flash_attention(dual, k, v, scale=1.5 * 8**-0.5, backend="dense")).tangent
        with pytest.raises(BackendUnavailableError, match="dense path"):
            fa.flash_attention(dual, k, v, score_mod=score_mod, backend="query_major")
    torch.testing.assert_close(auto, plain)


def test_a_compiled_call_with_a_score_mod_runs_eagerly_and_gives_the_eager_answer():
    q, k, v = _inputs(grad=False)
    bias = torch.randn(4, dtype=torch.float64)

    def attend(q, k, v):
        return fa.flash_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[h] * (i - j), backend="query_major")

    torch.testing.assert_close(torch.compile(attend, backend="eager")(q, k, v), attend(q, k, v))


def test_explain_says_where_the_user_functions_run():
    q, k, v = _inputs(grad=False)
    bias = torch.zeros(4, dtype=torch.float64, requires_grad=True)

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + bias[h]

    tiled = str(fa.explain(q, k, v, score_mod=score_mod, backend="query_major"))
    assert "each tile's index vectors" in tiled and "captured tensors that require grad" in tiled
    assert "whole N_q x N_k grid" in str(fa.explain(q, k, v, score_mod=score_mod, backend="dense"))
    assert "user functions" not in str(fa.explain(q, k, v, backend="query_major"))  # the control


def test_a_block_mask_built_by_torch_is_taken_as_it_is():
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

    q, k, v = _inputs(N_q=200, N_k=200, grad=False)

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 40

    theirs = torch_block_mask(sliding, None, None, 200, 200, device="cpu", BLOCK_SIZE=64)
    ours = fa.create_block_mask(sliding, None, None, 200, 200, device="cpu", BLOCK_SIZE=64)
    assert theirs.kv_num_blocks.sum() < theirs.kv_num_blocks.numel() * 4  # some blocks are skipped
    torch.testing.assert_close(
        fa.flex_attention(q, k, v, block_mask=theirs), fa.flex_attention(q, k, v, block_mask=ours)
    )


def test_explain_verbose_prints_the_generated_triton_source_or_why_there_is_none():
    q, k, v = _inputs(grad=False)
    cap = torch.ones(4, dtype=torch.float64)

    def capped(s, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(s / 30.0) + cap[h]

    def rowwise(s, b, h, q_idx, kv_idx):
        return torch.softmax(s, dim=-1)

    shown = str(fa.explain(q, k, v, score_mod=capped, verbose=True))
    assert "@triton.jit" in shown and "def score_grad(" in shown and "tl.load(C0 + h" in shown
    refused = str(fa.explain(q, k, v, score_mod=rowwise, verbose=True))
    assert "torch.softmax" in refused and "test_user_functions.py" in refused
    assert "@triton.jit" not in str(fa.explain(q, k, v, score_mod=capped))  # the control: not verbose


# ------------------------------------------------------------- captured tensors: found, refused, reproducible


@pytest.mark.parametrize("backend", ["query_major", "parallel"])
def test_a_tensor_reached_through_an_attribute_gets_its_gradient(backend):
    import types

    q, k, v = _inputs()
    ns = types.SimpleNamespace(bias=torch.randn(4, 45, dtype=torch.float64, requires_grad=True))

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + ns.bias[h, kv_idx]  # the walk cannot see ns.bias; the probe can

    grads = {}
    for run in ("dense", backend):
        O = fa.flash_attention(q, k, v, score_mod=score_mod, backend=run)
        grads[run] = torch.autograd.grad(O.square().sum(), ns.bias)[0]
    torch.testing.assert_close(grads[backend], grads["dense"], rtol=1e-9, atol=1e-11)


def test_parameters_the_function_does_not_read_get_no_gradient():
    q, k, v = _inputs()
    model = torch.nn.Module()
    model.rel = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    model.head = torch.nn.Linear(8, 4, dtype=torch.float64)

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + model.rel[h] * (q_idx - kv_idx)

    fa.flash_attention(q, k, v, score_mod=score_mod, backend="query_major").square().sum().backward()
    assert model.rel.grad is not None and model.rel.grad.abs().sum() > 0
    assert model.head.weight.grad is None and model.head.bias.grad is None  # as autograd leaves them


def test_a_closure_rebound_before_the_backward_is_refused_rather_than_differentiated_wrongly():
    q, k, v = _inputs()
    biases = [torch.randn(4, 45, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    x = q
    for bias in biases:  # the lambdas read the loop variable: both see the last bias by backward time
        x = fa.flash_attention(x, k, v, score_mod=lambda s, b, h, i, j: s + bias[h, j], backend="query_major")  # noqa: B023
    with pytest.raises(AttentionValueError, match="rebound"):
        x.sum().backward()
    # the control: one function per call, its bias bound by functools.partial, differentiates
    y = q
    for bias in biases:
        bound = functools.partial(lambda s, b, h, i, j, bias: s + bias[h, j], bias=bias)
        y = fa.flash_attention(y, k, v, score_mod=bound, backend="query_major")
    y.sum().backward()
    assert all(t.grad is not None for t in biases)


def test_captured_gradients_on_the_worker_threads_are_bitwise_reproducible():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 384, 16, generator=g) for _ in range(3))
    rel = torch.randn(2 * 384, requires_grad=True)

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + rel[q_idx - kv_idx + 384]

    runs = []
    for _ in range(3):
        O = fa.flash_attention(q, k, v, score_mod=score_mod, backend="parallel")
        runs.append(torch.autograd.grad(O.square().sum(), rel)[0])
    assert "too few for the worker threads" not in str(fa.explain(q, k, v, score_mod=score_mod, backend="parallel"))
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def test_a_function_of_the_other_kind_is_refused_by_its_arity():
    q, k, v = _inputs(grad=False)
    with pytest.raises(AttentionTypeError, match=r"score_mod takes 4 positional arguments.*pass it as mask_mod="):
        fa.flex_attention(q, k, v, score_mod=lambda b, h, i, j: i >= j)
    with pytest.raises(AttentionTypeError, match=r"mask_mod takes 5 positional arguments.*pass it as score_mod="):
        fa.flash_attention(q, k, v, mask_mod=lambda s, b, h, i, j: s)


def test_a_score_mod_working_in_place_differentiates_as_its_out_of_place_twin():
    q, k, v = _inputs()
    grads = []
    for mod in (lambda s, b, h, i, j: s.mul_(2.0), lambda s, b, h, i, j: s * 2.0):
        O = fa.flash_attention(q, k, v, score_mod=mod, backend="query_major")
        grads.append(torch.autograd.grad(O.square().sum(), (q, k, v)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_a_block_masks_index_lists_are_read_only():
    bm = fa.create_block_mask(lambda b, h, i, j: i >= j, None, None, 256, 256, device="cpu")
    with pytest.raises(AttributeError, match="from_kv_blocks"):
        bm.kv_num_blocks = torch.zeros_like(bm.kv_num_blocks)
