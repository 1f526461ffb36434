"""Key-major order's equations (FlashAttention, Dao et al. 2022, Algorithm 1 lines 2, 8-13) with their numbers.

Every number is checked against an independent float64 walk of FA1 Alg. 1 written here, which keeps O_i, l_i, m_i
in a pretend HBM between tiles and uses FA1's own form (m~_ij, P~_ij = exp(S_ij - m~_ij), l~_ij, two rescale
factors, O_i normalised at every step), and against the replay's own Step (m_i, l_i, O_partial), which the
replay computes in FA2's form through online_softmax.update_terms: the two forms agree to 1e-12.
"""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from teaching import teaching_inputs

from flashattn_teach.replay import replay
from flashattn_teach.replay.equations import NO_KEY, SOURCE, Equation, Term, fmt, step_equations
from flashattn_teach.replay.equations_key_major import (
    KEY_MAJOR_SOURCE,
    KeyMajorTerm,
)
from flashattn_teach.replay.equations_view import build_view
from flashattn_teach.replay.html import render_html

from page_numbers import part_numbers

NEG_INF = -math.inf
K = KeyMajorTerm
# FA1 Alg. 1's line of each equation, written out again here (the module's table is what is under test).
FA1_LINE = {"init m_i": 2, "init l_i": 2, "init O_i": 2, "load m_i": 8, "load l_i": 8, "load O_i": 8, "S_ij": 9}
FA1_LINE |= {"m~_ij": 10, "P~_ij": 10, "l~_ij": 10, "m_new": 11, "exp(m_i - m_new)": 11, "exp(m~_ij - m_new)": 11}
FA1_LINE |= {"l_new": 11, "P~_ij V_j": 12, "write O_i": 12, "write l_i": 13, "write m_i": 13}
ORDER = [K.M_LOAD, K.L_LOAD, K.O_LOAD, K.S_IJ, K.M_TILE, K.P_TILE, K.L_TILE, K.M_NEW, K.SCALE_OLD, K.SCALE_TILE]
ORDER += [K.L_NEW, K.PV, K.O_WRITE, K.L_WRITE, K.M_WRITE]


def close(a, b, tol=1e-12) -> bool:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    same_inf = torch.equal(torch.isneginf(a), torch.isneginf(b))
    return same_inf and torch.allclose(a[~torch.isneginf(a)], b[~torch.isneginf(b)], rtol=tol, atol=tol)


def exp_minus(x, m):
    """exp(x - m) with a -inf maximum taken as 0 (the code's m_safe): never -inf - (-inf)."""
    return torch.exp(torch.as_tensor(x, dtype=torch.float64) - (0.0 if m == NEG_INF else m))


def by_term(eqs: tuple[Equation, ...]) -> dict:
    return {e.term: e for e in eqs}


