"""The backward replay as PNGs (``--backward --format png``), one per step and one for the preprocess and the
result, each legible at screen size: every value drawn in a cell is the float64 backward written here
(P = exp(S - lse), dP = dO V^T, dS = P * (dP - delta), the accumulators; O, dO, lse, delta), step by step."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
import torch
from teaching import teaching_inputs

from flashattn_teach.errors import AttentionValueError
from flashattn_teach.replay import replay
from flashattn_teach.replay.backward_replay import backward_of
from flashattn_teach.replay.png.backward import MAX_PNG_STEPS, render_backward_png, step_paths, tile_states
from flashattn_teach.replay.step import TileState

from replay_cli import main

pytest.importorskip("matplotlib")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SCREEN = 1600  # pixels on the long side: legible on a screen without zooming out


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk, which follows the 8-byte signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_MAGIC and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def expected_cells(q, k, v, dO, causal: bool) -> list[list[float]]:
    """Per step of both passes (2x2 tiles of a 6 x 6 problem), the values of P_ij, dP_ij, dS_ij and the
    accumulators after the step, in the order the picture writes them into cells (row-major)."""
    mask = torch.ones(6, 6, dtype=torch.bool).tril() if causal else torch.ones(6, 6, dtype=torch.bool)
    S = (q @ k.T / 2.0).masked_fill(~mask, -math.inf)  # scale 1 / sqrt(4)
    P = torch.softmax(S, dim=-1)  # = exp(S - lse)
    O = P @ v
    dP = dO @ v.T  # (6, 4) @ (4, 6) -> (6, 6)
    delta = (dO * O).sum(-1)
    dS = P * (dP - delta[:, None])
    tiles = [(i, j) for i in range(3) for j in range(3) if not causal or j <= i]
    blk = lambda b: slice(2 * b, 2 * b + 2)  # noqa: E731
    out = []
    for j in range(3):  # dK/dV pass: key blocks outer
        dV, dK = torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64)
        for i in (i for i in range(3) if (i, j) in tiles):
            Pt, dPt, dSt = P[blk(i), blk(j)], dP[blk(i), blk(j)], dS[blk(i), blk(j)]
            dV, dK = dV + Pt.T @ dO[blk(i)], dK + 0.5 * dSt.T @ q[blk(i)]
            out.append([x for M in (Pt, dPt, dSt, dV, dK) for x in M.reshape(-1).tolist()])
    for i in range(3):  # dQ pass: query blocks outer
        dQ = torch.zeros(2, 4, dtype=torch.float64)
        for j in (j for j in range(3) if (i, j) in tiles):
            Pt, dPt, dSt = P[blk(i), blk(j)], dP[blk(i), blk(j)], dS[blk(i), blk(j)]
            dQ = dQ + 0.5 * dSt @ k[blk(j)]
            out.append([x for M in (Pt, dPt, dSt, dQ) for x in M.reshape(-1).tolist()])
    return out


def drawn_texts(monkeypatch) -> list[str]:
    from matplotlib.axes import Axes

    drawn: list[str] = []
    text = Axes.text
    monkeypatch.setattr(Axes, "text", lambda self, x, y, s, *a, **kw: drawn.append(s) or text(self, x, y, s, *a, **kw))
    return drawn


@pytest.mark.parametrize("causal", [False, True])
def test_every_drawn_cell_is_the_float64_backward(causal, tmp_path, monkeypatch):
    q, k, v, dO = teaching_inputs(with_dO=True)
    r = replay(q, k, v, block_m=2, block_n=2, causal=causal)
    drawn = drawn_texts(monkeypatch)
    files = render_backward_png(backward_of(r, dO=dO), tmp_path / "backward.png", dpi=40)
    assert all(path.read_bytes()[:8] == PNG_MAGIC for path in files)
    want = expected_cells(q[0], k[0], v[0], dO[0], causal)
    assert len(files) == 1 + len(want)  # the preprocess and the result, then one picture per step
    assert len(want) == (12 if causal else 18)
    for cells in want:  # per step: its cells, then one text block of equations
        got, equations = drawn[: len(cells)], drawn[len(cells)]
        del drawn[: len(cells) + 1]
        for text, x in zip(got, cells, strict=True):
            assert math.isclose(float(text), x, rel_tol=5.01e-3, abs_tol=1e-12), (text, x)
        assert all(f"{name} = " in equations for name in ("P_ij", "dP_ij", "dS_ij"))
        assert ("dV_j = " in equations) != ("dQ_i = " in equations)
    # Last the preprocess and the result: O, dO, lse, delta from torch.softmax, then the errors' text.
    mask = torch.ones(6, 6, dtype=torch.bool).tril() if causal else torch.ones(6, 6, dtype=torch.bool)
    S = (q[0] @ k[0].T / 2.0).masked_fill(~mask, -math.inf)
    O = torch.softmax(S, dim=-1) @ v[0]
    cells = [*O.reshape(-1).tolist(), *dO[0].reshape(-1).tolist(), *torch.logsumexp(S, -1).tolist()]
    cells += (dO[0] * O).sum(-1).tolist()
    for text, x in zip(drawn[: len(cells)], cells, strict=True):
        assert math.isclose(float(text), x, rel_tol=5.01e-3, abs_tol=1e-12), (text, x)
    (summary,) = drawn[len(cells) :]
    assert "delta = rowsum(dO * O)" in summary and all(f"max |{g} - oracle|" in summary for g in ("dQ", "dK", "dV"))
    first_dq = 7 if causal else 10  # after the 6 (causal) or 9 tiles of the dK/dV pass; files[n] is step n
    assert f"dQ pass {files[first_dq].name} to {files[-1].name}" in summary
    # Negative control: the drawn dS cells of the first step are not P alone.
    first = expected_cells(q[0], k[0], v[0], dO[0], causal)[0]
    assert first[8:12] != first[0:4]


def test_the_grid_marks_the_tiles_of_the_step_s_accumulator():
    q, k, v, dO = teaching_inputs(with_dO=True)
    br = backward_of(replay(q, k, v, block_m=2, block_n=2, causal=True), dO=dO)
    steps = [*br.dkdv_steps(), *br.dq_steps()]
    n = next(n for n, s in enumerate(steps) if (s.i, s.j) == (2, 1) and s.accumulators.keys() == {"dV_j", "dK_j"})
    states = tile_states(br, steps, n)
    C, A, D, S, P = (TileState.CURRENT, TileState.ACCUMULATED, TileState.DONE, TileState.SKIPPED, TileState.PENDING)
    assert states == [[D, S, S], [D, A, S], [D, C, P]]
    dq = next(n for n, s in enumerate(steps) if (s.i, s.j) == (1, 1) and "dQ_i" in s.accumulators)
    assert tile_states(br, steps, dq) == [[D, S, S], [A, C, S], [P, P, P]]


def test_one_step_and_the_limits(tmp_path):
    q, k, v, dO = teaching_inputs(with_dO=True)
    br = backward_of(replay(q, k, v, block_m=2, block_n=2), dO=dO)
    assert render_backward_png(br, tmp_path / "one.png", step=18) == [tmp_path / "one.png"]
    assert [p.name for p in tmp_path.iterdir()] == ["one.png"]
    with pytest.raises(AttentionValueError, match=r"step must be in \[1, 18\]"):
        render_backward_png(br, tmp_path / "x.png", step=19)
    small = backward_of(replay(q, k, v, block_m=1, block_n=1), dO=dO)  # 36 tiles, 72 steps
    assert 72 > MAX_PNG_STEPS
    with pytest.raises(AttentionValueError, match="72 steps"):
        render_backward_png(small, tmp_path / "x.png")


def test_step_files_are_numbered_in_step_order():
    assert [p.name for p in step_paths(Path("out/back.png"), 3)] == [f"back_step0{n}.png" for n in (1, 2, 3)]
    assert step_paths(Path("out/back.png"), 3)[0].parent == Path("out")
    names = [p.name for p in step_paths(Path("b.png"), 100)]
    assert names[0] == "b_step001.png" and names[-1] == "b_step100.png" and names == sorted(names)


def test_cli_writes_one_picture_per_step_each_legible_at_screen_size(tmp_path, capsys):
    out = tmp_path / "backward.png"
    assert main(["backward", "--causal", "--format", "png", "--out", str(out)]) == 0
    steps = [f"backward_step{n:02d}.png" for n in range(1, 13)]  # 6 tiles, 2 passes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backward.png", *steps]
    assert "backward_step01.png to backward_step12.png" in capsys.readouterr().out
    for path in tmp_path.iterdir():
        width, height = png_size(path)
        # one screen wide (12 inches at 130 dpi), and no taller: the old single picture was 2860 x 5252
        assert 1200 <= width <= SCREEN and height <= SCREEN, (path.name, width, height)
    # --step: that step alone, to --out
    one = tmp_path / "one" / "step7.png"
    one.parent.mkdir()
    assert main(["backward", "--causal", "--format", "png", "--out", str(one), "--step", "7"]) == 0
    assert [p.name for p in one.parent.iterdir()] == ["step7.png"] and max(png_size(one)) <= SCREEN
    assert main(["backward", "--causal", "--format", "png", "--out", str(one), "--step", "13"]) == 2
    assert "argument --step: must be in [1, 12] for this backward, got 13" in capsys.readouterr().err
    assert main(["backward", "--format", "json", "--step", "2"]) == 2
    assert "argument --step: draws one step of --format png, not --format json" in capsys.readouterr().err
    assert main(["backward", "--format", "png"]) == 2
    assert "png needs --out" in capsys.readouterr().err
