"""The equations with their numbers (trace/equations.py): every number is the replay's own and agrees with an
independent recomputation here; update() is bit-identical to what it was before update_terms existed."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from teaching import teaching_inputs

from flashattn_teach.core.online_softmax import update, update_terms
from flashattn_teach.replay import replay
from flashattn_teach.replay.equations import LINES, NO_KEY, Equation, Term, fmt, step_equations
from flashattn_teach.replay.manifest import schema, to_experiment, to_json
from flashattn_teach.replay.table import render_table

NEG_INF = float("-inf")


def update_before(m_i, l_i, acc, S_ij, v_j, drop=None):
    """online_softmax.update as it was before update_terms (commit c00660f), kept verbatim as the oracle."""
    m_new = torch.maximum(m_i, S_ij.amax(dim=-1))
    m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
    alpha = torch.exp(m_i - m_safe)
    P_ij = (S_ij - m_safe.unsqueeze(-1)).exp_()
    l_new = alpha * l_i + P_ij.sum(dim=-1)
    if drop is not None:
        P_ij = drop(P_ij)
    acc = torch.matmul(P_ij, v_j).add_(acc * alpha.unsqueeze(-1))
    return m_new, l_new, acc


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dropout", [False, True])
def test_update_is_bit_identical_to_the_update_before_update_terms(dtype, dropout):
    g = torch.Generator().manual_seed(7)
    B, Br, Bc, D_v = 3, 5, 4, 6
    keep = torch.rand(B, Br, Bc, generator=g) > 0.3
    drop = (lambda X: torch.where(keep, X * (1 / 0.7), 0.0)) if dropout else None
    m_i = torch.randn(B, Br, generator=g, dtype=dtype)
    m_i[0, :2] = NEG_INF  # rows that have seen no key yet
    l_i = torch.rand(B, Br, generator=g, dtype=dtype) * 3
    l_i[0, :2] = 0
    acc = torch.randn(B, Br, D_v, generator=g, dtype=dtype)
    acc[0, :2] = 0
    v_j = torch.randn(B, Bc, D_v, generator=g, dtype=dtype)
    for masked in (False, True):
        S_ij = torch.randn(B, Br, Bc, generator=g, dtype=dtype) * 4
        if masked:
            S_ij[0, 0] = NEG_INF  # a row that sees no key, still none after this tile: -inf - -inf guarded
            S_ij[1, :, 1:] = NEG_INF
        inputs = (m_i.clone(), l_i.clone(), acc.clone(), S_ij.clone(), v_j)
        got, want = update(*inputs, drop), update_before(*inputs, drop)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(inputs[:4], (m_i, l_i, acc, S_ij), strict=True))  # untouched
        t = update_terms(*inputs, drop)
        assert torch.equal(t.alpha[0, 0], torch.zeros((), dtype=dtype))  # exp(-inf - 0), not NaN
        assert not any(x.isnan().any() for x in (t.alpha, t.P_ij, t.l_new, t.acc_new))
    # Negative control: the probe sees a one-ulp change of the result.
    changed = (got[0], got[1], torch.nextafter(got[2], torch.full_like(got[2], math.inf)))
    assert not all(torch.equal(a, b) for a, b in zip(changed, want, strict=True))


def by_term(eqs: tuple[Equation, ...]) -> dict[Term, Equation]:
    return {e.term: e for e in eqs}


def close(a, b, tol=1e-12) -> bool:
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    same_inf = torch.isneginf(a) == torch.isneginf(b)
    return bool(same_inf.all() and torch.allclose(a[~torch.isneginf(a)], b[~torch.isneginf(b)], rtol=tol, atol=tol))


def check_block(r, scores, v, sink=None):
    """Walk the block's updates with an independent state (from the dense scores ``(Br, N_k)`` of the block)."""
    r0, r1 = r.rows
    Br = r1 - r0
    m = torch.full((Br,), sink if sink is not None else NEG_INF, dtype=torch.float64)
    l = torch.full((Br,), 1.0 if sink is not None else 0.0, dtype=torch.float64)
    acc = torch.zeros(Br, v.shape[-1], dtype=torch.float64)
    experiment = to_experiment(r, extensions=True)
    steps = list(r.steps)
    for step, case in zip(steps, experiment["cases"], strict=True):
        c0, c1 = step.cols
        for row, eqs in enumerate(step_equations(step)):
            e = by_term(eqs)
            S = scores[row, c0:c1]
            m_new = max(float(m[row]), float(S.max()))
            shift = 0.0 if m_new == NEG_INF else m_new
            alpha = math.exp(float(m[row]) - shift)  # from the previous step's m, recomputed here
            P = torch.exp(S - shift)
            l_new = alpha * float(l[row]) + float(P.sum())
            acc_new = alpha * acc[row] + P @ v[c0:c1]
            assert close(e[Term.S_IJ].value, S)
            assert close(e[Term.M_NEW].value, m_new) and close(e[Term.M_NEW].parts[1], m[row])
            assert close(e[Term.ALPHA].value, alpha) and close(e[Term.ALPHA].parts[1], m[row])
            assert close(e[Term.P_IJ].value, P)
            assert close(e[Term.L_NEW].value, l_new) and close(e[Term.L_NEW].parts[2], l[row])
            assert close(e[Term.ACC].value, acc_new) and close(e[Term.ACC].parts[2], acc[row])
            assert close(e[Term.ROWSUM].value, P.sum()) and close(e[Term.PV].value, P @ v[c0:c1])
            # The replay's own data: S_ij, m_i, l_i, and O_partial = acc / l.
            assert close(e[Term.S_IJ].value, step["S_ij"][row]) and close(e[Term.M_NEW].value, step["m_i"][row])
            assert close(e[Term.L_NEW].value, step["l_i"][row])
            if l_new > 0:
                assert close(torch.tensor(e[Term.ACC].value, dtype=torch.float64) / l_new, step["O_partial"][row])
            assert (e[Term.ALPHA].note == NO_KEY) == (m_new == NEG_INF)
            assert (Term.M_START in e) == (step.index == 0) and (Term.O_I in e) == step.last
            for eq in eqs:
                assert eq.line == LINES[eq.term] and eq.substituted.endswith(
                    "[" + ", ".join(map(fmt, eq.value)) + "]" if isinstance(eq.value, tuple) else fmt(eq.value)
                )
            if step.index == 0:
                assert close(e[Term.M_START].value, m[row]) and close(e[Term.L_START].value, l[row])
            # The JSON: the same numbers, -inf as null, next to the case's own vectors.
            js = case["equations"]["rows"][row]
            assert [x["name"] for x in js] == [eq.term.value for eq in eqs]
            assert [x["substituted"] for x in js] == [eq.substituted for eq in eqs]
            by_name = {x["name"]: x for x in js}
            assert by_name["m_new"]["value"] == case["vectors"][1]["values"][row]
            assert by_name["l_new"]["value"] == case["vectors"][2]["values"][row]
            assert by_name["alpha"]["value"] == e[Term.ALPHA].value
            m[row], l[row], acc[row] = m_new, l_new, acc_new
            if step.last:
                lse = torch.logsumexp(torch.cat([scores[row], torch.tensor([sink or NEG_INF])]), dim=0)
                O_i = acc[row] / l[row] if l[row] > 0 else torch.zeros_like(acc[row])
                assert close(e[Term.LSE].value, lse) and close(e[Term.O_I].value, O_i)
                assert close(e[Term.O_I].value, step["O_final"][row])
        assert case["equations"]["rowStart"] == r0
    return experiment