def check_key_major(r, q, k, v, mask=None, sink=None) -> int:
    """Walk FA1 Alg. 1 for the replayed block with a pretend HBM; return the number of (step, row) checked."""
    r0, r1 = r.rows
    S_all = (q[0, r0:r1] @ k[0].T) / 2.0  # scale 1 / sqrt(4); (Br, 4) @ (4, N_k) -> (Br, N_k)
    if mask is not None:
        S_all = S_all.masked_fill(~mask[r0:r1], NEG_INF)
    # FA1 Alg. 1 line 2 (with a sink: the sink's score, value 0, as one key already seen).
    hbm_m = torch.full((r1 - r0,), NEG_INF if sink is None else sink, dtype=torch.float64)
    hbm_l = torch.full((r1 - r0,), 0.0 if sink is None else 1.0, dtype=torch.float64)
    hbm_O = torch.zeros(r1 - r0, 4, dtype=torch.float64)
    payload = build_view(r, {})
    assert payload is not None and payload["source"] == KEY_MAJOR_SOURCE and len(payload["steps"]) == len(r.steps)
    checked = 0
    for step, js in zip(r.steps, payload["steps"], strict=True):
        c0, c1 = step.cols
        rows = tuple(step.equations)
        assert js == {"rowStart": r0, "rows": [[e.to_json() for e in row] for row in rows]}
        for row, eqs in enumerate(rows):
            e = by_term(eqs)
            want = ([K.M_INIT, K.L_INIT, K.O_INIT] if step.index == 0 else []) + ORDER
            assert [x.term for x in eqs] == want
            assert all(x.line == FA1_LINE[x.term.value] for x in eqs)
            for x in eqs:  # the substituted text ends with the value, at 4 significant digits
                end = "[" + ", ".join(map(fmt, x.value)) + "]" if isinstance(x.value, tuple) else fmt(x.value)
                assert x.substituted.endswith(end), (x.term, x.substituted)
            m, l, O = float(hbm_m[row]), float(hbm_l[row]), hbm_O[row]  # line 8: load from HBM
            S = S_all[row, c0:c1]  # line 9
            m_tile = float(S.max())  # line 10
            P_tile = exp_minus(S, m_tile)
            l_tile = float(P_tile.sum())
            m_new = max(m, m_tile)  # line 11
            scale_old, scale_tile = float(exp_minus(m, m_new)), float(exp_minus(m_tile, m_new))
            l_new = scale_old * l + scale_tile * l_tile
            PV = P_tile @ v[0, c0:c1]  # (Bc,) @ (Bc, 4) -> (4,)
            inner = l * scale_old * O + scale_tile * PV  # line 12
            O_new = inner / l_new if l_new > 0 else torch.zeros(4, dtype=torch.float64)
            if step.index == 0:
                assert close(e[K.M_INIT].value, m) and close(e[K.L_INIT].value, l) and close(e[K.O_INIT].value, O)
            expected = {K.M_LOAD: m, K.L_LOAD: l, K.O_LOAD: O, K.S_IJ: S, K.M_TILE: m_tile, K.P_TILE: P_tile}
            expected |= {K.L_TILE: l_tile, K.M_NEW: m_new, K.SCALE_OLD: scale_old, K.SCALE_TILE: scale_tile}
            expected |= {K.L_NEW: l_new, K.PV: PV, K.O_WRITE: O_new, K.L_WRITE: l_new, K.M_WRITE: m_new}
            for term, x in expected.items():
                assert close(e[term].value, x), (step.index, row, term, e[term].value, x)
            # The same m, l, O as the replay's Step (which computed FA2's form).
            assert (
                close(m_new, step["m_i"][row])
                and close(l_new, step["l_i"][row])
                and close(O_new, step["O_partial"][row])
            )
            # Line 12's numbers in the order of its text: l_i, exp(m_i - m_new), O_i, exp(m~_ij - m_new), P~ V, l_new.
            parts = [p for p in e[K.O_WRITE].parts if not isinstance(p, str)]
            assert close(parts[0], l) and close(parts[1], scale_old) and close(parts[2], O)
            assert close(parts[3], scale_tile) and close(parts[4], PV)
            assert (e[K.SCALE_OLD].note == NO_KEY) == (m_new == NEG_INF) == (e[K.SCALE_TILE].note == NO_KEY)
            assert (e[K.P_TILE].note is not None) == (m_tile == NEG_INF)
            assert (e[K.O_WRITE].note is not None) == (l_new == 0)
            hbm_m[row], hbm_l[row], hbm_O[row] = m_new, l_new, O_new  # line 13 (and 12): write to HBM
            checked += 1
    return checked


@pytest.mark.parametrize("query_block", [0, 1, 2])
def test_teaching_example_key_major_equations_follow_fa1_with_the_replay_numbers(query_block):
    q, k, v = teaching_inputs()
    r = replay(q, k, v, block_m=2, block_n=2, query_block=query_block, order="key_major")
    assert check_key_major(r, q, k, v) == 3 * 2
    # The last update writes the output: dense attention's, to 1e-12.
    last = tuple(r.steps[-1].equations)
    for row, eqs in enumerate(last):
        assert close(by_term(eqs)[K.O_WRITE].value, r.steps[-1]["O_final"][row])


