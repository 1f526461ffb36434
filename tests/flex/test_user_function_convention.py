"""``score_mod`` and ``mask_mod`` see what torch's see, at every size and on every CPU path.

torch calls the functions per element through nested vmaps, so inside them ``b, h, q_idx, kv_idx`` (and
``score``) are 0-d tensors, and any index idiom that works there must work here: on the batched path (a
call under 2^19 scores, every head's tile at once) and on the per-slice path (over 2^19: the parallel path's
one ``(b, h)`` at a time), forward and backward, on every CPU backend. Each case is judged against torch:
the forward against torch's eager ``flex_attention`` in float64; the gradients (torch's eager flex has no
CPU backward, and autograd through its eager math path fails in its index backward) against autograd
through a dense float64 twin of the case, the same function written with broadcast indices
``b (B,1,1,1), h (1,H,1,1), q_idx (N,1), kv_idx (1,N)``, whose forward is first checked to be torch's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

import flashattn_teach as fa
from flashattn_teach.errors import AttentionValueError
from flashattn_teach.reference import parallel

flex = pytest.importorskip("torch.nn.attention.flex_attention")

BACKENDS = ("auto", "parallel", "query_major", "key_major", "dense")
B, H, D, G = 2, 4, 8, 2  # G: query heads per rope key head in the latent-attention case
# batched: B H N^2 = 8192 scores; per slice: 591,872 > 2^19, so the parallel path runs one (b, h) at a time
SIZES = {"batched": 32, "per_slice": 272}
TOL = 1e-10  # float64 on both sides: equal up to summation order
inf = float("inf")


@dataclass(frozen=True)
class Case:
    """One idiom: its functions, the captured tensor whose gradient is checked (None: a bool mask), and the
    same function of broadcast index tensors (``score`` of the twin: all ``(B, H, N, N)`` scores)."""

    score_mod: Callable[..., Tensor] | None
    mask_mod: Callable[..., Tensor] | None
    captured: Tensor | None
    twin: Callable[..., Tensor] | None


def _randn(*shape: int, seed: int, grad: bool = True) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_(grad)


def _documents(N: int) -> Tensor:
    """(B, N) document ids, sorted, different per batch element."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 4, (B, N), generator=g).sort(dim=-1).values


def batch_then_row(N: int) -> Case:
    bias = _randn(B, N, seed=1)
    return Case(
        lambda score, b, h, q_idx, kv_idx: score + bias[b][q_idx],
        None,
        bias,
        lambda score, b, h, q_idx, kv_idx: score + bias[b, q_idx],
    )


def row_then_column(N: int) -> Case:  # torch's test rel_pos_2d_index_multiple
    bias = _randn(N, N, seed=2)
    return Case(
        lambda score, b, h, q_idx, kv_idx: score + bias[q_idx][kv_idx],
        None,
        bias,
        lambda score, b, h, q_idx, kv_idx: score + bias,
    )


def one_tuple_index(N: int) -> Case:
    bias = _randn(B, H, N, N, seed=3)
    return Case(
        lambda score, b, h, q_idx, kv_idx: score + bias[b, h, q_idx, kv_idx],
        None,
        bias,
        lambda score, b, h, q_idx, kv_idx: score + bias,
    )


def head_then_row(N: int) -> Case:  # multiplies the score: d score_mod / dS is not 1
    bias = _randn(H, N, seed=4)
    return Case(
        lambda score, b, h, q_idx, kv_idx: score * bias[h][q_idx],
        None,
        bias,
        lambda score, b, h, q_idx, kv_idx: score * bias[:, :, None],
    )


def same_document(N: int) -> Case:
    doc = _documents(N)
    return Case(
        None,
        lambda b, h, q_idx, kv_idx: doc[b][q_idx] == doc[b][kv_idx],
        None,
        lambda score, b, h, q_idx, kv_idx: score.masked_fill(doc[:, None, :, None] != doc[:, None, None, :], -inf),
    )


def ignores_b_and_h(N: int) -> Case:
    slope = _randn(seed=5)
    return Case(
        lambda score, b, h, q_idx, kv_idx: score + slope * (kv_idx - q_idx) / N,
        lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
        slope,
        lambda score, b, h, q_idx, kv_idx: (score + slope * (kv_idx - q_idx) / N).masked_fill(q_idx < kv_idx, -inf),
    )


