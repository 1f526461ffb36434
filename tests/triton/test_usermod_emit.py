"""Translated score_mod / mask_mod functions compute what the Python functions compute, in the interpreter.

A tiny kernel evaluates a compiled function on one ``(BLOCK_M, BLOCK_N)`` tile of scores at absolute
positions ``q0 + rows``, ``kv0 + cols``; the oracle is the same Python function evaluated by torch in
float64 on broadcast grids (``q_idx`` of shape ``(M, 1)``, ``kv_idx`` of ``(1, N)``), as the CPU paths
evaluate it, and ``d score_mod / d score`` is checked against torch.autograd on the same grid. The
functions are FlexAttention's test functions and the common masks of issue #24.

The last test compiles a forward-like kernel calling a translated score_mod and mask_mod ahead of time for
sm_90 (no GPU needed), in a subprocess without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flashattn_teach.triton.usermod import compile_mask_mod, compile_score_mod  # noqa: E402

BLOCK_M, BLOCK_N = 16, 32


@triton.jit
def _eval_score_mod(
    out_ptr, grad_ptr, score_ptr, b, h, q0, kv0, C0, C1, C2, C3,
    SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out = score_mod(score), grad = d score_mod / d score on one tile at rows q0.., columns kv0.."""
    rows = tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    offsets = rows * BLOCK_N + cols
    score = tl.load(score_ptr + offsets)
    q_idx = q0 + rows  # (BLOCK_M, 1)
    kv_idx = kv0 + cols  # (1, BLOCK_N)
    tl.store(out_ptr + offsets, SCORE_MOD(score, b, h, q_idx, kv_idx, C0, C1, C2, C3))
    tl.store(grad_ptr + offsets, SCORE_GRAD(score, b, h, q_idx, kv_idx, C0, C1, C2, C3))


@triton.jit
def _eval_mask_mod(
    out_ptr, b, h, q0, kv0, C0, C1, C2, C3, MASK_MOD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """out = mask_mod as int8 on one tile (broadcast to the tile: the result may be (1, 1), (M, 1), ...)."""
    rows = tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    # combined with & as a kernel would (in bounds), then broadcast to the tile
    visible = MASK_MOD(b, h, q0 + rows, kv0 + cols, C0, C1, C2, C3) & (rows < BLOCK_M)
    tile = tl.where(visible, 1, 0) + tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    tl.store(out_ptr + rows * BLOCK_N + cols, tile.to(tl.int8))


def _pointers(captures: tuple[torch.Tensor, ...], placeholder: torch.Tensor) -> list[torch.Tensor]:
    return [*captures, *[placeholder] * (4 - len(captures))]


def _grids(b: int, h: int, q0: int, kv0: int):
    index = dict(dtype=torch.int64)
    return (
        torch.tensor(b, **index),
        torch.tensor(h, **index),
        torch.arange(q0, q0 + BLOCK_M, **index)[:, None],
        torch.arange(kv0, kv0 + BLOCK_N, **index)[None, :],
    )


def run_score_mod(fn, captures=(), b=1, h=2, q0=16, kv0=8, seed=0):
    """(kernel out, kernel grad, torch float64 out, torch float64 grad) on one tile."""
    score = torch.randn(BLOCK_M, BLOCK_N, generator=torch.Generator().manual_seed(seed)) * 3
    compiled = compile_score_mod(fn, captures)
    out, grad = torch.empty_like(score), torch.empty_like(score)
    _eval_score_mod[(1,)](
        out, grad, score, b, h, q0, kv0, *_pointers(compiled.captures, score),
        SCORE_MOD=compiled.jit, SCORE_GRAD=compiled.grad, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    s64 = score.double().requires_grad_()
    ref = torch.as_tensor(fn(s64, *_grids(b, h, q0, kv0))).broadcast_to(score.shape)
    (ref_grad,) = torch.autograd.grad(ref.sum(), s64, allow_unused=True) if ref.requires_grad else (None,)
    ref_grad = torch.zeros_like(s64) if ref_grad is None else ref_grad
    return out.double(), grad.double(), ref.detach().double(), ref_grad


def run_mask_mod(fn, captures=(), b=1, h=2, q0=16, kv0=8, oracle=True):
    """(kernel mask, torch mask or None) as bool tiles."""
    compiled = compile_mask_mod(fn, captures)
    out = torch.empty(BLOCK_M, BLOCK_N, dtype=torch.int8)
    _eval_mask_mod[(1,)](
        out, b, h, q0, kv0, *_pointers(compiled.captures, out), MASK_MOD=compiled.jit, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N
    )
    ref = torch.as_tensor(fn(*_grids(b, h, q0, kv0))).broadcast_to(out.shape) if oracle else None
    return out.bool(), ref


# captured tensors of the test functions
SLOPE = torch.tensor([0.5, 0.25, 0.125, 0.0625])
BIAS = torch.tensor([0.3, -1.2, 2.5, 0.7])
REL = torch.linspace(-2.0, 2.0, 2 * 64 - 1)  # bias by distance q - kv, index (q - kv) + 63
TABLE = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1)).double()  # (B, H, 8), fp64
TEMPERATURE = torch.tensor(0.7)  # a 0-dim capture used as a number
OFFSET = torch.tensor(2)  # a 0-dim capture used as an index
DOC = torch.tensor([[0] * 20 + [1] * 18 + [2] * 26, [0] * 40 + [1] * 24])  # (B, 64) document ids
PREFIX = torch.tensor([12, 30])
GROUP = torch.tensor([0, 1, 0], dtype=torch.int32)  # document -> group, looked up by a looked-up id
T5_BIAS = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
LARGE_IDS = torch.tensor([5, 5 + 2**32, 7, 7 + 2**33])
PAD = torch.tensor([[True] * 30 + [False] * 34, [True] * 64])  # a bool capture

