"""The terminal tables take the console's width: at 80 columns (``COLUMNS=80``, or a Console 80 wide) no line is
longer than 80 characters and the values a reader looks for are still there; at 160 columns the wide layout
appears (the negative control: the width is read, not fixed).

The values are judged against torch: the running ``m_i, l_i`` of each update are the row max and the row sum of
``exp(S - m)`` over the key columns seen so far, ``delta = rowsum(dO * O)`` from ``torch.softmax``, the decode
step's ``lse`` from ``torch.logsumexp``."""

from __future__ import annotations

import io
import math
import re

import pytest
import torch
from teaching import teaching_inputs

from flashattn_teach.replay import replay
from flashattn_teach.replay.backward_replay import backward_of
from flashattn_teach.replay.decode_replay import replay_decode
from flashattn_teach.replay.memory import memory_figure
from flashattn_teach.replay.memory_table import memory_panel
from flashattn_teach.replay.table import render_table

from replay_cli import main

pytest.importorskip("rich")
NARROW, WIDE = 80, 160


def widest(text: str) -> int:
    from rich.cells import cell_len

    return max(cell_len(line) for line in text.splitlines())


def rendered(render, obj, monkeypatch, columns: int, *, by: str) -> str:
    """``render(obj)`` into a string, ``columns`` wide: told by ``COLUMNS`` or by ``width=``."""
    out = io.StringIO()
    if by == "env":
        monkeypatch.setenv("COLUMNS", str(columns))
        render(obj, out)
    else:
        monkeypatch.delenv("COLUMNS", raising=False)
        render(obj, out, width=columns)
    return out.getvalue()


def g4(x: float) -> str:
    return "-inf" if x == -math.inf else f"{x + 0.0:.4g}"


def causal_inputs():
    q, k, v, dO = teaching_inputs(with_dO=True)
    S = (q[0] @ k[0].T) / 2.0  # (6, 4) @ (4, 6) -> (6, 6); scale 1 / sqrt(4)
    S = S.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), -math.inf)
    return q, k, v, dO, S


@pytest.mark.parametrize("by", ["env", "width"])
def test_forward_table_fits_80_columns_with_its_values(by, monkeypatch):
    q, k, v, _, S = causal_inputs()
    r = replay(q, k, v, block_m=2, block_n=2, query_block=2, causal=True)
    text = rendered(render_table, r, monkeypatch, NARROW, by=by)
    assert widest(text) <= NARROW, text
    rows = S[4:6]  # query block 2
    for n, c1 in enumerate((2, 4, 6)):  # the updates see key columns [0, c1)
        m = rows[:, :c1].max(-1).values
        l = (rows[:, :c1] - m[:, None]).exp().sum(-1)  # the paper's l
        assert f"Tile update {n + 1}/3 " in text
        block = text.split(f"Tile update {n + 1}/3 ")[1].split("Tile update")[0]
        for x in (*m.tolist(), *l.tolist()):
            assert re.search(rf"(?<![\d.]){re.escape(g4(x))}(?![\d])", block), (g4(x), block)
    assert "m_i" in text and "l_i" in text and "acc_new" in text and "HBM bytes so far" in text
    final = re.findall(r"│\s+3 │\s+4–5 │\s+6 │\s+(\S+) │", text)  # the summary's last row
    assert final and float(final[0]) < 1e-12
    # the narrow layout: the memory's two tables stacked, each equation over its numbers
    assert not re.search(r"On chip.*HBM bytes", text) and not re.search(r"line\s+equation\s+row 4", text)


def test_forward_table_is_wide_at_160_columns(monkeypatch):
    q, k, v, _, _ = causal_inputs()
    r = replay(q, k, v, block_m=2, block_n=2, query_block=2, causal=True)
    for by in ("env", "width"):
        text = rendered(render_table, r, monkeypatch, WIDE, by=by)
        assert NARROW < widest(text) <= WIDE
        assert re.search(r"On chip\s+HBM bytes so far", text) and re.search(r"line\s+equation\s+row 4", text)


