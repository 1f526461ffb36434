"""FlexAttention's functions on every CPU path against the float64 dense oracle: values and gradients.

Each call runs a case of ``flex_cases.py`` (torch's FlexAttention test functions, the common masks, learned
score_mods) through ``flash_attention(..., score_mod=, mask_mod=, block_mask=, backend=)`` on every CPU
backend, through the public tiled references at ragged tiles, and through ``flex_attention`` itself, and
compares ``O``, ``lse`` and the gradients of ``q``, ``k``, ``v`` and of the captured tensors that require grad
with ``flex_cases.oracle`` (the whole score matrix in float64, torch.autograd for the gradients; it shares
no code with the library). Lengths are ragged (113, 203, ``N_q != N_k`` both ways), heads grouped (GQA), the
batch dependent (a document mask with different documents per batch element).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.attention.flex_attention
from hypothesis import given, settings
from hypothesis import strategies as st

import flashattn_teach as fa
from flashattn_teach._options import make_options
from flashattn_teach.reference import parallel
from flashattn_teach.reference.online import tiled_attention

from flex_cases import (
    HIDDEN_ROWS,
    MASKS,
    SCORE_MODS,
    TORCH_SUITE,
    Dims,
    Mods,
    Params,
    assert_lse_equal,
    block_visibility,
    both,
    causal_mask,
    document_ids,
    either,
    hides_first_rows,
    loss,
    oracle,
    prefix_lm_mask,
    relative_causal,
    sliding_window_mask,
    squared,
    times_two,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None

# fp64: the tiled paths add the same terms in another order; fp32: the project's tolerances (tests/masks).
TOL = {torch.float64: dict(value=1e-10, grad=1e-10), torch.float32: dict(value=2e-5, grad=2e-4)}
# The interpreter rounds P and dS to the input dtype before its dots, as the kernels do (tests/triton).
TRITON_TOL = dict(value=2e-4, grad=2e-3)
# Captured tensors' gradients are sums over up to B * H * N_q * N_k scores: checked relative to their size too.
CAPTURE_RTOL = {torch.float64: 1e-12, torch.float32: 5e-5}


@contextlib.contextmanager
def parallel_even_when_small() -> Iterator[None]:
    """The threaded path spreads even a small problem over its workers (it runs inline below a threshold)."""
    smallest, parallel.MIN_PARALLEL_SCORES = parallel.MIN_PARALLEL_SCORES, 0
    try:
        yield
    finally:
        parallel.MIN_PARALLEL_SCORES = smallest


Path = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def via_backend(backend: str) -> Path:
    def run(q, k, v, **kw):
        guard = parallel_even_when_small() if backend == "parallel" else contextlib.nullcontext()
        with guard:
            return fa.flash_attention(q, k, v, backend=backend, return_lse=True, **kw)

    return run


# The public tiled references take tiles; the parallel path has no public entry with tiles, so it runs through
# the internal one its backend calls (the options check, then the tiled loop).
TILED_PUBLIC = {"query_major": fa.online_attention, "key_major": fa.key_major_attention}


def via_reference(order: str, block_m: int, block_n: int) -> Path:
    """A tiled reference at chosen tiles: ragged last tiles on both axes."""

    def run(q, k, v, **kw):
        tiles = dict(block_m=block_m, block_n=block_n)
        if order in TILED_PUBLIC:
            return TILED_PUBLIC[order](q, k, v, enable_gqa=True, return_lse=True, **tiles, **kw)
        opts = make_options(q, k, v, enable_gqa=True, **kw)
        with parallel_even_when_small():
            return tiled_attention(q, k, v, opts, order=order, **tiles)

    return run


CPU_BACKENDS = [pytest.param(via_backend(name), id=name) for name in ("parallel", "query_major", "key_major", "dense")]
PATHS = [
    *CPU_BACKENDS,
    pytest.param(via_reference("query_major", 64, 96), id="online_attention_64x96"),
    pytest.param(via_reference("key_major", 96, 64), id="key_major_attention_96x64"),
    pytest.param(via_reference("parallel", 48, 80), id="parallel_48x80"),
]

B, H_Q, H_KV, D, D_V = 2, 4, 2, 16, 8


def inputs(N_q: int, N_k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``q (B, H_q, N_q, D)``, ``k (B, H_kv, N_k, D)``, ``v (B, H_kv, N_k, D_v)`` that require grad."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_Q, N_q, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H_KV, N_k, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H_KV, N_k, D_V, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype).requires_grad_() for t in (q, k, v))


def check(
    run: Path,
    builder: Callable[[Dims, Params], Mods],
    N_q: int,
    N_k: int,
    dtype: torch.dtype,
    tol: dict[str, float] | None = None,
    **kw,
) -> None:
    """Values and every gradient of ``run`` against the oracle on the same (rounded) inputs and captures."""
    dims = Dims(B, H_Q, N_q, N_k)
    q, k, v = inputs(N_q, N_k, dtype)
    mods = builder(dims, Params(dtype))
    ref_mods = builder(dims, Params(torch.float64, rounded_to=dtype))
    O, lse = run(q, k, v, score_mod=mods.score_mod, mask_mod=mods.mask_mod, **kw)
    wide = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in kw.items()}
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    O_ref, lse_ref = oracle(q64, k64, v64, score_mod=ref_mods.score_mod, mask_mod=ref_mods.mask_mod, **wide)
    assert O.dtype == dtype and O.shape == O_ref.shape
    tol = tol or TOL[dtype]
    torch.testing.assert_close(O.double(), O_ref, atol=tol["value"], rtol=0)
    assert_lse_equal(lse, lse_ref, tol["value"])

    learned = list(mods.learned.values())
    grads = torch.autograd.grad(loss(O, lse), [q, k, v, *learned])
    refs = torch.autograd.grad(loss(O_ref, lse_ref), [q64, k64, v64, *ref_mods.learned.values()])
    for name, got, ref in zip("qkv", grads[:3], refs[:3], strict=True):
        torch.testing.assert_close(got.double(), ref, atol=tol["grad"], rtol=0, msg=f"d{name}")
    for name, got, ref in zip(mods.learned, grads[3:], refs[3:], strict=True):
        assert got is not None, f"no gradient for the captured tensor {name!r}"
        torch.testing.assert_close(
            got.double(), ref, atol=tol["grad"], rtol=CAPTURE_RTOL[dtype], msg=f"d{name} (captured)"
        )


# ----------------------------------------------------------------------------------- every CPU path


@pytest.mark.parametrize("run", PATHS)
@pytest.mark.parametrize("name", list(TORCH_SUITE))
def test_torch_suite_score_mods_match_the_oracle_on_every_cpu_path(run, name):
    """torch's own FlexAttention test functions, float64, N_q = 113, N_k = 203, GQA 4/2."""
    check(run, TORCH_SUITE[name], 113, 203, torch.float64)