NEG_INF = -math.inf


def identity(score, b, h, q_idx, kv_idx):
    return score


def causal(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -float("inf"))


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx)


def relative_causal(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score + (q_idx - kv_idx), NEG_INF)


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPE[h] * (kv_idx - q_idx)


def times_two(score, b, h, q_idx, kv_idx):
    return score * 2


def squared(score, b, h, q_idx, kv_idx):
    return score * score


def head_offset(score, b, h, q_idx, kv_idx):
    return score * h


def trig(score, b, h, q_idx, kv_idx):
    return torch.sin(torch.cos(score)) + torch.tan(b)


def trig2(score, b, h, q_idx, kv_idx):
    return torch.cos(score) * torch.sin(score) + torch.tan(b)


def softcap(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


def learned_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[h]


def relative_table(score, b, h, q_idx, kv_idx):
    return score + REL[q_idx - kv_idx + 63]


def negative_index(score, b, h, q_idx, kv_idx):
    return score + BIAS[(kv_idx - q_idx) % 3 - 3]  # -3..-1: counts from the end, as torch


def three_dims_fp64(score, b, h, q_idx, kv_idx):
    return score - TABLE[b, h, kv_idx % 8]


def chained_index(score, b, h, q_idx, kv_idx):
    return score + TABLE[b][h][q_idx % 8]


def temperature(score, b, h, q_idx, kv_idx):
    return score / TEMPERATURE


def scalar_capture_as_index(score, b, h, q_idx, kv_idx):
    return score + TABLE[b, OFFSET, kv_idx % 8] * OFFSET


def kitchen_sink(score, b, h, q_idx, kv_idx):
    d = (q_idx - kv_idx).abs()
    x = torch.clamp(score, -2.0, 2.5) + torch.maximum(score, -score * 0.5) - torch.minimum(score, d.float() * 0.1)
    y = torch.sigmoid(score) * torch.exp(-d / 8) + torch.sqrt(score.abs() + 1) - torch.rsqrt(score * score + 2)
    z = torch.log(score.abs() + 1) + torch.exp2(score * 0.3) - torch.log2(d + 1.0) + (score**3) * 0.01
    w = (q_idx - kv_idx) // 3 + (kv_idx - q_idx) % 5 + (2.0 ** (score * 0.2)) + score.pow(2) * 0.1
    return x + y + z + w + score.to(torch.float16).float() + torch.floor(score) * 0.01


def t5_buckets(score, b, h, q_idx, kv_idx):
    # T5's bidirectional relative-position buckets (32 buckets, max distance 128) into a learned table
    relative = kv_idx - q_idx
    buckets = (relative > 0).long() * 16
    distance = torch.abs(relative)
    is_small = distance < 8
    large = 8 + (torch.log(distance.float() / 8) / math.log(128 / 8) * 8).to(torch.long)
    large = torch.min(large, torch.full_like(large, 15))
    return score + T5_BIAS[h, buckets + torch.where(is_small, distance, large)]


def relu_sign_ceil(score, b, h, q_idx, kv_idx):
    return (
        torch.nn.functional.relu(score) ** 2 + torch.sign(score) * torch.ceil(score * 0.5) + torch.relu(q_idx - kv_idx)
    )


def floats_floor_and_mod(score, b, h, q_idx, kv_idx):
    return score % 1.5 + score.detach() // 0.75 + torch.remainder(score, -2.0) + torch.floor(score).detach()


def full_like_bias(score, b, h, q_idx, kv_idx):
    return torch.where(kv_idx > q_idx, torch.full_like(score, -1e4), score) + torch.zeros_like(score)


def ignores_score(score, b, h, q_idx, kv_idx):
    return BIAS[h] + torch.ones_like(score)


def integer_widths(score, b, h, q_idx, kv_idx):
    wide = (q_idx.long() * 70000 + kv_idx) * 40000  # past int32: torch computes it in int64
    return score + (wide % 1000).float() + (q_idx * 300).to(torch.int8) + (score * 100).to(torch.int16)


SCORE_MODS = {
    "identity": (identity, ()),
    "causal": (causal, ()),
    "relative_bias": (relative_bias, ()),
    "relative_causal": (relative_causal, ()),
    "alibi": (alibi, (SLOPE,)),
    "times_two": (times_two, ()),
    "squared": (squared, ()),
    "head_offset": (head_offset, ()),
    "trig": (trig, ()),
    "trig2": (trig2, ()),
    "softcap": (softcap, ()),
    "learned_bias": (learned_bias, (BIAS,)),
    "relative_table": (relative_table, (REL,)),
    "negative_index": (negative_index, (BIAS,)),
    "three_dims_fp64": (three_dims_fp64, (TABLE,)),
    "chained_index": (chained_index, (TABLE,)),
    "temperature": (temperature, (TEMPERATURE,)),
    "scalar_capture_as_index": (scalar_capture_as_index, (OFFSET, TABLE)),
    "kitchen_sink": (kitchen_sink, ()),
    "t5_buckets": (t5_buckets, (T5_BIAS,)),
    "relu_sign_ceil": (relu_sign_ceil, ()),
    "floats_floor_and_mod": (floats_floor_and_mod, ()),
    "full_like_bias": (full_like_bias, ()),
    "ignores_score": (ignores_score, (BIAS,)),
    "integer_widths": (integer_widths, ()),
}


@pytest.mark.parametrize("name", list(SCORE_MODS))
@pytest.mark.parametrize(("b", "h", "q0", "kv0"), [(0, 0, 0, 0), (1, 3, 32, 16)])
def test_translated_score_mod_matches_torch_and_its_gradient_matches_autograd(name, b, h, q0, kv0) -> None:
    fn, captures = SCORE_MODS[name]
    out, grad, ref, ref_grad = run_score_mod(fn, captures, b=b, h=h, q0=q0, kv0=kv0)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5, equal_nan=True)
    torch.testing.assert_close(grad, ref_grad, rtol=2e-5, atol=2e-5, equal_nan=True)


