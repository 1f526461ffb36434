"""``replay(..., source="triton")``: every term the tutorial kernel traced (core/kernel.py, ``TRACE=True``, in
Triton's interpreter) against the reference's, within what the kernel's arithmetic allows, and a negative control
for each way the comparison could pass by accident (a perturbed ``alpha``, a wrong scale).

The bounds are a priori, from the inputs, never from the kernel's output (``u`` is the unit roundoff, ``2^-24`` in
float32, ``2^-11`` in float16; ``n`` the keys folded in so far):

    S_ij    (D + 4) u32 scale (|Q_i| |K_j|^T)      a length-D dot, the folded scale, the ln 2 back
    m_i     the same, its row's largest             a maximum of those scores
    alpha   alpha (2 e_m + 4 u32)                   exp of a difference of two maxima
    l_i     l_i (2 e_m + (n + 4) u32)               a sum of n exponentials
    acc     (2 e_m + (n + 4) u32 + uP) l_i max|V|   the same sum times V; uP: P rounded to V's dtype (float16: u16)

with ``e_m`` the row's ``m_i`` bound. The reference computes in float32 from the same (float16) values, or in
float64 from float64 inputs (then the kernel's input rounding, ``u32`` relative, is in the same bounds)."""

from __future__ import annotations

import dataclasses
import math

import pytest

pytest.importorskip("triton")

import torch

from flashattn_teach.errors import AttentionValueError
from flashattn_teach.replay import replay
from flashattn_teach.replay.kernel_trace import KERNEL_TERMS, kernel_blocks, run_trace

U32, U16 = 2.0**-24, 2.0**-11
# (N_q, N_k, D, block): several tiles, a short last one both ways, N_q != N_k, D = 24 (lanes masked)
SHAPES = [(20, 33, 16, 16), (37, 53, 24, 16), (16, 40, 32, 32)]