@pytest.mark.parametrize("run", PATHS)
@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize(("N_q", "N_k"), [(113, 203), (203, 113)])
def test_common_masks_match_the_oracle_on_every_cpu_path(run, name, N_q, N_k):
    """The common mask_mods, given as ``mask_mod=`` (the library builds the block mask); with N_q > N_k the
    document mask leaves rows that see no key (O = 0, lse = -inf)."""
    check(run, MASKS[name], N_q, N_k, torch.float64)


@pytest.mark.parametrize("run", PATHS)
@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_learned_score_mods_match_the_oracle_with_their_gradients(run, name):
    """tanh softcap, rows hidden by the score_mod alone, and the captured tensors that require grad: a
    per-head bias, learned slopes, a relative-position table read by whole diagonals, a scalar temperature, a
    batch-dependent key bias, a tensor reached through functools.partial and a module's parameter."""
    check(run, SCORE_MODS[name], 113, 203, torch.float64)


@pytest.mark.parametrize("run", PATHS)
@pytest.mark.parametrize("name", ["relative_causal", "alibi_bias", "head_offset", "trigonometric"])
def test_float32_matches_the_float64_oracle(run, name):
    check(run, TORCH_SUITE[name], 113, 203, torch.float32)


@pytest.mark.parametrize("run", PATHS)
@pytest.mark.parametrize("name", ["relative_table", "temperature", "key_bias"])
def test_float32_captured_gradients_match_the_float64_oracle(run, name):
    check(run, SCORE_MODS[name], 113, 203, torch.float32)