def test_tie_gradients_of_maximum_and_clamp_are_torchs() -> None:
    # maximum(score, score) splits the gradient at the tie; clamp passes it at its bounds
    def ties(score, b, h, q_idx, kv_idx):
        return (
            torch.maximum(score, score)
            + torch.clamp(torch.floor(score), -1.0, 1.0)
            + torch.minimum(score, torch.zeros_like(score))
        )

    out, grad, ref, ref_grad = run_score_mod(ties)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)


def test_the_oracle_sees_a_wrong_translation() -> None:
    # negative control: the kernel's causal against the oracle of another function differs
    out, _, _, _ = run_score_mod(causal)
    _, _, ref, _ = run_score_mod(relative_causal)
    assert not torch.allclose(out, ref, equal_nan=True)


# --- random pointwise expressions ------------------------------------------------------------------------
def _ints(depth: int):
    leaves = st.sampled_from([("q",), ("kv",), ("h",), ("b",)])
    if depth == 0:
        return leaves
    sub = _ints(depth - 1)
    return st.one_of(
        leaves,
        st.tuples(st.sampled_from(["-", "+"]), sub, sub),
        st.tuples(st.sampled_from(["//", "%", "+c"]), sub, st.integers(-5, 5).filter(bool)),
        st.tuples(st.just("abs"), sub),
    )