def dense_scores(q, k, rows, mask=None):
    S = (q[0, rows[0] : rows[1]] @ k[0].T) / 2.0  # scale 1 / sqrt(4); (Br, 4) @ (4, N_k) -> (Br, N_k)
    return S if mask is None else S.masked_fill(~mask[rows[0] : rows[1]], NEG_INF)


def validate(experiment):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(schema())
    jsonschema.Draft202012Validator(schema()).validate(experiment)


@pytest.mark.parametrize("query_block", [0, 1, 2])
@pytest.mark.parametrize("order", ["query_major", "key_major"])
def test_teaching_example_equations_carry_the_replay_numbers(query_block, order):
    q, k, v = teaching_inputs()
    r = replay(q, k, v, block_m=2, block_n=2, query_block=query_block, order=order)
    validate(check_block(r, dense_scores(q, k, r.rows), v[0]))


def test_first_update_of_the_teaching_example_reads_as_expected():
    q, k, v = teaching_inputs()
    e = by_term(step_equations(replay(q, k, v, block_m=2, block_n=2).steps[0])[0])
    assert e[Term.M_START].substituted == "m_i = −∞" and e[Term.L_START].substituted == "l_i = 0"
    assert e[Term.ALPHA].substituted == "exp(−∞ − (-1.03)) = 0"
    assert e[Term.L_NEW].substituted == "0 · 0 + 1.981 = 1.981"


