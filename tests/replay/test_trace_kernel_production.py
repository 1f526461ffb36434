"""``replay(..., source="triton", kernel="production")``: every term the production forward traced
(triton/kernels/forward.py, ``TRACE=True``, in Triton's interpreter at its launcher's tile, 32 x 16) against the
reference's, within what the kernel's arithmetic allows; negative controls (a corrupted record, another batch
element's programs); the ladder (the same step traced in the tutorial kernel and in the production kernel); the
CLI's page with both columns.

The bounds are a priori, from the inputs, never from the kernel's output (``u`` the unit roundoff, ``2^-24`` in
float32, ``2^-11`` in float16; ``n`` the keys folded in so far). The production kernel rounds what the tutorial
kernel rounds (tests/replay/test_trace_kernel.py): a length-D dot in float32, one multiply by ``qk_scale`` (its
row maximum is taken of the raw scores and scaled once, which rounds the same as the maximum of the scaled ones,
the scale being positive), ``exp2`` of a difference, float32 sums, and ``P`` rounded to V's dtype for the MMA:

    S_ij    (D + 4) u32 scale (|Q_i| |K_j|^T)  + e_mod   a dot, the folded scale, the ln 2 back
    m_i     the same over the row's scores seen so far    a maximum of those scores (or the sink: 4 u32 |sink|)
    alpha   alpha (2 e_m + 4 u32)                         exp of a difference of two maxima
    l_i     l_i (2 e_m + (n + 4) u32)                     a sum of n exponentials
    acc     (2 e_m + (n + 4) u32 + uP) l_i max|V|         the same sum times V; uP: P rounded to V's dtype

``e_mod``: softcap, ALiBi and an additive mask change the score in base 2 after the scale (a tanh, a product and
a sum, each rounded once to float32, on numbers no larger than the modified score): ``8 u32 |S_ij|``, with
``|S_ij|`` the reference's modified score, is taken for them. Masks (causal, window, ``seqlens_k``, a bool
``attn_mask``) add no arithmetic: a masked score is ``-inf`` on both sides."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("triton")

import torch

from flashattn_teach.dropout import DropoutKey
from flashattn_teach.errors import AttentionValueError
from flashattn_teach.replay import replay
from flashattn_teach.replay.kernel_trace import KERNEL_TERMS, PRODUCTION_NOTE
from flashattn_teach.triton.configs import TEST_CONFIG
from flashattn_teach.triton.forward_trace import traced_tile
from flashattn_teach.triton.variants import PLAIN

from replay_cli import main

U32, U16 = 2.0**-24, 2.0**-11
BM, BN = TEST_CONFIG.forward.BLOCK_M, TEST_CONFIG.forward.BLOCK_N  # the interpreter's tile: 32 x 16


def inputs(N_q: int, N_k: int, D: int, dtype: torch.dtype, B: int | None = None, D_v: int | None = None):
    g = torch.Generator().manual_seed(N_q * 100 + N_k + D)
    batch = () if B is None else (B,)
    return tuple(torch.randn(*batch, n, d, generator=g).to(dtype) for n, d in ((N_q, D), (N_k, D), (N_k, D_v or D)))


def bounds(step, q, k, v, scale: float, p_rounding: float, modified: bool, sink: float = 0.0) -> dict:
    """The a-priori bound of each term (module docstring), elementwise, float64; ``q, k, v`` the replayed
    element's ``(N, D)`` matrices."""
    (r0, r1), (c0, c1) = step.rows, step.cols
    D = q.shape[-1]
    qa, ka = q[r0:r1].double().abs(), k.double().abs()
    e_S = (D + 4) * U32 * scale * (qa @ ka[c0:c1].T)  # (Br, Bc)
    e_m = (D + 4) * U32 * scale * (qa @ ka[:c1].T).amax(-1) + 4 * U32 * abs(sink)  # (Br,)
    if modified:
        S = step["S_ij"].double().nan_to_num(0.0, posinf=0.0, neginf=0.0).abs()  # (Br, Bc), -inf: masked
        e_S = e_S + 8 * U32 * S
        e_m = e_m + 8 * U32 * S.amax(-1)  # a bound on the new maximum's; the earlier ones are no larger here
    rel = 2 * e_m + (c1 + 4) * U32  # (Br,)
    l_i = step["l_i"].double()
    return {
        "S_ij": e_S,
        "m_i": e_m,
        "alpha": step["alpha"].double() * (2 * e_m + 4 * U32),
        "l_i": l_i * rel,
        "acc_new": ((rel + p_rounding) * l_i * v.double().abs().max()).unsqueeze(-1).expand(-1, v.shape[-1]),
    }


def over_bound(step, q, k, v, scale, p_rounding=0.0, modified=False, sink=0.0) -> list[str]:
    """The terms whose kernel value is further from the reference's than their bound allows, anywhere."""
    bad = []
    for name, bound in bounds(step, q, k, v, scale, p_rounding, modified, sink).items():
        mine, ref = step.kernel[name], step[name].double()
        same = mine == ref  # -inf against -inf (a masked score)
        if not bool((same | ((mine - ref).abs() <= bound + 1e-300)).all()):
            bad.append(name)
    return bad