def _bools(depth: int):
    ints = _ints(1)
    leaves = st.tuples(st.sampled_from(["<", "=="]), ints, ints)
    if depth == 0:
        return leaves
    sub = _bools(depth - 1)
    return st.one_of(leaves, st.tuples(st.sampled_from(["&", "|"]), sub, sub), st.tuples(st.just("~"), sub))


def _floats(depth: int):
    leaves = st.one_of(st.just(("score",)), st.tuples(st.just("int"), _ints(1), st.floats(-0.5, 0.5)))
    if depth == 0:
        return leaves
    sub = _floats(depth - 1)
    return st.one_of(
        leaves,
        st.tuples(st.sampled_from(["+", "max", "min"]), sub, sub),
        st.tuples(st.just("*c"), sub, st.floats(-2, 2)),
        st.tuples(st.sampled_from(["tanh", "sigmoid", "sin"]), sub),
        st.tuples(st.just("where"), _bools(1), sub, sub),
    )


def _evaluate(tree, score, b, h, q, kv):
    """The expression ``tree`` in torch operations (on tensors, or on the tracer's stand-ins)."""
    op, *args = tree
    leaves = {"score": score, "q": q, "kv": kv, "h": h, "b": b}
    if op in leaves:
        return leaves[op]
    e = [_evaluate(a, score, b, h, q, kv) if isinstance(a, tuple) else a for a in args]
    table = {
        "+": lambda x, y: x + y, "-": lambda x, y: x - y, "//": lambda x, c: x // c, "%": lambda x, c: x % c,
        "+c": lambda x, c: x + c, "abs": torch.abs, "<": lambda x, y: x < y, "==": lambda x, y: x == y,
        "&": lambda x, y: x & y, "|": lambda x, y: x | y, "~": lambda x: ~x, "int": lambda x, c: x.float() * c,
        "max": torch.maximum, "min": torch.minimum, "*c": lambda x, c: x * c, "tanh": torch.tanh,
        "sigmoid": torch.sigmoid, "sin": torch.sin, "where": torch.where,
    }  # fmt: skip
    return table[op](*e)


@given(tree=_floats(3), b=st.integers(0, 1), h=st.integers(0, 3), q0=st.sampled_from([0, 16, 48]))
def test_random_pointwise_expressions_match_torch(tree, b, h, q0) -> None:
    def random_mod(score, b, h, q_idx, kv_idx):
        return _evaluate(tree, score, b, h, q_idx, kv_idx)

    out, grad, ref, ref_grad = run_score_mod(random_mod, b=b, h=h, q0=q0, kv0=16)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-4)


