"""``replay_backward(..., source="triton")``: every term the production backward kernels traced (attn_bwd_dkdv and
attn_bwd_dq, ``TRACE=True``, in Triton's interpreter) against the reference's, within what their arithmetic allows,
in the one-kernel backward (dQ by atomics) and the two-kernel one, and negative controls (a perturbed record, the
bound without the operand cast).

The bounds are a priori, elementwise, from the inputs in float64 (never from the kernels' output); ``u`` is
float32's unit roundoff 2^-24, ``u_in`` the inputs' (0 in float32, 2^-11 in float16: the kernels get ``O`` rounded
to it and cast ``P`` and ``dS`` to it before their MMAs); ``A = scale |Q| |K|^T``, ``S, lse, P`` the float64
reference's. Both sides compute in float32, so each rounding counts twice:

    P_ij    e_P  = P (2 (D + 4) u A + 4 u (|S| + |lse| + 2) + (N_k + 4) u)   a dot, exp2 of a difference, lse's sum
    dP_ij   e_dP = 2 (D_v + 2) u |dO| |V|^T                                   a length-D_v dot
    dS_ij   e_dS = e_P |dP - delta| + P (e_dP + e_delta) + (8 u + u_in) |dS|  with e_delta = (2 (D_v + 2) u + u_in)
                                                                              rowsum(|dO| |O|) (O rounded to u_in)
    dV_j    sum over the rows so far of (e_P + (u_in + 2 (R + 2) u) P)^T |dO|     R rows accumulated
    dK_j    scale sum over the rows so far of (e_dS + 2 (R + 2) u |dS|)^T |Q|
    dQ_i    scale sum over the columns so far of (e_dS + 2 (C + 2) u |dS|) |K|   C columns accumulated
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("triton")

import torch

from flashattn_teach.errors import AttentionValueError
from flashattn_teach.replay.backward_replay import replay_backward
from flashattn_teach.replay.kernel_trace_backward import TERMS
from flashattn_teach.replay.manifest import schema
from flashattn_teach.replay.step import StepKind

U32, U16 = 2.0**-24, 2.0**-11
# (N_q, N_k, D): a short last block both ways, N_q != N_k, D = 24 (lanes masked); tiles 32 x 16
SHAPES = [(40, 37, 16), (20, 45, 24)]


def inputs(N_q: int, N_k: int, D: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(N_q * 100 + N_k + D)
    return tuple(torch.randn(n, D, generator=g).to(dtype) for n in (N_q, N_k, N_k))


def dense(br, causal: bool) -> dict[str, torch.Tensor]:
    """The float64 reference's matrices of the whole head, from the replay's inputs (the kernels' values)."""
    q, k, v, dO = (t.double() for t in (br.q, br.k, br.v, br.dO))
    N_q, N_k = q.shape[0], k.shape[0]
    S = (q @ k.T) * br.scale  # (N_q, D) @ (D, N_k) -> (N_q, N_k)
    if causal:
        S = S.masked_fill(torch.ones(N_q, N_k, dtype=torch.bool).triu(1), -math.inf)
    lse = S.logsumexp(-1)
    P = torch.exp(S - lse[:, None])
    O = P @ v  # (N_q, D_v)
    dP = dO @ v.T  # (N_q, N_k)
    delta = (dO * O).sum(-1)
    return {"S": S.nan_to_num(neginf=0.0), "lse": lse, "P": P, "dP": dP, "dS": P * (dP - delta[:, None]), "O": O}


def error_bounds(br, causal: bool, u_in: float) -> dict[str, torch.Tensor]:
    """``e_P, e_dP, e_dS`` of the whole head (module docstring), float64 ``(N_q, N_k)``."""
    m = dense(br, causal)
    q, k, v, dO = (t.double() for t in (br.q, br.k, br.v, br.dO))
    D, D_v, N_k = q.shape[1], v.shape[1], k.shape[0]
    A = br.scale * (q.abs() @ k.abs().T)
    e_P = m["P"] * (2 * (D + 4) * U32 * A + 4 * U32 * (m["S"].abs() + m["lse"].abs()[:, None] + 2) + (N_k + 4) * U32)
    e_dP = 2 * (D_v + 2) * U32 * (dO.abs() @ v.abs().T)
    e_delta = (2 * (D_v + 2) * U32 + u_in) * (dO.abs() * m["O"].abs()).sum(-1)
    delta = (dO * m["O"]).sum(-1)
    e_dS = (
        e_P * (m["dP"] - delta[:, None]).abs() + m["P"] * (e_dP + e_delta[:, None]) + (8 * U32 + u_in) * m["dS"].abs()
    )
    return {"P": m["P"], "dS": m["dS"], "e_P": e_P, "e_dP": e_dP, "e_dS": e_dS}


def step_bounds(step, br, e: dict[str, torch.Tensor], u_in: float) -> dict[str, torch.Tensor]:
    """Each traced term's bound at ``step`` (the accumulators over the rows or columns accumulated so far)."""
    (r0, r1), (c0, c1) = step.rows, step.cols
    q, k, dO = (t.double() for t in (br.q, br.k, br.dO))
    out = {"P_ij": e["e_P"][r0:r1, c0:c1], "dP_ij": e["e_dP"][r0:r1, c0:c1], "dS_ij": e["e_dS"][r0:r1, c0:c1]}
    if step.step_kind is StepKind.DKDV:
        R = r1  # rows [0, r1): the blocks this key block saw so far (the others have P = dS = 0)
        gP = e["e_P"][:r1, c0:c1] + (u_in + 2 * (R + 2) * U32) * e["P"][:r1, c0:c1]  # (R, Bc)
        gS = e["e_dS"][:r1, c0:c1] + 2 * (R + 2) * U32 * e["dS"][:r1, c0:c1].abs()
        out["dV_j"] = gP.T @ dO[:r1].abs()  # (Bc, R) @ (R, D_v) -> (Bc, D_v)
        out["dK_j"] = br.scale * gS.T @ q[:r1].abs()  # (Bc, R) @ (R, D) -> (Bc, D)
    else:
        C = c1
        gS = e["e_dS"][r0:r1, :c1] + 2 * (C + 2) * U32 * e["dS"][r0:r1, :c1].abs()  # (Br, C)
        out["dQ_i"] = br.scale * gS @ k[:c1].abs()  # (Br, C) @ (C, D) -> (Br, D)
    return out


def over_bound(br, causal: bool, u_in: float) -> dict[tuple[str, int], list[str]]:
    """Per step (kind, index), the terms whose kernel value is further from the reference's than the bound allows."""
    e = error_bounds(br, causal, u_in)
    bad = {}
    for step in [*br.dkdv_steps(), *br.dq_steps()]:
        assert tuple(step.kernel) == TERMS[step.step_kind]
        names = []
        for name, bound in step_bounds(step, br, e, u_in).items():
            mine, ref = step.kernel[name], step[name].double()
            if not bool(((mine - ref).abs() <= bound + 1e-30).all()):
                names.append(name)
        if names:
            bad[(step.step_kind.value, step.index)] = names
    return bad


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dQ", "dQ-kernel"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("N_q", "N_k", "D"), SHAPES)
def test_every_traced_backward_term_matches_the_reference_in_float32(N_q, N_k, D, causal, deterministic) -> None:
    q, k, v = inputs(N_q, N_k, D, torch.float32)
    br = replay_backward(q, k, v, block_m=32, block_n=16, causal=causal, source="triton", deterministic=deterministic)
    # the launcher runs one kernel unless asked not to or N_q is below its BLOCK_M (configs.fused_backward)
    fused = not deterministic and N_q >= 32
    assert br.source == "triton" and br.kernel is not None and br.kernel.fused is fused
    assert over_bound(br, causal, 0.0) == {}
    # with atomics every visited tile's partial arrived once: its orders are 0, 1, ..., n - 1
    orders = sorted(n for _, _, n in br.kernel.arrivals())
    assert orders == (list(range(len(list(br.dq_steps())))) if fused else [])


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dQ", "dQ-kernel"])
@pytest.mark.parametrize("causal", [False, True])
def test_float16_inputs_differ_by_the_operand_casts(causal, deterministic) -> None:
    q, k, v = inputs(40, 37, 16, torch.float16)
    br = replay_backward(q, k, v, block_m=32, block_n=16, causal=causal, source="triton", deterministic=deterministic)
    assert over_bound(br, causal, U16) == {}
    # without float16's rounding in the bound the casts show: in dS (the operand traced) and what it feeds
    flagged = {name for names in over_bound(br, causal, 0.0).values() for name in names}
    assert "dS_ij" in flagged and flagged <= {"dS_ij", "dV_j", "dK_j", "dQ_i"}


def test_a_perturbed_record_fails_the_comparison_in_its_term_alone() -> None:
    q, k, v = inputs(40, 37, 16, torch.float32)
    br = replay_backward(q, k, v, block_m=32, block_n=16, source="triton")
    assert br.kernel is not None and over_bound(br, False, 0.0) == {}
    BM = br.kernel.trace.block_m
    br.kernel.trace.dkdv()[1, 0, :, BM : 2 * BM] *= 1 + 1e-4  # dP^T of tile (i, j) = (0, 1)
    bad = over_bound(br, False, 0.0)
    assert bad and all(names == ["dP_ij"] for names in bad.values()), bad
    tiles = {(s.step_kind, s.i, s.j) for s in [*br.dkdv_steps(), *br.dq_steps()] if (s.step_kind.value, s.index) in bad}
    assert tiles == {(StepKind.DKDV, 0, 1), (StepKind.DQ, 0, 1)}  # the atomic path's dQ step reads the same record


def test_the_atomic_dq_is_the_partials_summed_in_their_arrival_order() -> None:
    q, k, v = inputs(40, 37, 16, torch.float32)
    br = replay_backward(q, k, v, block_m=32, block_n=16, source="triton")
    kt = br.kernel
    assert kt is not None
    for i in range(kt.trace.T_r):
        arrived = [j for a, j, _ in kt.arrivals() if a == i]
        assert arrived == sorted(arrived)  # the interpreter runs the programs one by one, j increasing
        parts = [kt.trace.partials()[j, i, :, :16].double() for j in arrived]
        last = [s for s in br.dq_steps() if s.i == i][-1]
        torch.testing.assert_close(last.kernel["dQ_i"], sum(parts)[: last.rows[1] - last.rows[0]], rtol=1e-6, atol=1e-7)


def test_the_replay_takes_the_kernels_tiles_and_says_so() -> None:
    q, k, v = inputs(6, 6, 4, torch.float64)  # the teaching example's sizes, float64
    br = replay_backward(q, k, v, block_m=2, block_n=2, causal=True, source="triton")
    assert (br.block_m, br.block_n) == (16, 16)
    assert "16 x 16" in br.note and "2 x 2" in br.note and "float32" in br.note
    assert over_bound(br, True, U32) == {}  # the inputs' rounding to float32, one u32 more
    plain = next(iter(replay_backward(q, k, v, block_m=2, block_n=2).dkdv_steps()))
    assert plain.kernel == {} and plain.kernel_diff == {}


@pytest.mark.parametrize(
    ("options", "named"),
    [({"window": (2, 0)}, "window"), ({"sinks": 0.5}, "sinks"), ({"source": "cuda"}, "source must be one of")],
)
def test_what_the_trace_build_does_not_trace_is_refused_by_name(options, named) -> None:
    q, k, v = inputs(6, 6, 16, torch.float32)
    with pytest.raises(AttentionValueError, match=named):
        replay_backward(q, k, v, block_m=16, block_n=16, **{"source": "triton", **options})


def test_bfloat16_is_refused_in_the_interpreter() -> None:
    q, k, v = inputs(6, 6, 16, torch.bfloat16)
    with pytest.raises(AttentionValueError, match="interpreter multiplies bfloat16"):
        replay_backward(q, k, v, block_m=16, block_n=16, source="triton")


def test_the_launcher_refuses_a_traced_call_it_does_not_trace() -> None:
    from flashattn_teach._validate.inputs import AttentionShapes
    from flashattn_teach.triton import launch
    from flashattn_teach.triton.configs import AttentionConfig
    from flashattn_teach.triton.trace_backward import BackwardTrace

    s = AttentionShapes(batch=(1,), H_q=2, H_kv=1, N_q=16, N_k=16, D=16, D_v=16, rank=4, scale=0.25)
    q, o, do = (torch.zeros(1, 2, 16, 16) for _ in range(3))
    k, v = torch.zeros(1, 1, 16, 16), torch.zeros(1, 1, 16, 16)
    trace = BackwardTrace.allocate(s, 16, 16)
    with pytest.raises(AttentionValueError, match="grouped-query attention"):
        launch.backward(q, k, v, o, torch.zeros(1, 2, 16), do, None, s, causal=False, causal_align="top_left",
                        config=AttentionConfig.uniform(16, 16), trace=trace)  # fmt: skip
    s1 = AttentionShapes(batch=(1,), H_q=1, H_kv=1, N_q=16, N_k=16, D=16, D_v=16, rank=4, scale=0.25)
    one = torch.zeros(1, 1, 16, 16)
    with pytest.raises(AttentionValueError, match="launches 32 x 16"):
        launch.backward(one, one, one, one, torch.zeros(1, 1, 16), one, None, s1, causal=False,
                        causal_align="top_left", config=AttentionConfig.uniform(32, 16),
                        trace=BackwardTrace.allocate(s1, 16, 16))  # fmt: skip


def test_the_command_line_writes_the_kernels_column(tmp_path) -> None:
    from flashattn_teach.cli import main

    out = tmp_path / "bwd.json"
    argv = ["replay", "backward", "--seq-len", "20", "--head-dim", "16", "--block-m", "16", "--block-n", "16"]
    assert main([*argv, "--source", "triton", "--format", "json", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(schema()).validate(doc)  # replay.schema.json, with the kernels' keys
    assert "note" in doc["kernel"] and doc["kernel"]["dqOrder"] and doc["kernel"]["dqOrderMoves"] is not None
    traced = [s for s in doc["steps"] if s["stepKind"] != "preprocess"]
    assert traced and all({t["name"] for t in s["kernel"]["terms"]} >= {"P_ij", "dS_ij"} for s in traced)
    table = tmp_path / "bwd.txt"
    assert main([*argv, "--source", "triton", "--format", "table", "--out", str(table)]) == 0
    text = table.read_text()
    assert "beside the reference" in text and "dK_j" in text and "max |difference|" in text


def test_the_png_lines_and_the_json_say_where_each_dq_partial_arrived() -> None:
    from flashattn_teach.replay.kernel_view_backward import kernel_case, kernel_lines

    q, k, v = inputs(40, 37, 16, torch.float32)
    br = replay_backward(q, k, v, block_m=32, block_n=16, source="triton")
    assert br.kernel is not None
    for step in br.dq_steps():
        place = br.kernel.order(step.i, step.j)
        assert place is not None and kernel_case(br, step)["order"] == place
        assert f"place {place} of the atomic adds" in kernel_lines(br, step)[1]
        assert [line.split()[0] for line in kernel_lines(br, step)[2:]] == list(TERMS[StepKind.DQ])
    step = next(iter(br.dkdv_steps()))
    assert "order" not in kernel_case(br, step) and "atomic" not in kernel_lines(br, step)[1]
    plain = next(iter(replay_backward(q, k, v, block_m=32, block_n=16).dq_steps()))
    assert kernel_lines(br, plain) == []


def test_the_atomics_order_moves_dq_by_rounding_alone() -> None:
    q, k, v = inputs(40, 64, 16, torch.float32)  # four key blocks: four partials per query row
    br = replay_backward(q, k, v, block_m=32, block_n=16, source="triton")
    kt = br.kernel
    assert kt is not None
    moved = kt.order_moves_dq()
    assert moved is not None and moved > 0  # another order, other last bits
    # and no more than the rounding of a 4-term float32 sum: 2 * 3 u sum |partials|, over every row and lane
    for i in range(kt.trace.T_r):
        total = sum(kt.trace.partials()[j, i, :, :16].double().abs() for j in range(kt.trace.T_c))
        js = [j for a, j, _ in kt.arrivals() if a == i]
        diff = (kt.dq_summed(i, js) - kt.dq_summed(i, js[::-1])).double().abs()
        assert bool((diff <= 6 * U32 * total).all())
    two_kernel = replay_backward(q, k, v, block_m=32, block_n=16, source="triton", deterministic=True)
    assert two_kernel.kernel is not None and two_kernel.kernel.order_moves_dq() is None
