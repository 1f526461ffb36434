"""The one-kernel backward (dQ by fp32 atomic adds) and the deterministic two-kernel backward: both give the
float64 oracle's gradients; ``deterministic=True`` and ``torch.use_deterministic_algorithms(True)`` select the
two kernels, observed by which kernels launch; the compiled op carries the flag."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator

import pytest
import torch
from _triton_cases import DEVICE, REL_TOL, Case, assert_close_scaled

import flashattn_teach as fa
from flashattn_teach._options import make_options
from flashattn_teach.errors import AttentionValueError
from flashattn_teach.ops import attention as ops
from flashattn_teach.triton import AttentionConfig, KernelConfig, triton_attention
from flashattn_teach.triton.kernels import backward_dkdv, backward_dq

TILE = AttentionConfig.uniform(32, 16)


@pytest.fixture(autouse=True)
def _one_kernel_backward_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the one-kernel backward is off by default until a GPU run passes it (triton/provenance.py);
    these tests are of its on position (the interpreter's test configuration has it either way)."""
    monkeypatch.setenv("FLASHATTN_TEACH_FUSED_BACKWARD", "1")


@contextlib.contextmanager
def launched() -> Iterator[list[str]]:
    """The backward kernels launched inside the block, in order: "fused" (dK/dV with DQ_ATOMIC), "dkdv", "dq"."""
    names: list[str] = []

    class Spy:
        def __init__(self, kernel, name: str) -> None:
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                names.append("fused" if kwargs.get("DQ_ATOMIC") else self.name)
                return self.kernel[grid](*args, **kwargs)

            return launch

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backward_dkdv, "attn_bwd_dkdv", Spy(backward_dkdv.attn_bwd_dkdv, "dkdv"))
        mp.setattr(backward_dq, "attn_bwd_dq", Spy(backward_dq.attn_bwd_dq, "dq"))
        yield names


@contextlib.contextmanager
def torch_deterministic(warn_only: bool = False) -> Iterator[None]:
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)


def grads(fn, q, k, v, dO, dlse):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    O, lse = fn(q, k, v)
    loss = (O * dO.to(O.dtype)).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isneginf(lse), 0.0, lse) * dlse.to(lse.dtype)).sum()
    return torch.autograd.grad(loss, (q, k, v))


def check(c: Case, deterministic: bool, with_dlse: bool = True, **variants) -> None:
    """dq, dk, dv of the kernels against the float64 oracle, and the kernels that ran."""
    q, k, v = c.tensors()
    g = torch.Generator().manual_seed(3)
    dO = torch.randn(c.B, c.H_q, c.N_q, c.D_v, generator=g).to(DEVICE, c.dtype)
    dlse = torch.randn(c.B, c.H_q, c.N_q, generator=g).to(DEVICE) if with_dlse else None
    kw = dict(causal=c.causal, causal_align=c.causal_align, enable_gqa=True, return_lse=True, **variants)
    with launched() as names:
        got = grads(
            lambda q, k, v: triton_attention(q, k, v, config=c.config, deterministic=deterministic, **kw),
            q, k, v, dO, dlse,
        )  # fmt: skip
    assert names == (["dkdv", "dq"] if deterministic else ["fused"])
    want = grads(
        lambda q, k, v: fa.dense_attention(q, k, v, **kw),
        *(t.double().cpu() for t in (q, k, v)), dO.double().cpu(), None if dlse is None else dlse.double().cpu(),
    )  # fmt: skip
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == c.dtype and a.shape == b.shape
        assert_close_scaled(a, b, 2 * REL_TOL[c.dtype], name)


SHAPES = {
    # (B, H_kv, group, N_q, N_k, D, D_v, causal, causal_align, dtype)
    "gqa_causal_ragged": (1, 1, 3, 113, 70, 24, 24, True, "bottom_right", torch.float32),
    "plain_fp16_dv_differs": (2, 1, 1, 45, 113, 40, 32, False, "top_left", torch.float16),
}


@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_both_backwards_match_dense(shape: str, deterministic: bool) -> None:
    check(Case(*SHAPES[shape], config=TILE), deterministic)