def test_memory_panel_fits_80_columns(monkeypatch):
    from rich.console import Console

    q, k, v, _, _ = causal_inputs()
    figure = memory_figure(replay(q, k, v, block_m=2, block_n=2, query_block=2, causal=True))
    texts = {}
    for narrow, width in ((True, NARROW), (False, WIDE)):
        out = io.StringIO()
        Console(file=out, width=width).print(memory_panel(figure, 2, narrow=narrow))
        texts[narrow] = out.getvalue()
    assert widest(texts[True]) <= NARROW < widest(texts[False])
    for text in texts.values():  # the same values in both layouts: the dense path's total, the step's reads
        assert str(figure.dense.total_bytes) in text and str(figure.steps[2].hbm.read_bytes) in text


@pytest.mark.parametrize("by", ["env", "width"])
def test_backward_table_fits_80_columns_with_its_values(by, monkeypatch):
    q, k, v, dO, S = causal_inputs()
    br = backward_of(replay(q, k, v, block_m=2, block_n=2, causal=True), dO=dO)
    text = rendered(render_table, br, monkeypatch, NARROW, by=by)
    assert widest(text) <= NARROW, text
    for n in range(1, 7):
        assert f"dK/dV pass · step {n} of 6" in text and f"dQ pass · step {n} of 6" in text
    O = torch.softmax(S, dim=-1) @ v[0]
    for x in (dO[0] * O).sum(-1).tolist():  # delta, FA2 Alg. 2 line 4
        assert g4(x) in text
    worst = float(text.rsplit("max |grad - oracle| over every gradient:", 1)[1].split()[0])
    assert worst < 1e-12
    assert not re.search(r"equation\s+with the numbers", text)  # the narrow layout: numbers under the equation
    wide = rendered(render_table, br, monkeypatch, WIDE, by=by)
    assert NARROW < widest(wide) <= WIDE and re.search(r"line\s+equation\s+with the numbers", wide)


@pytest.mark.parametrize("by", ["env", "width"])
def test_decode_table_fits_80_columns_with_its_values(by, monkeypatch):
    torch.manual_seed(0)
    q = torch.randn(1, 1, 2, 4, dtype=torch.float64)  # (B, H, N_new, D)
    k_cache, v_cache = (torch.randn(1, 1, 9, 4, dtype=torch.float64) for _ in range(2))  # N_max = 9
    r = replay_decode(q, k_cache, v_cache, cache_seqlens=7, num_splits=3, block_n=2, causal=True)
    text = rendered(render_table, r, monkeypatch, NARROW, by=by)
    assert widest(text) <= NARROW, text
    # the step's 2 queries sit at positions 5 and 6 of the 7 keys (bottom-right causal)
    S = (q[0, 0] @ k_cache[0, 0, :7].T) / 2.0  # (2, 4) @ (4, 7) -> (2, 7)
    S = S.masked_fill(torch.arange(7)[None, :] > torch.tensor([[5], [6]]), -math.inf)
    for x in torch.logsumexp(S, dim=-1).tolist():
        assert g4(x) in text
    assert all(f"Split {s} · keys" in text for s in range(3)) and "merge 2:" in text
    final = float(re.search(r"max difference (\S+);", text).group(1))
    assert final < 1e-12
    assert "role       o  o" in text and "o old, n new" in text  # the narrow layout's letters
    wide = rendered(render_table, r, monkeypatch, WIDE, by=by)
    assert NARROW < widest(wide) <= WIDE and re.search(r"role\s+old\s+old", wide)


@pytest.mark.parametrize(
    "argv",
    [
        ["forward"],
        ["forward", "--causal", "--order", "key_major", "--sinks", "0.5"],
        ["backward", "--causal"],
        ["decode"],
    ],
)
def test_cli_tables_take_the_terminal_width(argv, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(NARROW))
    assert main([*argv, "--format", "table"]) == 0
    narrow = capsys.readouterr().out
    assert widest(narrow) <= NARROW
    monkeypatch.setenv("COLUMNS", str(WIDE))
    assert main([*argv, "--format", "table"]) == 0
    assert widest(capsys.readouterr().out) > NARROW