def test_a_row_that_sees_no_key_in_the_first_tile():
    q, k, v = teaching_inputs()
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[0, :2] = False  # row 0 sees keys 2-5 only: the first tile is PARTIAL, row 0 sees nothing in it
    r = replay(q, k, v, block_m=2, block_n=2, attn_mask=mask)
    experiment = check_block(r, dense_scores(q, k, r.rows, mask), v[0])
    first, second = (by_term(step_equations(s)[0]) for s in list(r.steps)[:2])
    assert first[Term.M_NEW].value == NEG_INF and first[Term.ALPHA].value == 0.0
    assert first[Term.ALPHA].substituted == "exp(−∞ − 0) = 0" and first[Term.P_IJ].value == (0.0, 0.0)
    assert first[Term.L_NEW].value == 0.0 and first[Term.P_IJ].note == NO_KEY
    assert (
        second[Term.ALPHA].parts[1] == NEG_INF and second[Term.ALPHA].value == 0.0 and second[Term.ALPHA].note is None
    )
    js = experiment["cases"][0]["equations"]["rows"][0]
    assert {x["name"]: x["value"] for x in js}["m_new"] is None  # -inf in JSON
    assert "−∞ − 0" in {x["name"]: x["substituted"] for x in js}["alpha"]
    validate(experiment)
    json.loads(to_json(r, extensions=True))  # strict JSON: no Infinity, no NaN


def test_rows_that_never_see_a_key_end_with_zero_output_and_minus_infinite_lse():
    q, k, v = teaching_inputs(N_q=6, N_k=4)
    # bottom_right with N_q = 6 > N_k = 4: row r sees keys <= r - 2, so rows 0 and 1 see none.
    r = replay(q, k, v, block_m=3, block_n=2, causal=True, causal_align="bottom_right")
    mask = torch.ones(6, 4, dtype=torch.bool).tril(diagonal=-2)
    experiment = check_block(r, dense_scores(q, k, r.rows, mask), v[0])
    last = by_term(step_equations(list(r.steps)[-1])[0])
    assert last[Term.LSE].value == NEG_INF and last[Term.O_I].value == (0.0,) * 4
    assert last[Term.LSE].note is not None and "no key" in last[Term.LSE].note
    validate(experiment)


def test_with_a_sink_the_state_starts_at_the_sink():
    q, k, v = teaching_inputs()
    r = replay(q, k, v, block_m=3, block_n=2, query_block=1, causal=True, sinks=0.5)
    experiment = check_block(r, dense_scores(q, k, r.rows, torch.ones(6, 6, dtype=torch.bool).tril()), v[0], 0.5)
    e = by_term(step_equations(r.steps[0])[0])
    assert e[Term.M_START].value == 0.5 and e[Term.L_START].value == 1.0
    assert e[Term.M_START].symbolic == "m_i = sink_h"
    validate(experiment)