@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["softcap_alibi_seqlens", "and_window"])
def test_both_backwards_match_dense_with_variants(causal: bool, deterministic: bool) -> None:
    # seqlens_k cuts a key block in two: the fused kernel must add no dQ from keys past the length, which
    # the two-kernel backward never visits and the dK/dV loop does (without a window they reach rows)
    c = Case(2, 1, 2, 37, 53, 16, 16, causal, "bottom_right", torch.float32, TILE)
    lengths = torch.tensor([21, 53], device=DEVICE)
    slopes = torch.tensor([0.5, 0.25], device=DEVICE)
    window = (9, 3) if causal else None
    check(c, deterministic, window=window, softcap=5.0, alibi_slopes=slopes, seqlens_k=lengths)


def test_fused_backward_with_a_bool_mask_matches_dense() -> None:
    c = Case(1, 1, 2, 40, 50, 16, 16, False, "top_left", torch.float32, TILE)
    mask = torch.rand(1, 1, 40, 50, generator=torch.Generator().manual_seed(5)) > 0.3
    check(c, False, attn_mask=mask.to(DEVICE))


@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
def test_both_backwards_match_dense_on_packed_sequences(deterministic: bool) -> None:
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 17, 17, 60], dtype=torch.int32)  # an empty sequence in the middle
    q, k, v = (torch.randn(60, h, 16, generator=g).to(DEVICE) for h in (4, 2, 2))
    dO = torch.randn(60, 4, 16, generator=g).to(DEVICE)

    def run(q, k, v, backend):
        return fa.flash_attention_varlen(
            q, k, v, cu.to(q.device), cu.to(q.device), 43, 43, causal=True, backend=backend,
            deterministic=deterministic, return_lse=True,
        )  # fmt: skip

    with launched() as names:
        got = grads(lambda q, k, v: run(q, k, v, "triton"), q, k, v, dO, None)
    assert names == (["dkdv", "dq"] if deterministic else ["fused"])
    want = grads(lambda q, k, v: run(q, k, v, "dense"), q.double(), k.double(), v.double(), dO.double(), None)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_close_scaled(a, b, 2 * REL_TOL[torch.float32], name)


def test_two_deterministic_backwards_are_bitwise_equal() -> None:
    c = Case(1, 1, 2, 49, 70, 32, 32, True, "bottom_right", torch.float16, TILE)
    q, k, v = c.tensors()
    dO = torch.randn(1, 2, 49, 32).to(DEVICE, torch.float16)

    def attention(q, k, v):
        return triton_attention(q, k, v, causal=True, causal_align="bottom_right", enable_gqa=True, return_lse=True,
                                config=TILE, deterministic=True)  # fmt: skip

    first, second = grads(attention, q, k, v, dO, None), grads(attention, q, k, v, dO, None)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def _backward_kernels(deterministic: bool = False) -> list[str]:
    q, k, v = Case(1, 1, 1, 40, 40, 16, 16, True, "top_left", torch.float32, TILE).tensors()
    q.requires_grad_()
    out = fa.flash_attention(q, k, v, causal=True, backend="triton", deterministic=deterministic)
    with launched() as names:
        out.sum().backward()  # the flag is read here, when the backward runs
    return names


def test_torch_use_deterministic_algorithms_selects_the_two_kernels() -> None:
    assert _backward_kernels() == ["fused"]  # the control: the default backward is one kernel
    with torch_deterministic():
        assert _backward_kernels() == ["dkdv", "dq"]
    assert _backward_kernels() == ["fused"]
    assert _backward_kernels(deterministic=True) == ["dkdv", "dq"]