# --- mask_mod ----------------------------------------------------------------------------------------------
def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 5)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX[b]) | (q_idx >= kv_idx)


def document(b, h, q_idx, kv_idx):
    return DOC[b, q_idx] == DOC[b, kv_idx]


def dilated_window(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx) % 2 == 0) & (torch.abs(q_idx - kv_idx) <= 6)


def large_ids(b, h, q_idx, kv_idx):
    return LARGE_IDS[q_idx % 4] == LARGE_IDS[kv_idx % 4]  # ids that differ only past 32 bits


def grouped_documents(b, h, q_idx, kv_idx):
    return GROUP[DOC[b, q_idx]] == GROUP[DOC[b, kv_idx]]


def padding(b, h, q_idx, kv_idx):
    return PAD[b, kv_idx] & ~(q_idx < 3)


def noop(b, h, q_idx, kv_idx):
    return b.new_ones(size=(), dtype=torch.bool, device=b.device)


def per_head(b, h, q_idx, kv_idx):
    return (h % 2 == 0) | (kv_idx <= q_idx)


def even_heads(b, h, q_idx, kv_idx):
    return (h % 2 == 0) & (b < 1)


def and_masks(*mods):  # the two-line combinators of torch.nn.attention.flex_attention
    return lambda b, h, q, kv: mods[0](b, h, q, kv) & mods[1](b, h, q, kv) if len(mods) == 2 else None


def or_masks(*mods):
    return lambda b, h, q, kv: mods[0](b, h, q, kv) | mods[1](b, h, q, kv)


MASK_MODS = {
    "causal": (causal_mask, ()),
    "sliding_window": (sliding_window, ()),
    "prefix_lm": (prefix_lm, (PREFIX,)),
    "document": (document, (DOC,)),
    "dilated_window": (dilated_window, ()),
    "grouped_documents": (grouped_documents, (DOC, GROUP)),
    "large_ids": (large_ids, (LARGE_IDS,)),
    "padding": (padding, (PAD,)),
    "noop": (noop, ()),
    "per_head": (per_head, ()),
    "even_heads": (even_heads, ()),
    "and_masks": (and_masks(causal_mask, document), (DOC,)),
    "or_masks": (or_masks(sliding_window, prefix_lm), (PREFIX,)),
    "noop_and_causal": (and_masks(noop, causal_mask), ()),
    "noop_or_causal": (or_masks(causal_mask, noop), ()),
    "nested_combinators": (and_masks(or_masks(causal_mask, prefix_lm), document), (PREFIX, DOC)),
}


@pytest.mark.parametrize("name", list(MASK_MODS))
@pytest.mark.parametrize(("b", "h", "q0", "kv0"), [(0, 0, 0, 0), (1, 3, 32, 16), (1, 2, 16, 32), (0, 2, 48, 0)])
def test_translated_mask_mod_matches_torch(name, b, h, q0, kv0) -> None:
    fn, captures = MASK_MODS[name]
    out, ref = run_mask_mod(fn, captures, b=b, h=h, q0=q0, kv0=kv0)
    assert torch.equal(out, ref), (out.int() - ref.int()).nonzero()[:5]


def test_lookups_past_a_captured_tensor_read_zero() -> None:
    # a ragged last tile: positions 40..63 are past the 40 document ids; torch would raise, we read 0
    short = DOC[:, :40].contiguous()
    padded = torch.cat([short, torch.zeros(2, 24, dtype=short.dtype)], dim=1)

    def short_document(b, h, q_idx, kv_idx):
        return short[b, q_idx] == short[b, kv_idx]

    def padded_document(b, h, q_idx, kv_idx):
        return padded[b, q_idx] == padded[b, kv_idx]

    out, _ = run_mask_mod(short_document, (short,), b=0, q0=32, kv0=32, oracle=False)
    _, ref = run_mask_mod(padded_document, (padded,), b=0, q0=32, kv0=32)
    assert torch.equal(out, ref)
    assert out[8:, 8:].all() and not out[:6, 8:].any()  # past the end (40..) the zeros match each other only