def every_step(q, k, v, **options):
    """Every step of every query block of the production kernel's replay, with its replay."""
    N_q = q.shape[-2]
    for i in range(-(-N_q // BM)):
        r = replay(q, k, v, block_m=BM, block_n=BN, query_block=i, source="triton", kernel="production", **options)
        assert (r.block_m, r.block_n, r.kernel, r.source) == (BM, BN, "production", "triton")
        for step in r.steps:
            assert set(step.kernel) == set(KERNEL_TERMS)
            yield r, step


@pytest.mark.parametrize(
    ("N_q", "N_k", "D", "options"),
    [
        (40, 53, 24, {}),  # a short last block both ways, D = 24 (lanes masked)
        (40, 53, 24, {"causal": True}),
        (70, 33, 16, {"causal": True}),  # top-left: rows past N_k see every key
        (40, 53, 24, {"causal": True, "causal_align": "bottom_right"}),  # the diagonal 13 keys right
    ],
)
def test_every_traced_term_matches_the_reference_in_float32(N_q, N_k, D, options) -> None:
    q, k, v = inputs(N_q, N_k, D, torch.float32)
    steps = 0
    for _, step in every_step(q, k, v, **options):
        assert over_bound(step, q, k, v, 1 / math.sqrt(D)) == [], (step.i, step.j, step.kernel_diff)
        steps += 1
    assert steps >= -(-N_q // BM)


@pytest.mark.parametrize("causal", [False, True])
def test_float16_inputs_differ_in_acc_by_the_rounding_of_P_only(causal) -> None:
    q, k, v = inputs(40, 53, 16, torch.float16)
    out_without_uP = set()
    for _, step in every_step(q, k, v, causal=causal):
        assert over_bound(step, q, k, v, 0.25, U16) == [], step.kernel_diff
        out_without_uP |= set(over_bound(step, q, k, v, 0.25, 0.0))
    assert out_without_uP == {"acc_new"}  # without P's rounding in the bound, acc (and only acc) is out: the cast


@pytest.mark.parametrize(
    ("options", "modified"),
    [
        ({"window": (10, 3)}, False),  # the window's masked first stage
        ({"attn_mask": "bool"}, False),
        ({"seqlens_k": torch.tensor([53, 20, 37]), "causal": True, "causal_align": "bottom_right"}, False),
        ({"sinks": 1.5}, False),
        ({"softcap": 2.0}, True),
        ({"alibi_slopes": torch.tensor([0.3, 0.5, 0.25])}, True),
        ({"attn_mask": "additive"}, True),
    ],
    ids=["window", "bool_mask", "seqlens_k", "sinks", "softcap", "alibi", "additive_mask"],
)
def test_the_variants_traced_terms_match_the_reference(options, modified) -> None:
    q, k, v = inputs(40, 53, 16, torch.float32, B=3, D_v=24)  # a batch (its element 2 replayed), D_v != D
    g = torch.Generator().manual_seed(7)
    if options.get("attn_mask") == "bool":
        options = {"attn_mask": torch.rand(3, 40, 53, generator=g) > 0.3}
    elif options.get("attn_mask") == "additive":
        options = {"attn_mask": torch.randn(3, 40, 53, generator=g)}
    sink = options.get("sinks", 0.0)
    for _, step in every_step(q, k, v, batch_index=2, **options):
        assert over_bound(step, q[2], k[2], v[2], 0.25, modified=modified, sink=sink) == [], step.kernel_diff


def test_a_corrupted_record_fails_the_comparison() -> None:
    q, k, v = inputs(40, 53, 16, torch.float32)
    r = replay(q, k, v, block_m=BM, block_n=BN, source="triton", kernel="production")
    trace = r.steps.kernel_terms.__self__  # the KernelTrace whose records the steps read
    assert over_bound(r.steps[1], q, k, v, 0.25) == []
    trace.buffer[0, 1, :, BN + 1] *= 1 + 1e-5  # l_i of tile (0, 1), about ten times its bound
    assert over_bound(r.steps[1], q, k, v, 0.25) == ["l_i"]
    assert over_bound(r.steps[0], q, k, v, 0.25) == []  # the other records untouched


def test_another_batch_elements_programs_fail_the_comparison() -> None:
    """The trace build selects the programs of one ``(b, h)``: element 0's trace is not element 1's numbers."""
    q, k, v = inputs(40, 53, 16, torch.float32, B=2)
    mine = replay(q, k, v, block_m=BM, block_n=BN, source="triton", kernel="production", batch_index=1)
    other = replay(q, k, v, block_m=BM, block_n=BN, source="triton", kernel="production", batch_index=0)
    assert over_bound(mine.steps[0], q[1], k[1], v[1], 0.25) == []
    swapped = dataclasses.replace(mine.steps, kernel_terms=other.steps.kernel_terms)
    assert set(over_bound(swapped[0], q[1], k[1], v[1], 0.25)) == set(KERNEL_TERMS) - {"alpha"}  # 0 before a key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_the_ladder_both_kernels_trace_the_same_steps(dtype, causal) -> None:
    """The tutorial kernel at the same 32 x 16 tile visits the same tiles in the same order, and its numbers and the
    production kernel's are each within the a-priori bound of the reference's, so within twice it of each other:
    they differ in the last bits only (the tutorial's ``LOG2E`` has 9 digits, a scale that rounds otherwise)."""
    q, k, v = inputs(40, 53, 24, dtype)
    uP = U16 if dtype == torch.float16 else 0.0
    for i in range(2):
        both = [
            replay(q, k, v, block_m=BM, block_n=BN, query_block=i, causal=causal, source="triton", kernel=kernel)
            for kernel in ("core", "production")
        ]
        tutorial, production = (r.steps for r in both)
        assert [(s.i, s.j) for s in tutorial] == [(s.i, s.j) for s in production]
        for a, b in zip(tutorial, production, strict=True):
            for name, bound in bounds(a, q, k, v, 24**-0.5, uP, False).items():
                same = a.kernel[name] == b.kernel[name]
                assert bool((same | ((a.kernel[name] - b.kernel[name]).abs() <= 2 * bound + 1e-300)).all()), name


def test_the_trace_build_leaves_the_output_unchanged() -> None:
    from flashattn_teach.triton import triton_attention

    q, k, v = inputs(40, 53, 16, torch.float32)
    r = replay(q, k, v, block_m=BM, block_n=BN, source="triton", kernel="production", query_block=1)
    step = r.steps[-1]
    O = triton_attention(q[None], k[None], v[None])[0]  # the kernel without its trace build
    torch.testing.assert_close(step.kernel["acc_new"] / step.kernel["l_i"][:, None], O[32:40].double())


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"kernel": "cuda"}, r"kernel must be one of \('core', 'production'\)"),
        ({"source": "reference"}, 'source="triton"; pass both'),
        ({"order": "key_major"}, "order"),
        ({"cu_seqlens": torch.tensor([0, 3, 6])}, "cu_seqlens"),
    ],
)
def test_what_the_production_replay_cannot_run_is_refused_by_name(options, named) -> None:
    q, k, v = inputs(6, 6, 16, torch.float32)
    with pytest.raises(AttentionValueError, match=named):
        replay(q, k, v, block_m=16, block_n=16, **{"source": "triton", "kernel": "production", **options})