def test_warn_only_selects_the_two_kernels_too_since_this_backward_has_a_deterministic_one() -> None:
    # torch's warn_only turns into a warning only the error of an op with no deterministic implementation
    with torch_deterministic(warn_only=True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _backward_kernels() == ["dkdv", "dq"]
    assert not [w for w in caught if "determin" in str(w.message)]


def test_explain_says_which_backward_runs_and_why() -> None:
    q = torch.randn(1, 2, 40, 16, device=DEVICE)  # 40 queries fill the interpreter's 32-row tile
    fused = str(fa.explain(q, q, q, backend="triton"))
    assert "one kernel per key block, dQ added in fp32 by atomics" in fused
    assert "two kernels" in str(fa.explain(q, q, q, backend="triton", deterministic=True))
    with torch_deterministic():
        assert "torch.use_deterministic_algorithms(True)" in str(fa.explain(q, q, q, backend="triton"))
    assert "deterministic already" in str(fa.explain(q, q, q, backend="query_major", deterministic=True))


@pytest.mark.parametrize("N_q", [1, 31])
def test_fewer_queries_than_the_one_kernel_tile_run_the_two_kernels(N_q: int) -> None:
    # below BLOCK_M = 32 rows every key block would add dQ into one partial query tile (and triton 3.6's
    # ptxas crashes on the hd64 GQA build at N_q = 1): the two kernels run, and explain says so and why
    c = Case(1, 1, 4, N_q, 70, 32, 32, True, "bottom_right", torch.float16, TILE)
    q, k, v = c.tensors()
    g = torch.Generator().manual_seed(5)
    dO = torch.randn(c.B, c.H_q, N_q, c.D_v, generator=g).to(DEVICE, c.dtype)
    kw = dict(causal=True, causal_align="bottom_right", enable_gqa=True, return_lse=True)
    with launched() as names:
        got = grads(lambda q, k, v: triton_attention(q, k, v, config=TILE, **kw), q, k, v, dO, None)
    assert names == ["dkdv", "dq"]
    want = grads(lambda q, k, v: fa.dense_attention(q, k, v, **kw), *(t.double() for t in (q, k, v)), dO.double(), None)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_close_scaled(a, b, 2 * REL_TOL[c.dtype], name)
    told = str(fa.explain(q, k, v, is_causal=True, backend="triton", causal_align="bottom_right", enable_gqa=True))
    assert "backward: two kernels (dK/dV, then dQ), bitwise reproducible" in told
    assert f"N_q = {N_q} queries do not fill the one-kernel tile's 32 rows" in told


def test_the_op_carries_deterministic_to_the_backward() -> None:
    q, k, v = Case(1, 1, 1, 40, 40, 16, 16, True, "top_left", torch.float32, TILE).tensors()
    q.requires_grad_()
    qd = q.detach().double().requires_grad_()
    (want_dq,) = torch.autograd.grad(fa.dense_attention(qd, k.double(), v.double(), causal=True).sum(), (qd,))
    for deterministic, want in ((True, ["dkdv", "dq"]), (False, ["fused"])):
        opts = make_options(q, k, v, causal=True, deterministic=deterministic)
        args = ops.AttentionArgs.of_call(opts, "triton", scale_given=False, alibi_slopes=None, seqlens_k=None)
        assert args.deterministic == deterministic
        O, _ = ops.call(q, k, v, args)
        with launched() as names:
            (dq,) = torch.autograd.grad(O.sum(), (q,))
        assert names == want  # the op's backward recomputes the forward and differentiates it
        assert_close_scaled(dq, want_dq, 2 * REL_TOL[torch.float32], "dq")


def test_parallel_backward_is_bitwise_reproducible_and_accepts_deterministic() -> None:
    # big enough for the worker pool (2^19 scores); GQA, so that dK, dV are sums over query-head parts
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 512, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 256, 16, generator=g, requires_grad=True) for _ in range(2))
    runs = []
    for deterministic in (False, True):
        out = fa.flash_attention(q, k, v, causal=True, backend="parallel", deterministic=deterministic)
        runs.append(torch.autograd.grad(out.sum(), (q, k, v)))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_a_split_one_kernel_tile_is_refused_by_name() -> None:
    with pytest.raises(AttentionValueError, match=r"backward_fused=.*split"):
        dataclasses.replace(TILE, backward_fused=KernelConfig(16, 64, 8, 2, split=True))


def test_the_transformers_integration_passes_deterministic_through() -> None:
    from flashattn_teach.integrations import transformers as integration

    q = torch.randn(1, 2, 40, 16, device=DEVICE, requires_grad=True)
    module = torch.nn.Module()
    for deterministic, want in ((True, ["dkdv", "dq"]), (None, ["fused"])):  # None: transformers' default
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(integration, "flash_attention", lambda *a, **kw: fa.flash_attention(*a, **kw, backend="triton"))
            out, _ = integration.attention_forward(module, q, q, q, None, deterministic=deterministic)
        with launched() as names:
            out.sum().backward()
        assert names == want
    with pytest.raises(TypeError, match="deterministic"):
        integration.attention_forward(module, q, q, q, None, deterministic="yes")