def test_strided_captures_are_read_through_their_strides() -> None:
    wide = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    transposed = wide.t()  # (3, 4), strides (1, 3)

    def by_stride(score, b, h, q_idx, kv_idx):
        return score + transposed[h % 3, kv_idx % 4]

    out, _, ref, _ = run_score_mod(by_stride, (transposed,))
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


# --- ahead-of-time compilation for sm_90 -------------------------------------------------------------------
AOT_SCRIPT = """
import torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from flashattn_teach.triton.usermod import compile_mask_mod, compile_score_mod

slope, pad = torch.rand(8), torch.ones(2, 4096, dtype=torch.bool)
doc, group = torch.zeros(2, 4096, dtype=torch.int64), torch.zeros(16, dtype=torch.int32)

def score_fn(s, b, h, q, kv):
    d = (q - kv).abs()
    x = 30 * torch.tanh(s / 30) + slope[h] * (kv - q) + torch.clamp(s, -2.0, 2.0) + torch.maximum(s, -s)
    y = torch.sqrt(s.abs()) + s ** 3 + s.to(torch.float16).float() + torch.tan(s) + (q - kv) // 3 + d % 5
    return torch.where(h % 2 == 0, x, y)

def mask_fn(b, h, q, kv):
    same = group[doc[b, q]] == group[doc[b, kv]]
    return same & pad[b, kv] & ((q >= kv) | (h == 0)) & ((q - kv) % 2 == 0)

score_mod = compile_score_mod(score_fn, (slope,))
mask_mod = compile_mask_mod(mask_fn, (pad, doc, group))

@triton.jit
def toy_forward(Q, K, O, C0, D0, D1, D2, b, h, N, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
                MASK_MOD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD)
    q = tl.load(Q + rows[:, None] * HEAD + d[None, :])
    acc = tl.zeros((BLOCK_M, HEAD), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(K + cols[:, None] * HEAD + d[None, :])
        s = tl.dot(q, tl.trans(k))
        s = SCORE_MOD(s, b, h, rows[:, None], cols[None, :], C0, C0, C0, C0)
        s = s * SCORE_GRAD(s, b, h, rows[:, None], cols[None, :], C0, C0, C0, C0)
        visible = MASK_MOD(b, h, rows[:, None], cols[None, :], D0, D1, D2, D0) & (cols[None, :] < N)
        s = tl.where(visible, s, -float("inf"))
        acc += tl.dot(tl.exp(s).to(tl.float16), k)
    tl.store(O + rows[:, None] * HEAD + d[None, :], acc.to(tl.float16))

signature = {"Q": "*fp16", "K": "*fp16", "O": "*fp16", "C0": "*fp32", "D0": "*i1", "D1": "*i64", "D2": "*i32",
             "b": "i32", "h": "i32", "N": "i32", "SCORE_MOD": "constexpr", "SCORE_GRAD": "constexpr",
             "MASK_MOD": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "HEAD": "constexpr"}
constexprs = {"SCORE_MOD": score_mod.jit, "SCORE_GRAD": score_mod.grad, "MASK_MOD": mask_mod.jit,
              "BLOCK_M": 128, "BLOCK_N": 64, "HEAD": 64}
source = triton.compiler.ASTSource(fn=toy_forward, signature=signature, constexprs=constexprs)
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 2})
ptx = compiled.asm["ptx"]
print("ok", len(compiled.asm["cubin"]) > 0, "ex2" in ptx, "ld.global" in ptx)
"""


def test_a_kernel_calling_translated_functions_compiles_for_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH", "")])
    script = tmp_path / "aot.py"
    script.write_text(textwrap.dedent(AOT_SCRIPT))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["ok", "True", "True", "True"], done.stdout