def latent_attention(N: int) -> Case:  # attention-gym's decoupled rope of multi-head latent attention
    query_rope = _randn(B, H, N, 4, seed=6)
    key_rope = _randn(B, H // G, N, 4, seed=8, grad=False)

    def rope_score(score, b, h, q_idx, kv_idx):
        return score + torch.dot(query_rope[b, h, q_idx], key_rope[b, h // G, kv_idx])

    def rope_twin(score, b, h, q_idx, kv_idx):  # (B, H, N, 4) @ (B, H, 4, N)
        return score + query_rope @ key_rope.repeat_interleave(G, dim=1).transpose(-2, -1)

    return Case(rope_score, None, query_rope, rope_twin)


IDIOMS = [batch_then_row, row_then_column, one_tuple_index, head_then_row, same_document, ignores_b_and_h]
IDIOMS.append(latent_attention)


def _qkv(N: int) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = (_randn(B, H, N, D, seed=10 + n) for n in range(3))
    return q, k, v


def _torch_forward(q: Tensor, k: Tensor, v: Tensor, case: Case) -> Tensor:
    N = q.shape[-2]
    block_mask = None if case.mask_mod is None else flex.create_block_mask(case.mask_mod, B, H, N, N, device="cpu")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # "called without torch.compile()"
        q, k, v = (t.detach() for t in (q, k, v))  # torch has no CPU backward, and refuses inputs that want one
        return flex.flex_attention(q, k, v, score_mod=case.score_mod, block_mask=block_mask)


def _twin_attention(q: Tensor, k: Tensor, v: Tensor, case: Case) -> Tensor:
    """softmax(twin(S)) @ v over all (B, H, N, N) scores at once, by broadcast indices, in float64."""
    N = q.shape[-2]
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    q_idx, kv_idx = torch.arange(N).view(N, 1), torch.arange(N).view(1, N)
    assert case.twin is not None
    S = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5  # (B, H, N, D) @ (B, H, D, N) -> (B, H, N, N)
    return torch.softmax(case.twin(S, b, h, q_idx, kv_idx), dim=-1) @ v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("idiom", IDIOMS, ids=lambda f: f.__name__)
def test_an_idiom_that_works_under_torch_works_at_every_size_and_backend(idiom, size, backend):
    N = SIZES[size]
    case = idiom(N)
    q, k, v = _qkv(N)
    O = fa.flash_attention(q, k, v, score_mod=case.score_mod, mask_mod=case.mask_mod, backend=backend)
    torch.testing.assert_close(O, _torch_forward(q, k, v, case), atol=TOL, rtol=0)

    wrt = (q, k, v) if case.captured is None else (q, k, v, case.captured)
    dO = _randn(*O.shape, seed=99, grad=False)
    grads = torch.autograd.grad(O, wrt, dO)
    O_ref = _twin_attention(q, k, v, case)
    torch.testing.assert_close(O_ref, _torch_forward(q, k, v, case), atol=TOL, rtol=0)  # the twin is torch's
    for name, got, want in zip("q k v captured".split(), grads, torch.autograd.grad(O_ref, wrt, dO), strict=False):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0, msg=lambda m, name=name: f"d{name}: {m}")


def test_the_sizes_take_the_batched_and_the_per_slice_paths():
    """The control for the sizes above: the plan says which path runs."""
    for size, batched in (("batched", True), ("per_slice", False)):
        N = SIZES[size]
        assert (B * H * N * N < parallel.MIN_PARALLEL_SCORES) == batched
        q, k, v = _qkv(N)
        plan = fa.explain(q, k, v, score_mod=row_then_column(N).score_mod, backend="parallel")
        assert ("every (batch, head) slice at once" in str(plan)) == batched


@pytest.mark.parametrize(
    "mask_mod",
    [
        lambda b, h, q_idx, kv_idx: DOCUMENTS[b][q_idx] == DOCUMENTS[b][kv_idx],
        lambda b, h, q_idx, kv_idx: PAIRS[q_idx][kv_idx] > 0,
        lambda b, h, q_idx, kv_idx: (PAIRS[q_idx, kv_idx] > -0.5) & (q_idx >= kv_idx),
    ],
    ids=["document", "row_then_column", "tuple_and_causal"],
)
def test_create_block_mask_classifies_with_the_same_convention_as_torch(mask_mod):
    N = 300
    ours = fa.create_block_mask(mask_mod, B, H, N, N, device="cpu", BLOCK_SIZE=64)
    theirs = flex.create_block_mask(mask_mod, B, H, N, N, device="cpu", BLOCK_SIZE=64)
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        torch.testing.assert_close(getattr(ours, name).expand_as(getattr(theirs, name)), getattr(theirs, name))


DOCUMENTS = _documents(300)
PAIRS = _randn(300, 300, seed=11, grad=False)


def branchy_mask(b, h, q_idx, kv_idx):
    if q_idx >= kv_idx:  # Python control flow on a tensor: torch's vmap cannot batch it
        return torch.tensor(True)
    return torch.tensor(False)


def branchy_score(score, b, h, q_idx, kv_idx):
    return score * 2 if int(h) == 0 else score


@pytest.mark.parametrize("size", SIZES)
def test_python_control_flow_on_an_index_is_refused_by_name_with_the_way_to_write_it(size):
    N = SIZES[size]
    q, k, v = (t.detach() for t in _qkv(N))
    with pytest.raises(RuntimeError, match="vmap"):  # the control: torch refuses both too
        _torch_forward(q, k, v, Case(None, branchy_mask, None, twin=None))
    with pytest.raises(RuntimeError, match="data-dependent"):  # torch traces score_mod with dynamo: its words
        _torch_forward(q, k, v, Case(branchy_score, None, None, twin=None))
    for kwargs, name in (({"mask_mod": branchy_mask}, "branchy_mask"), ({"score_mod": branchy_score}, "branchy_score")):
        for backend in ("parallel", "dense"):
            with pytest.raises(AttentionValueError, match=rf"{name} \(.*per element.*torch\.where"):
                fa.flash_attention(q, k, v, backend=backend, **kwargs)
    with pytest.raises(AttentionValueError, match=r"branchy_mask \(.*torch\.where"):
        fa.create_block_mask(branchy_mask, B, H, N, N, device="cpu")


def test_a_function_returning_more_than_one_value_per_element_is_refused():
    q, k, v = (t.detach() for t in _qkv(32))
    bias = torch.randn(H, 32)
    with pytest.raises(AttentionValueError, match=r"shape \(32,\) for one element.*bias\[h, q_idx, kv_idx\]"):
        fa.flash_attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score + bias[h])


def test_a_mask_that_ignores_b_and_h_is_still_one_tile_for_every_head():
    """Per-element calls keep broadcasting's economy: the result is size 1 along b and h it does not read."""
    from flashattn_teach.flex import per_element

    vec = [torch.arange(n) for n in (B, H, 5, 6)]
    assert per_element.visible(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, *vec).shape == (1, 1, 5, 6)
    assert per_element.visible(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx + h, *vec).shape == (1, H, 5, 6)
    doc = _documents(6)
    assert per_element.visible(lambda b, h, q_idx, kv_idx: doc[b][q_idx] == doc[b][kv_idx], *vec).shape == (
        B,
        1,
        5,
        6,
    )


@pytest.mark.parametrize("size", SIZES)
def test_h_is_the_query_head_under_grouped_query_attention_as_in_torch(size):
    N = SIZES[size]
    q = _randn(B, H, N, D, seed=20, grad=False)
    k, v = (_randn(B, H // G, N, D, seed=21 + n, grad=False) for n in range(2))
    bias = _randn(H, N, seed=23, grad=False)

    def head_row_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h][q_idx]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = flex.flex_attention(q, k, v, score_mod=head_row_bias, enable_gqa=True)
    for backend in BACKENDS:
        got = fa.flash_attention(q, k, v, score_mod=head_row_bias, enable_gqa=True, backend=backend)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("N_q", "N_k"), [(0, 5), (5, 0)])
def test_a_call_without_scores_calls_no_function_and_differentiates(backend, N_q, N_k):
    """vmap cannot map a dim of size 0: an empty tile calls nothing, as there is no element to call it on."""
    q = _randn(1, 2, N_q, D, seed=30)
    k, v = (_randn(1, 2, N_k, D, seed=31 + n) for n in range(2))
    O = fa.flash_attention(
        q,
        k,
        v,
        score_mod=lambda score, b, h, q_idx, kv_idx: score * 2,
        mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
        backend=backend,
    )
    assert O.shape == (1, 2, N_q, D) and not O.any()  # no key: zeros, as flash_attention gives without functions
    O.sum().backward()
    assert q.grad is not None and not q.grad.any()


@pytest.mark.parametrize("idiom", IDIOMS, ids=lambda f: f.__name__)
def test_the_index_mode_for_a_torch_without_batched_tensor_indexing_gives_the_same_values_and_gradients(
    idiom, monkeypatch
):
    """The installed torch indexes by batched 0-d tensors itself; a torch that does not gets
    IndexByTensors (aten.index, as torch's eager flex_attention does). Both forms, one call each."""
    from flashattn_teach.flex import per_element

    assert per_element.native_indexing()  # the control: this torch takes the native path in the tests above
    N = SIZES["batched"]
    case = idiom(N)
    q, k, v = _qkv(N)
    wrt = (q, k, v) if case.captured is None else (q, k, v, case.captured)
    kw = {"score_mod": case.score_mod, "mask_mod": case.mask_mod, "backend": "query_major"}
    O = fa.flash_attention(q, k, v, **kw)
    grads = torch.autograd.grad(O.sum(), wrt)
    monkeypatch.setattr(per_element, "native_indexing", lambda: False)
    O_mode = fa.flash_attention(q, k, v, **kw)
    torch.testing.assert_close(O_mode, O, atol=0, rtol=0)
    for got, want in zip(torch.autograd.grad(O_mode.sum(), wrt), grads, strict=True):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