def _with_mask(score_builder, mask_builder):
    def build(d: Dims, p: Params) -> Mods:
        s, m = score_builder(d, p), mask_builder(d, p)
        return Mods(score_mod=s.score_mod, mask_mod=m.mask_mod, learned=s.learned)

    return build


@pytest.mark.parametrize("run", PATHS)
def test_score_mod_and_mask_mod_together_match_the_oracle(run):
    """A learned relative table under a batch-dependent causal document mask."""
    check(run, _with_mask(SCORE_MODS["relative_table"], MASKS["causal_document"]), 203, 113, torch.float64)


# ------------------------------------------------------------------- the order with built-in variants


def _times_two(d, p):
    return Mods(score_mod=times_two)


def _squared(d, p):
    return Mods(score_mod=squared)


@pytest.mark.parametrize("run", PATHS)
@pytest.mark.parametrize("builder", [_times_two, _squared], ids=["times_two", "squared"])
def test_score_mod_runs_after_softcap_and_alibi_and_before_causal(run, builder):
    """scale, softcap, ALiBi, then score_mod, then the masks. The score_mods do not commute with the
    softcap or the bias, so another order gives other numbers (the control below shows by how much)."""
    slopes = torch.rand(H_Q, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    check(run, builder, 113, 203, torch.float64, softcap=1.5, alibi_slopes=slopes, causal=True)


@pytest.mark.parametrize("run", PATHS)
def test_score_mod_runs_after_an_additive_attn_mask(run):
    """An additive ``attn_mask`` is a built-in bias: it is added before ``score_mod`` (squared here)."""
    bias = torch.randn(113, 203, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    check(run, _squared, 113, 203, torch.float64, attn_mask=bias)


@pytest.mark.parametrize("run", PATHS)
def test_mask_mod_composes_with_seqlens_k_and_a_bool_attn_mask(run):
    """Every mask applies: right-padded keys (``seqlens_k``, one batch element sees none), a bool
    ``attn_mask`` and the causal document mask_mod, with a learned score_mod."""
    seen = torch.rand(1, H_Q, 1, 113, generator=torch.Generator().manual_seed(5)) < 0.8  # (1, H_q, 1, N_k)
    build = _with_mask(SCORE_MODS["key_bias"], MASKS["causal_document"])
    check(run, build, 203, 113, torch.float64, seqlens_k=torch.tensor([0, 97]), attn_mask=seen)


def test_the_order_control_another_order_gives_other_numbers():
    """Negative control of the order test: softcap after score_mod changes O far beyond the tolerance."""
    q, k, v = (t.detach() for t in inputs(113, 203, torch.float64))
    documented, _ = oracle(q, k, v, score_mod=squared, softcap=1.5)
    swapped, _ = oracle(q, k, v, score_mod=lambda s, b, h, i, j: 1.5 * torch.tanh(squared(s, b, h, i, j) / 1.5))
    assert (documented - swapped).abs().max() > 1e-3


# --------------------------------------------------------------------------------------- block masks


def _document_for_batch(d: Dims, p: Params):
    doc = document_ids(d, p)
    assert not torch.equal(doc[0], doc[1]), "the batch elements must differ for the mask to depend on b"
    return lambda b, h, q_idx, kv_idx: doc[b, q_idx] == doc[b, kv_idx]


@pytest.mark.parametrize("run", [*PATHS, pytest.param("flex_attention", id="flex_attention")])
@pytest.mark.parametrize("block_size", [128, (32, 64)], ids=["128", "32x64"])
@pytest.mark.parametrize(("N_q", "N_k"), [(113, 203), (203, 113)])
def test_block_masks_at_any_block_size_match_the_oracle(run, block_size, N_q, N_k):
    """``create_block_mask`` (B = 2, H = None broadcast over heads) of a batch-dependent document mask, at
    torch's default block and at 32 x 64, given as ``block_mask=``, with a score_mod."""
    dims = Dims(B, H_Q, N_q, N_k)
    q, k, v = inputs(N_q, N_k, torch.float64)
    mask_mod = _document_for_batch(dims, Params(torch.float64))
    block_mask = fa.create_block_mask(mask_mod, B, None, N_q, N_k, device="cpu", BLOCK_SIZE=block_size)
    if run == "flex_attention":
        O, lse = fa.flex_attention(q, k, v, score_mod=relative_causal, block_mask=block_mask, enable_gqa=True,
                                   return_lse=True)  # fmt: skip
    else:
        O, lse = run(q, k, v, score_mod=relative_causal, block_mask=block_mask)
    O_ref, lse_ref = oracle(q, k, v, score_mod=relative_causal, mask_mod=mask_mod)
    torch.testing.assert_close(O, O_ref, atol=1e-10, rtol=0)
    assert_lse_equal(lse, lse_ref, 1e-10)
    grads = torch.autograd.grad(loss(O, lse), (q, k, v))
    refs = torch.autograd.grad(loss(O_ref, lse_ref), (q, k, v))
    for name, got, ref in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0, msg=f"d{name}")


@pytest.mark.parametrize("run", PATHS)
def test_and_masks_and_or_masks_match_their_definitions(run):
    """``and_masks(causal, document)`` and ``or_masks(prefix_lm, sliding_window)`` against the oracle's own
    ``&`` and ``|`` of the same functions."""
    dims = Dims(B, H_Q, 113, 203)
    document = MASKS["document"](dims, Params(torch.float64)).mask_mod
    q, k, v = (t.detach() for t in inputs(113, 203, torch.float64))
    for ours, definition in [
        (fa.and_masks(causal_mask, document), both(causal_mask, document)),
        (fa.or_masks(prefix_lm_mask, sliding_window_mask), either(prefix_lm_mask, sliding_window_mask)),
    ]:
        O, lse = run(q, k, v, mask_mod=ours)
        O_ref, lse_ref = oracle(q, k, v, mask_mod=definition)
        torch.testing.assert_close(O, O_ref, atol=1e-10, rtol=0)
        assert_lse_equal(lse, lse_ref, 1e-10)


@pytest.mark.parametrize("run", PATHS)
def test_noop_mask_is_no_mask(run):
    q, k, v = (t.detach() for t in inputs(113, 203, torch.float64))
    O, lse = run(q, k, v, mask_mod=fa.noop_mask)
    O_ref, lse_ref = oracle(q, k, v)
    torch.testing.assert_close(O, O_ref, atol=1e-10, rtol=0)
    assert_lse_equal(lse, lse_ref, 1e-10)


def _hand_built_block_mask(N_q: int, N_k: int, block: tuple[int, int]):
    """A block mask built from its tables: every query block lists key block 0 as full (where the causal
    mask_mod says False above the diagonal) and key blocks 1..i as partial, except that blocks 2 and later
    leave key block 1 out. Blocks not listed are skipped, whatever mask_mod says."""
    n_q, n_kv = -(-N_q // block[0]), -(-N_k // block[1])
    # query blocks 2 and later skip key block 1, which causal masking would partly show
    partial = [[j for j in range(1, min(i + 1, n_kv)) if not (i >= 2 and j == 1)] for i in range(n_q)]
    full = [[0] for _ in range(n_q)]

    def tables(rows):
        num = torch.tensor([len(r) for r in rows], dtype=torch.int32).view(1, 1, n_q)
        padded = [r + [0] * (n_kv - len(r)) for r in rows]  # torch's layout: n_kv slots, the first num listed
        return num, torch.tensor(padded, dtype=torch.int32).view(1, 1, n_q, n_kv)

    return tables(partial), tables(full)


@pytest.mark.parametrize("library", ["ours", "torch"])
@pytest.mark.parametrize("run", [*PATHS, pytest.param("flex_attention", id="flex_attention")])
def test_hand_built_block_mask_means_what_its_tables_say(run, library):
    """``BlockMask.from_kv_blocks``: a FULL block is visible without mask_mod (it says False above the
    diagonal there), a SKIP block is invisible (mask_mod says True below the diagonal there), a PARTIAL block
    applies mask_mod, as in torch (compiled; eager torch applies mask_mod everywhere). The block mask is
    ours or torch's ``from_kv_blocks`` of the same tables."""
    N_q, N_k, block = 113, 203, (32, 64)
    (num, idx), (full_num, full_idx) = _hand_built_block_mask(N_q, N_k, block)
    block_mask_class = fa.BlockMask if library == "ours" else torch.nn.attention.flex_attention.BlockMask
    block_mask = block_mask_class.from_kv_blocks(
        num, idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=causal_mask, seq_lengths=(N_q, N_k)
    )
    partial, full = block_visibility(num, idx, full_num, full_idx, block, N_q, N_k)
    q_idx, kv_idx = torch.arange(N_q)[:, None], torch.arange(N_k)[None, :]
    visible = full | (partial & (q_idx >= kv_idx))
    # the tables must disagree with plain causal masking both ways, or the test could not fail
    assert (visible & (q_idx < kv_idx)).any() and (~visible & (q_idx >= kv_idx)).any()
    q, k, v = (t.detach() for t in inputs(N_q, N_k, torch.float64))
    if run == "flex_attention":
        O, lse = fa.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
    else:
        O, lse = run(q, k, v, block_mask=block_mask)
    O_ref, lse_ref = oracle(q, k, v, visible=visible)
    torch.testing.assert_close(O, O_ref, atol=1e-10, rtol=0)
    assert_lse_equal(lse, lse_ref, 1e-10)


# ---------------------------------------------------------------------------------- flex_attention


@pytest.mark.parametrize("name", ["relative_causal", "alibi_bias", "head_offset", "trigonometric_product"])
def test_flex_attention_with_score_mod_matches_the_oracle(name):
    """The public ``flex_attention`` (auto backend), no block mask, GQA through ``enable_gqa=True``."""
    dims = Dims(B, H_Q, 113, 203)
    q, k, v = inputs(113, 203, torch.float64)
    mods = TORCH_SUITE[name](dims, Params(torch.float64))
    O, lse = fa.flex_attention(q, k, v, score_mod=mods.score_mod, enable_gqa=True, return_lse=True)
    O_ref, lse_ref = oracle(q, k, v, score_mod=mods.score_mod)
    torch.testing.assert_close(O, O_ref, atol=1e-10, rtol=0)
    assert_lse_equal(lse, lse_ref, 1e-10)
    grads = torch.autograd.grad(loss(O, lse), (q, k, v))
    refs = torch.autograd.grad(loss(O_ref, lse_ref), (q, k, v))
    for name_, got, ref in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0, msg=f"d{name_}")


def test_flex_attention_learned_bias_gets_its_gradient():
    """A captured table that requires grad, through ``flex_attention``'s backward."""
    dims = Dims(B, H_Q, 113, 203)
    q, k, v = inputs(113, 203, torch.float64)
    mods = SCORE_MODS["relative_table"](dims, Params(torch.float64))
    O, lse = fa.flex_attention(q, k, v, score_mod=mods.score_mod, enable_gqa=True, return_lse=True)
    (got,) = torch.autograd.grad(loss(O, lse), [mods.learned["table"]])
    ref_mods = SCORE_MODS["relative_table"](dims, Params(torch.float64))
    (ref,) = torch.autograd.grad(loss(*oracle(q, k, v, score_mod=ref_mods.score_mod)), [ref_mods.learned["table"]])
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-12)