def inputs(N_q: int, N_k: int, D: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(N_q * 100 + N_k + D)
    return tuple(torch.randn(n, D, generator=g).to(dtype) for n in (N_q, N_k, N_k))


def bounds(step, q, k, v, scale: float, p_rounding: float) -> dict[str, torch.Tensor]:
    """The a-priori bound of each term (module docstring), elementwise, float64."""
    (r0, r1), (c0, c1) = step.rows, step.cols
    D = q.shape[-1]
    qa, ka = q[r0:r1].double().abs(), k.double().abs()
    e_S = (D + 4) * U32 * scale * (qa @ ka[c0:c1].T)  # (Br, Bc)
    e_m = (D + 4) * U32 * scale * (qa @ ka[:c1].T).amax(-1)  # (Br,): any score seen so far
    n = c1
    rel = 2 * e_m + (n + 4) * U32  # (Br,)
    l_i = step["l_i"].double()
    return {
        "S_ij": e_S,
        "m_i": e_m,
        "alpha": step["alpha"].double() * (2 * e_m + 4 * U32),
        "l_i": l_i * rel,
        "acc_new": ((rel + p_rounding) * l_i * v.double().abs().max()).unsqueeze(-1).expand(-1, D),
    }


def over_bound(step, q, k, v, scale: float, p_rounding: float) -> list[str]:
    """The terms whose kernel value is further from the reference's than their bound allows, anywhere."""
    bad = []
    for name, bound in bounds(step, q, k, v, scale, p_rounding).items():
        mine, ref = step.kernel[name], step[name].double()
        same = mine == ref  # -inf against -inf (a masked score)
        if not bool((same | ((mine - ref).abs() <= bound + 1e-300)).all()):
            bad.append(name)
    return bad


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("N_q", "N_k", "D", "block"), SHAPES)
def test_every_traced_term_matches_the_reference_in_float32(causal, N_q, N_k, D, block) -> None:
    q, k, v = inputs(N_q, N_k, D, torch.float32)
    scale = 1 / math.sqrt(D)
    blocks = -(-N_q // block)
    checked = 0
    for i in range(blocks):
        r = replay(q, k, v, causal=causal, block_m=block, block_n=block, query_block=i, source="triton")
        assert r.source == "triton" and r.note == ""
        for step in r.steps:
            assert set(step.kernel) == set(KERNEL_TERMS)
            assert over_bound(step, q, k, v, scale, 0.0) == [], (i, step.j, step.kernel_diff)
            checked += 1
    assert checked >= blocks  # every query block has at least one step


@pytest.mark.parametrize("causal", [False, True])
def test_float16_inputs_differ_in_acc_by_the_rounding_of_P_only(causal) -> None:
    q, k, v = inputs(37, 53, 16, torch.float16)
    for i in range(3):
        r = replay(q, k, v, causal=causal, block_m=16, block_n=16, query_block=i, source="triton")
        for step in r.steps:
            assert over_bound(step, q, k, v, 0.25, U16) == [], step.kernel_diff
            # without the P rounding in the bound, acc (and only acc) is out of it: the cast shows
            assert set(over_bound(step, q, k, v, 0.25, 0.0)) <= {"acc_new"}
    assert "acc_new" in over_bound(step, q, k, v, 0.25, 0.0)  # the last step of the last block, at least


def test_a_perturbed_alpha_in_the_trace_fails_the_comparison() -> None:
    q, k, v = inputs(20, 33, 16, torch.float32)
    r = replay(q, k, v, block_m=16, block_n=16, source="triton")
    trace = r.steps.kernel_terms.__self__  # the KernelTrace whose records the steps read
    step = r.steps[1]
    assert over_bound(step, q, k, v, 0.25, 0.0) == []
    trace.buffer[0, 1, :, trace.block_n + 2] *= 1 + 1e-5  # alpha of tile (0, 1), ten times its bound
    assert over_bound(r.steps[1], q, k, v, 0.25, 0.0) == ["alpha"]
    assert r.steps[1].kernel_diff["alpha"] > 0 == r.steps[0].kernel_diff["alpha"]


def test_a_kernel_run_with_a_wrong_scale_fails_the_comparison() -> None:
    q, k, v = inputs(20, 33, 16, torch.float32)
    r = replay(q, k, v, block_m=16, block_n=16, source="triton")
    wrong = run_trace(q, k, v, False, 0.25 * (1 + 1e-5), 16, 16)  # the kernel alone given a scale 1e-5 off
    steps = dataclasses.replace(r.steps, kernel_terms=wrong.terms)
    assert {"S_ij", "m_i"} <= set(over_bound(steps[0], q, k, v, 0.25, 0.0))
    assert over_bound(r.steps[0], q, k, v, 0.25, 0.0) == []


def test_kernel_m_is_the_base_2_maximum_times_ln2() -> None:
    q, k, v = inputs(20, 33, 16, torch.float32)
    r = replay(q, k, v, block_m=16, block_n=16, source="triton")
    trace = r.steps.kernel_terms.__self__
    step = r.steps[0]
    base2 = trace.buffer[0, 0, :16, trace.block_n].double()
    S = (q[:16].double() @ k[:16].double().T) * 0.25  # (16, 16), base e
    torch.testing.assert_close(base2, S.amax(-1) / math.log(2), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(step.kernel["m_i"], base2 * math.log(2), rtol=0, atol=0)


def test_the_replay_takes_the_kernels_tiles_and_says_so() -> None:
    q, k, v = inputs(6, 6, 4, torch.float64)  # the teaching example's sizes, float64
    r = replay(q, k, v, block_m=2, block_n=2, query_block=2, causal=True, source="triton")
    assert kernel_blocks(2, 2) == (16, 16) and kernel_blocks(17, 64) == (32, 64)
    assert (r.block_m, r.block_n, r.query_block, len(r.steps)) == (16, 16, 0, 1)
    assert "16 x 16" in r.note and "2 x 2" in r.note and "row 4" in r.note and "float32" in r.note
    assert over_bound(r.steps[0], q, k, v, 0.5, 0.0) == []
    plain = replay(q, k, v, block_m=2, block_n=2).steps[0]  # source="reference": no kernel numbers
    assert plain.kernel == {} and plain.kernel_diff == {}


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"order": "key_major"}, "order"),
        ({"window": (2, 0)}, "window"),
        ({"sinks": 0.5}, "sinks"),
        ({"source": "cuda"}, "source must be one of"),
    ],
)
def test_what_the_kernel_cannot_run_is_refused_by_name(options, named) -> None:
    q, k, v = inputs(6, 6, 4, torch.float32)
    with pytest.raises(AttentionValueError, match=named):
        replay(q, k, v, block_m=16, block_n=16, **{"source": "triton", **options})


def test_bfloat16_is_refused_in_the_interpreter() -> None:
    q, k, v = inputs(6, 6, 16, torch.bfloat16)
    with pytest.raises(AttentionValueError, match="interpreter multiplies bfloat16"):
        replay(q, k, v, block_m=16, block_n=16, source="triton")


def test_a_bottom_right_diagonal_is_refused_where_it_differs_from_the_kernels() -> None:
    q, k, v = inputs(6, 9, 16, torch.float32)
    with pytest.raises(AttentionValueError, match="top-left"):
        replay(q, k, v, block_m=16, block_n=16, causal=True, causal_align="bottom_right", source="triton")
    q, k, v = inputs(9, 9, 16, torch.float32)  # N_q = N_k: the two diagonals are one
    r = replay(q, k, v, block_m=16, block_n=16, causal=True, causal_align="bottom_right", source="triton")
    assert over_bound(r.steps[0], q, k, v, 0.25, 0.0) == []
