"""``flashattn-teach replay`` through ``add_arguments``/``run``: every format, and lazy optional imports."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from flashattn_teach.masks.causal import TileKind
from flashattn_teach.replay import TileState, replay, to_experiment
from flashattn_teach.replay.cli import add_arguments, run


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv if argv[:1] in (("backward",), ("decode",)) else ("forward", *argv))


def test_json_replays_the_recorded_recipe(capsys):
    argv = "--seed 3 --batch 2 --seq-len 5 --head-dim 3 --block-m 2 --block-n 3 --query-block 1 --format json"
    assert run(parse(*argv.split())) == 0
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 5, 3, dtype=torch.float64) for _ in range(3))  # q, k, v in this order
    expected = to_experiment(replay(q, k, v, block_m=2, block_n=3, query_block=1))
    assert json.loads(capsys.readouterr().out) == expected


def test_table_shows_every_update_and_the_error_shrinking(tmp_path):
    out = tmp_path / "replay.txt"
    assert run(parse("--causal", "--query-block", "2", "--order", "key_major", "--out", str(out))) == 0
    text = out.read_text(encoding="utf-8")
    for n in (1, 2, 3):
        assert f"Tile update {n}/3" in text
    assert "The error shrinks to zero at the last tile" in text
    assert "masked" in text and "-inf" in text and "Skipped (SKIP) tiles" in text


def test_html_is_self_contained(tmp_path):
    out = tmp_path / "replay.html"
    assert run(parse("--causal", "--format", "html", "--out", str(out))) == 0
    page = out.read_text(encoding="utf-8")
    assert "default-src 'none'" in page  # the browser may fetch nothing at all
    assert " src=" not in page and "<link" not in page and "@import" not in page
    assert page.count("https://") == 0


def test_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "replay.png"
    assert run(parse("--format", "png", "--out", str(out), "--step", "2")) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv", [("--format", "png"), ("--query-block", "9"), ("--format", "png", "--out", "x.png", "--step", "7")]
)
def test_bad_options_exit_2_with_a_message(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(parse(*argv)) == 2
    assert "flashattn-teach replay forward: error:" in capsys.readouterr().err


def test_json_and_html_import_neither_rich_nor_matplotlib():
    code = (
        "import sys; from flashattn_teach.cli import main\n"
        "assert main(['replay', '--format', 'json']) == 0 and main(['replay', '--format', 'html']) == 0\n"
        "assert not {'rich', 'matplotlib'} & set(sys.modules), sorted({'rich', 'matplotlib'} & set(sys.modules))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_the_page_gets_tile_states_from_the_enum_and_spells_none_itself(tmp_path):
    out = tmp_path / "replay.html"
    assert run(parse("--causal", "--format", "html", "--out", str(out))) == 0
    page = out.read_text(encoding="utf-8")
    enums = json.loads(page.split('<script type="application/json" id="replay-enums">')[1].split("</script>")[0])
    assert enums["TileState"] == {s.name: s.value for s in TileState}
    assert enums["TileKind"] == {k.name: k.value for k in TileKind}
    script = page.split("<script>")[1].split("</script>")[0]
    assert "STATE.SKIPPED" in script  # the probe finds the names the script uses ...
    for value in [*(s.value for s in TileState), *(k.value for k in TileKind)]:
        assert f'"{value}"' not in script and f"'{value}'" not in script  # ... and no spelt-out value


@pytest.mark.parametrize(("columns", "key_blocks"), [(120, "0–47"), (80, "0–31")])
def test_table_of_a_long_replay_draws_a_window_and_both_ends(columns, key_blocks, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(columns))  # the table takes the terminal's width; 80: a narrower window
    out = tmp_path / "replay.txt"
    assert run(parse("--seq-len", "2000", "--causal", "--query-block", "600", "--out", str(out))) == 0
    text = out.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert max(map(len, lines)) <= columns
    shown = [n for n in range(1, 602) if f"Tile update {n}/601 " in text]
    assert shown == [*range(1, 11), *range(592, 602)]
    assert "… tile updates 11–591 of 601 not drawn …" in text
    # the window around (600, 0)
    assert f"query blocks i = 592–607 of 1000, key blocks j = {key_blocks} of 1000" in text
    assert "Skipped (SKIP) tiles of this block: key blocks j = 601–999" in text


@pytest.mark.parametrize(("option", "value"), [("--pad-left", "7"), ("--seqlens-k", "7"), ("--pad-left", "2,7")])
def test_more_keys_than_the_sequence_holds_is_refused_naming_both_options(option, value, capsys):
    assert run(parse("--seq-len", "6", "--batch", "2", option, value)) == 2
    err = capsys.readouterr().err
    assert f"argument {option}: must be in [0, 6] for --seq-len 6, got {value}" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv", [("--pad-left", "6"), ("--seqlens-k", "0")])
def test_every_key_padded_is_a_row_that_sees_none(argv, capsys):
    """The negative control of the test above: the bounds are inclusive, as flash-attn's seqlens_k."""
    assert run(parse("--seq-len", "6", *argv, "--format", "json", "--extensions")) == 0
    assert json.loads(capsys.readouterr().out)["cases"] == []  # no tile visited


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--step", "1"), "argument --step: draws one step of --format png, not --format table"),
        (
            ("--step", "1", "--format", "html"),
            "argument --step: draws one step of --format png, not --format html",
        ),
        (("--extensions",), "argument --extensions: adds to --format json, not --format table"),
        (
            ("--extensions", "--format", "png", "--out", "r.png"),
            "argument --extensions: adds to --format json, not --format png",
        ),
    ],
)
def test_an_option_of_another_format_is_refused_not_ignored(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(parse(*argv)) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_causal_align_without_a_diagonal_to_align_is_refused(capsys):
    assert run(parse("--causal-align", "bottom_right", "--seqlens-k", "4")) == 2
    err = capsys.readouterr().err
    assert "argument --causal-align: aligns the diagonal of --causal, --window and --alibi, needs one of them" in err
    assert "(got --causal-align bottom_right)" in err


@pytest.mark.parametrize("uses_it", [("--causal",), ("--window", "2,0"), ("--alibi", "0.5")])
def test_causal_align_with_causal_window_or_alibi_runs(uses_it, capsys):
    """The negative control of the test above: each of the three places the diagonal offset (masks.py)."""
    assert run(parse(*uses_it, "--causal-align", "bottom_right")) == 0
    assert capsys.readouterr().err == ""