def test_flex_attention_scale_is_the_softmax_scale():
    q, k, v = (t.detach() for t in inputs(113, 203, torch.float64))
    O = fa.flex_attention(q, k, v, score_mod=relative_causal, scale=0.3, enable_gqa=True)
    O_ref, _ = oracle(q, k, v, score_mod=relative_causal, scale=0.3)
    torch.testing.assert_close(O, O_ref, atol=1e-10, rtol=0)


def test_flex_attention_without_enable_gqa_refuses_fewer_key_heads():
    """torch's default: ``enable_gqa=False`` with H_kv < H_q is an error that names enable_gqa."""
    q, k, v = (t.detach() for t in inputs(16, 16, torch.float64))
    with pytest.raises((ValueError, RuntimeError), match="enable_gqa"):
        fa.flex_attention(q, k, v)


# ------------------------------------------------------------------------------ any tiling (property)

ALL_CASES = {**{f"torch:{n}": b for n, b in TORCH_SUITE.items()}, **{f"mask:{n}": b for n, b in MASKS.items()},
             **{f"mod:{n}": b for n, b in SCORE_MODS.items()}}  # fmt: skip


@settings(max_examples=25)
@given(
    order=st.sampled_from(["query_major", "key_major", "parallel"]),
    name=st.sampled_from(sorted(ALL_CASES)),
    N_q=st.integers(1, 70),
    N_k=st.integers(1, 70),
    block_m=st.one_of(st.integers(1, 9), st.sampled_from([16, 33, 64])),
    block_n=st.one_of(st.integers(1, 9), st.sampled_from([16, 33, 64])),
    mask_block=st.one_of(st.none(), st.tuples(st.integers(1, 40), st.integers(1, 40))),
    seed=st.integers(0, 2**16),
)
def test_tiled_references_match_the_oracle_for_any_tiling(order, name, N_q, N_k, block_m, block_n, mask_block, seed):
    """Any case at any tile sizes and lengths, ragged and tiny tiles included, its mask_mod given as such or
    as a block mask of any block size (which the tiles re-tile): the user's functions see each tile's
    absolute indices, so the result cannot depend on the tiling."""
    dims = Dims(B, H_Q, N_q, N_k)
    mods = ALL_CASES[name](dims, Params(torch.float64, seed=seed))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_Q, N_q, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H_KV, N_k, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H_KV, N_k, D_V, generator=g, dtype=torch.float64)
    masks: dict = {"mask_mod": mods.mask_mod}
    if mods.mask_mod is not None and mask_block is not None:
        block_mask = fa.create_block_mask(mods.mask_mod, B, None, N_q, N_k, device="cpu", BLOCK_SIZE=mask_block)
        masks = {"block_mask": block_mask}
    with torch.no_grad():
        O, lse = via_reference(order, block_m, block_n)(q, k, v, score_mod=mods.score_mod, **masks)
    O_ref, lse_ref = oracle(q, k, v, score_mod=mods.score_mod, mask_mod=mods.mask_mod)
    torch.testing.assert_close(O, O_ref.detach(), atol=1e-10, rtol=0)
    assert_lse_equal(lse, lse_ref.detach(), 1e-10)