def test_fa1_and_fa2_forms_differ_in_their_terms_so_the_walk_can_tell_them_apart():
    """Negative control: FA1's P~_ij = exp(S_ij - m~_ij) is not the replay's P_ij = exp(S_ij - m_new) once an
    earlier tile held the maximum, so a panel showing FA2's terms would fail the walk above."""
    q, k, v = teaching_inputs()
    r = replay(q, k, v, block_m=2, block_n=2, query_block=1, order="key_major")
    differ = 0
    for step in r.steps:
        for row, eqs in enumerate(tuple(step.equations)):
            differ += not close(by_term(eqs)[K.P_TILE].value, step["P_ij"][row])
    assert differ > 0


def test_causal_key_major_with_a_tile_a_row_sees_nothing_of():
    q, k, v = teaching_inputs()
    # Rows 3-5 against key block 2 (keys 4-5): row 3 sees neither key, but has seen keys 0-3 before.
    r = replay(q, k, v, block_m=3, block_n=2, query_block=1, causal=True, order="key_major")
    assert check_key_major(r, q, k, v, mask=torch.ones(6, 6, dtype=torch.bool).tril()) == 3 * 3
    e = by_term(r.steps[-1].equations[0])
    assert e[K.M_TILE].value == NEG_INF and e[K.P_TILE].value == (0.0, 0.0) and e[K.SCALE_TILE].value == 0.0
    assert "−∞ is taken as 0" in e[K.P_TILE].note and e[K.SCALE_OLD].value == 1.0 and e[K.SCALE_OLD].note is None
    assert "exp(−∞ − " in e[K.SCALE_TILE].substituted and e[K.M_NEW].value > NEG_INF


def test_a_row_with_no_key_yet_takes_minus_infinity_as_zero_in_the_exponents():
    q, k, v = teaching_inputs()
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[0, :2] = False  # row 0 sees keys 2-5 only: nothing in the first tile
    r = replay(q, k, v, block_m=2, block_n=2, attn_mask=mask, order="key_major")
    check_key_major(r, q, k, v, mask=mask)
    first = by_term(r.steps[0].equations[0])
    assert first[K.M_NEW].value == NEG_INF and first[K.SCALE_OLD].substituted == "exp(−∞ − 0) = 0"
    assert first[K.SCALE_TILE].substituted == "exp(−∞ − 0) = 0" and first[K.SCALE_TILE].note == NO_KEY
    assert first[K.L_NEW].value == 0.0 and first[K.O_WRITE].value == (0.0,) * 4
    assert "divides by 1" in first[K.O_WRITE].note and first[K.O_WRITE].substituted.endswith(" / 1 = [0, 0, 0, 0]")
    second = by_term(r.steps[1].equations[0])
    assert second[K.M_LOAD].value == NEG_INF and second[K.L_LOAD].value == 0.0 and second[K.SCALE_OLD].value == 0.0
    assert second[K.SCALE_OLD].note is None  # m_new is finite now: exp(−∞ − m_new) = 0, no −∞ − (−∞)
    json.dumps(build_view(r, {}), allow_nan=False)  # strict JSON: -inf as null


def test_rows_that_never_see_a_key_end_with_zero_output():
    q, k, v = teaching_inputs(N_q=6, N_k=4)
    # bottom_right with N_q = 6 > N_k = 4: row r sees keys <= r - 2, so rows 0 and 1 see none.
    r = replay(q, k, v, block_m=3, block_n=2, causal=True, causal_align="bottom_right", order="key_major")
    check_key_major(r, q, k, v, mask=torch.ones(6, 4, dtype=torch.bool).tril(diagonal=-2))
    e = by_term(r.steps[-1].equations[0])
    assert e[K.M_WRITE].value == NEG_INF and e[K.L_WRITE].value == 0.0 and e[K.O_WRITE].value == (0.0,) * 4