def test_without_extensions_the_seed_format_has_no_equations():
    q, k, v = teaching_inputs()
    assert all("equations" not in case for case in to_experiment(replay(q, k, v, block_m=2, block_n=2))["cases"])


def test_table_shows_every_update_s_equations_with_numbers():
    q, k, v = teaching_inputs()
    r = replay(q, k, v, block_m=2, block_n=2)
    out = io.StringIO()
    render_table(r, out, width=200)
    text = out.getvalue()
    for step in r.steps:
        rows = step_equations(step)
        assert by_term(rows[0])[Term.ALPHA].substituted in text  # row 0 in full
        assert by_term(rows[1])[Term.L_NEW].substituted in text  # the other row, compact
    assert "lse_i = m_i + log(l_i)" in text


def test_png_draws_the_equations_of_the_shown_update(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from flashattn_teach.replay.png import render_png

    q, k, v = teaching_inputs()
    r = replay(q, k, v, block_m=2, block_n=2)
    drawn: list[str] = []
    text = Axes.text
    monkeypatch.setattr(Axes, "text", lambda self, x, y, s, *a, **kw: drawn.append(s) or text(self, x, y, s, *a, **kw))
    render_png(r, tmp_path / "step2.png", step=2)
    assert (tmp_path / "step2.png").stat().st_size > 0
    e = by_term(step_equations(r.steps[1])[0])
    assert any(e[Term.ALPHA].substituted in s for s in drawn)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({}, ()),
        ({"softcap": 1.5}, ("tanh", "softcap = 1.5")),
        ({"alibi_slopes": 0.5}, ("+ bias_ij",)),
        ({"attn_mask": torch.randn(6, 6, generator=torch.Generator().manual_seed(3))}, ("+ bias_ij",)),
        ({"softcap": 2.0, "alibi_slopes": 0.25, "causal": True}, ("tanh", "+ bias_ij")),
    ],
    ids=["plain", "softcap", "alibi", "additive-mask", "all"],
)
def test_the_score_equation_gives_the_numbers_it_shows(options, words):
    # Line 8 used to read "S_ij = scale · Q_i K_j^T" whatever the call: under softcap or a bias the numbers it
    # showed were not scale Q_i K_j^T. The formula now names what S_ij holds, and gives it (float64 oracle).
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(6, 4, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    r = replay(q, k, v, block_m=2, block_n=2, query_block=1, **options)
    rows, cols = torch.arange(6)[:, None], torch.arange(6)[None, :]
    S = (q * r.scale) @ k.T  # (N, D) @ (D, N) -> (N, N)
    if "softcap" in options:
        S = options["softcap"] * torch.tanh(S / options["softcap"])
    if "alibi_slopes" in options:
        S = S - options["alibi_slopes"] * (rows - cols).abs()  # ALiBi, top_left: -slope |i - j|
    if "attn_mask" in options:
        S = S + options["attn_mask"]
    S = S.masked_fill(r.visible().logical_not(), NEG_INF)
    for step in r.steps:
        r0, (c0, c1) = step.rows[0], step.cols
        for row, eqs in enumerate(step_equations(step)):
            eq = next(e for e in eqs if e.term is Term.S_IJ)
            assert all(w in eq.symbolic for w in words), eq.symbolic
            assert ("tanh" in eq.symbolic) == ("softcap" in options)
            assert ("bias_ij" in eq.symbolic) == bool({"alibi_slopes", "attn_mask"} & set(options))
            torch.testing.assert_close(
                torch.tensor(eq.value, dtype=torch.float64), S[r0 + row, c0:c1], atol=1e-13, rtol=0
            )


def test_a_negative_zero_is_written_as_zero():
    assert fmt(-0.0) == "0" and fmt(0.0) == "0" and fmt(-1e-300) == "-1e-300"