@settings(max_examples=25)
@given(
    order=st.sampled_from(["query_major", "key_major", "parallel"]),
    name=st.sampled_from(sorted(MASKS)),
    N_q=st.integers(1, 90),
    N_k=st.integers(1, 90),
    block_m=st.one_of(st.integers(1, 9), st.sampled_from([16, 33, 64])),
    block_n=st.one_of(st.integers(1, 9), st.sampled_from([16, 33, 64])),
    mask_block=st.one_of(st.integers(1, 40), st.tuples(st.integers(1, 40), st.integers(1, 40))),
    heads=st.sampled_from([None, H_Q]),
    seed=st.integers(0, 2**16),
)
def test_block_masks_of_any_block_size_match_the_oracle_at_any_tiling(
    order, name, N_q, N_k, block_m, block_n, mask_block, heads, seed
):
    """A mask's block mask at any BLOCK_SIZE (H broadcast or not), read by tiles of any other size: the
    tiles' kinds are the blocks' conservatively (a tile is skipped only if every block under it is), so the
    result is the mask_mod's, whatever the two tilings."""
    mask_mod = MASKS[name](Dims(B, H_Q, N_q, N_k), Params(torch.float64, seed=seed)).mask_mod
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_Q, N_q, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H_KV, N_k, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H_KV, N_k, D_V, generator=g, dtype=torch.float64)
    block_mask = fa.create_block_mask(mask_mod, B, heads, N_q, N_k, device="cpu", BLOCK_SIZE=mask_block)
    O, lse = via_reference(order, block_m, block_n)(q, k, v, score_mod=relative_causal, block_mask=block_mask)
    O_ref, lse_ref = oracle(q, k, v, score_mod=relative_causal, mask_mod=mask_mod)
    torch.testing.assert_close(O, O_ref, atol=1e-10, rtol=0)
    assert_lse_equal(lse, lse_ref, 1e-10)