def test_with_a_sink_the_state_starts_at_the_sink():
    q, k, v = teaching_inputs()
    r = replay(q, k, v, block_m=3, block_n=2, query_block=1, causal=True, sinks=0.5, order="key_major")
    check_key_major(r, q, k, v, mask=torch.ones(6, 6, dtype=torch.bool).tril(), sink=0.5)
    e = by_term(r.steps[0].equations[0])
    assert e[K.M_INIT].symbolic == "m_i = sink_h" and e[K.M_INIT].value == 0.5 and e[K.L_INIT].value == 1.0


def test_query_major_view_is_unchanged():
    q, k, v = teaching_inputs()
    assert build_view(replay(q, k, v, block_m=2, block_n=2), {}) == {"source": SOURCE, "rowStart": 0, "rowCount": 2}


READ_PANEL = """(() => ({
  counter: document.getElementById("counter").textContent,
  meta: [...document.querySelectorAll("#equations .meta")].map(p => p.textContent),
  shownRow: Number(document.querySelector("#equations .equations").dataset.row),
  equations: [...document.querySelectorAll("#equations .equation")].map(e => ({
    name: e.dataset.name, line: Number(e.dataset.line), symbolic: e.querySelector(".symbolic").textContent,
    numbers: [...e.querySelectorAll(".substituted .num")].map(n => n.textContent)})),
}))()"""


def test_key_major_page_shows_fa1_lines_with_the_replay_numbers(browser, tmp_path):
    q, k, v = teaching_inputs()
    r = replay(q, k, v, block_m=2, block_n=2, query_block=1, order="key_major")
    page_path = tmp_path / "key_major.html"
    page_path.write_text(render_html(r), encoding="utf-8")
    browser.open(page_path)
    steps = build_view(r, {})["steps"]
    for n, step in enumerate(steps, start=1):
        if n > 1:
            browser.evaluate('document.getElementById("next").scrollIntoView({block: "center"})')
            browser.click("#next")
        for row, eqs in enumerate(step["rows"]):
            selector = f'#equations .equation-rows button[data-row="{row}"]'
            browser.evaluate(f"document.querySelector({json.dumps(selector)}).scrollIntoView({{block: 'center'}})")
            browser.click(selector)
            page = browser.evaluate(READ_PANEL)
            assert page["counter"] == f"Tile update {n} of {len(steps)}" and page["shownRow"] == 2 + row
            meta = " ".join(page["meta"])
            assert KEY_MAJOR_SOURCE in meta and "acc = O_i · l_i" in meta
            assert [(e["name"], e["line"], e["symbolic"]) for e in page["equations"]] == [
                (e["name"], e["line"], e["symbolic"]) for e in eqs
            ]
            assert {e["line"] for e in page["equations"]} >= {8, 9, 10, 11, 12, 13}
            for shown, e in zip(page["equations"], eqs, strict=True):
                want = part_numbers(e["parts"])
                assert len(shown["numbers"]) == len(want)
                for text, x in zip(shown["numbers"], want, strict=True):
                    assert text == "−∞" if x is None else math.isclose(float(text), x, rel_tol=5.01e-4, abs_tol=1e-300)
            # The written l_i on the page is the replay's l_i at this update.
            l_written = next(e for e in page["equations"] if e["name"] == "write l_i")["numbers"][-1]
            assert math.isclose(float(l_written), float(r.steps[n - 1]["l_i"][row]), rel_tol=5.01e-4)


def one_line(text: str) -> str:
    """Whitespace collapsed, so that text wrapped over lines still matches."""
    return " ".join(text.split())