def test_the_launch_refuses_a_trace_of_what_the_trace_build_does_not_trace() -> None:
    assert traced_tile(TEST_CONFIG, PLAIN, fp8=False) == TEST_CONFIG.forward.by_pointers()
    with pytest.raises(AttentionValueError, match=r"traces plain and causal attention .* asks for FP8"):
        traced_tile(TEST_CONFIG, PLAIN, fp8=True)
    dropped = dataclasses.replace(PLAIN, dropout=DropoutKey(p=0.1))
    with pytest.raises(AttentionValueError, match=r"attn_mask and sinks, on the pointer path; .* asks for dropout:"):
        traced_tile(TEST_CONFIG, dropped, fp8=False)


def test_the_cli_writes_the_page_with_both_columns(tmp_path: Path) -> None:
    out = tmp_path / "production.html"
    argv = ["forward", "--source", "triton", "--kernel", "production", "--causal", "--format", "html"]
    assert main([*argv, "--dtype", "float32", "--seq-len", "40", "--head-dim", "16", "--out", str(out)]) == 0
    page = out.read_text()
    assert "triton/kernels/forward.py (the production kernel)" in page and PRODUCTION_NOTE[:60] in page
    assert page.count('"kernel": {"terms"') + page.count('"kernel":{"terms"') >= 2  # one per case: both columns


def test_the_cli_json_is_schema_valid_and_names_the_production_kernel(capsys) -> None:
    from flashattn_teach.replay.manifest import schema

    argv = ["forward", "--source", "triton", "--kernel", "production", "--window", "8,0", "--seq-len", "40"]
    assert main([*argv, "--head-dim", "16", "--dtype", "float32", "--format", "json", "--extensions"]) == 0
    doc = json.loads(capsys.readouterr().out)
    pytest.importorskip("jsonschema").Draft202012Validator(schema()).validate(doc)
    assert doc["kernel"]["note"] == PRODUCTION_NOTE and (doc["kernel"]["blockM"], doc["kernel"]["blockN"]) == (BM, BN)
    for case in doc["cases"]:
        assert [t["name"] for t in case["kernel"]["terms"]] == list(KERNEL_TERMS)
        assert all(t["maxDiff"] is not None and t["maxDiff"] < 1e-5 for t in case["kernel"]["terms"])  # float32