# ------------------------------------------------------------------------ Triton in the interpreter


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run on CPU tensors (tests/triton: CUDA)")
@pytest.mark.parametrize("name", [*(n for n in ALL_CASES if not n.startswith("mod:")), "mod:tanh_softcap",
                                  "mod:hides_first_rows"])  # fmt: skip
def test_triton_matches_the_float64_oracle(name):
    """``backend="triton"`` (the interpreter on CPU tensors without CUDA) on fp32 inputs, small and ragged:
    values and the gradients of q, k, v, with captured tensors that do not require grad (a learned one sends
    the call to a CPU path)."""
    check(via_backend("triton"), ALL_CASES[name], 45, 67, torch.float32, tol=TRITON_TOL)


def _frozen(builder: Callable[[Dims, Params], Mods]) -> Callable[[Dims, Params], Mods]:
    """A learned case with its tensors frozen (``requires_grad_(False)``): the same lookups, no capture grads."""

    def build(d: Dims, p: Params) -> Mods:
        mods = builder(d, p)
        for t in mods.learned.values():
            t.requires_grad_(False)
        return Mods(score_mod=mods.score_mod, mask_mod=mods.mask_mod)

    return build


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run on CPU tensors (tests/triton: CUDA)")
@pytest.mark.parametrize("name", [n for n in SCORE_MODS if n not in ("tanh_softcap", "hides_first_rows")])
def test_triton_reads_captured_tables_as_the_oracle(name):
    """The learned cases' lookups, frozen: a relative-position table read by a computed index, a (B, N_k)
    table read by (b, kv_idx), a shape-() tensor, per-head slopes, a module's parameter; values and the
    gradients of q, k, v by the kernels."""
    check(via_backend("triton"), _frozen(SCORE_MODS[name]), 45, 67, torch.float32, tol=TRITON_TOL)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run on CPU tensors (tests/triton: CUDA)")