def table_text(r) -> str:
    from flashattn_teach.replay.table import render_table

    out = io.StringIO()
    render_table(r, out, width=500)
    return out.getvalue()


def png_text(r, tmp_path, monkeypatch) -> str:
    """Every text the PNG draws, in drawing order."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from flashattn_teach.replay.png import render_png

    drawn: list[str] = []
    text = Axes.text
    monkeypatch.setattr(Axes, "text", lambda self, x, y, s, *a, **kw: drawn.append(s) or text(self, x, y, s, *a, **kw))
    render_png(r, tmp_path / "replay.png")
    return "\n".join(drawn)


def assert_shows_fa1(text: str, r, v) -> None:
    """Every update's FA1 lines with their numbers: the first row in full, the others' compact terms."""
    flat = one_line(text)
    for step in r.steps:
        rows = tuple(step.equations)
        for e in rows[0]:
            assert one_line(f"{e.symbolic}") in flat and one_line(e.substituted) in flat, (step.index, e.term)
        for row in rows[1:]:
            for term in (K.SCALE_OLD, K.SCALE_TILE, K.L_NEW):
                assert one_line(f"{term.value} = {by_term(row)[term].substituted}") in flat, (step.index, term)
    assert "FA1 Alg. 1" in text and "FA2 Alg. 1" not in text
    assert "alpha = exp(m_old − m_new)" not in text and "alpha =" not in text  # FA2's line 9


@pytest.mark.parametrize("query_block", [0, 2])
def test_key_major_table_and_png_show_fa1_lines_with_their_numbers(query_block, tmp_path, monkeypatch):
    q, k, v = teaching_inputs()
    r = replay(q, k, v, block_m=2, block_n=2, query_block=query_block, order="key_major")
    assert_shows_fa1(table_text(r), r, v)
    assert_shows_fa1(png_text(r, tmp_path, monkeypatch), r, v)
    # The last update's written O_i is dense attention's: the table prints it with the replay's numbers.
    last = by_term(r.steps[-1].equations[0])[K.O_WRITE]
    assert close(last.value, r.steps[-1]["O_final"][0]) and last.substituted in table_text(r)


def test_query_major_table_and_png_keep_fa2_lines(tmp_path, monkeypatch):
    """Negative control for the test above: the same inputs in query-major order show FA2's alpha line."""
    q, k, v = teaching_inputs()
    r = replay(q, k, v, block_m=2, block_n=2)
    for text in (table_text(r), png_text(r, tmp_path, monkeypatch)):
        assert "FA2 Alg. 1" in text and "FA1 Alg. 1" not in text and "load O_i from HBM" not in text
        for step in r.steps:
            rows = step_equations(step)
            assert one_line(by_term(rows[0])[Term.ALPHA].substituted) in one_line(text)
            assert one_line(f"alpha = {by_term(rows[1])[Term.ALPHA].substituted}") in one_line(text)
        with pytest.raises(AssertionError):
            assert_shows_fa1(text, replay(q, k, v, block_m=2, block_n=2, order="key_major"), v)


def test_each_update_carries_the_lines_of_its_loop_order():
    """A step carries its equations: FA2 Alg. 1's in query-major order, FA1 Alg. 1's in key-major order (the
    same m_i, l_i at the end of both), one tuple per query row of the block."""
    q, k, v = teaching_inputs()
    for order, terms in (("query_major", Term), ("key_major", KeyMajorTerm)):
        r = replay(q, k, v, block_m=2, block_n=2, query_block=1, order=order)
        for step in r.steps:
            assert len(step.equations) == step.rows[1] - step.rows[0] == 2
            assert all(isinstance(e.term, terms) for row in step.equations for e in row), order
    fa1_last = {e.term: e.value for e in r.steps[-1].equations[0]}
    assert close(fa1_last[KeyMajorTerm.L_WRITE], r.steps[-1]["l_i"][0])