@pytest.mark.parametrize("block_size", [128, (32, 64), (16, 16)], ids=["128", "32x64", "16x16"])
def test_triton_block_masks_at_any_block_size_match_the_oracle(block_size):
    """A batch-dependent causal document block mask at block sizes above, across and below the kernels'
    tiles, with a score_mod; fp32 values and gradients."""
    N_q, N_k = 45, 67
    dims = Dims(B, H_Q, N_q, N_k)
    mask_mod = MASKS["causal_document"](dims, Params(torch.float32)).mask_mod
    block_mask = fa.create_block_mask(mask_mod, B, None, N_q, N_k, device="cpu", BLOCK_SIZE=block_size)
    q, k, v = inputs(N_q, N_k, torch.float32)
    O, lse = via_backend("triton")(q, k, v, score_mod=relative_causal, block_mask=block_mask)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    O_ref, lse_ref = oracle(q64, k64, v64, score_mod=relative_causal, mask_mod=mask_mod)
    torch.testing.assert_close(O.double(), O_ref, atol=TRITON_TOL["value"], rtol=0)
    assert_lse_equal(lse, lse_ref, TRITON_TOL["value"])
    grads = torch.autograd.grad(loss(O, lse), (q, k, v))
    refs = torch.autograd.grad(loss(O_ref, lse_ref), (q64, k64, v64))
    for name, got, ref in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(got.double(), ref, atol=TRITON_TOL["grad"], rtol=0, msg=f"d{name}")


def test_all_masked_rows_give_zero_and_minus_infinity():
    """A row whose scores score_mod sets to -inf gives O = 0 exactly and lse = -inf; the other rows are finite."""
    q, k, v = (t.detach() for t in inputs(113, 203, torch.float64))
    O, lse = fa.flex_attention(q, k, v, score_mod=hides_first_rows, enable_gqa=True, return_lse=True)
    assert torch.equal(O[..., :HIDDEN_ROWS, :], torch.zeros_like(O[..., :HIDDEN_ROWS, :]))
    assert torch.isneginf(lse[..., :HIDDEN_ROWS]).all() and torch.isfinite(lse[..., HIDDEN_ROWS:]).all()
