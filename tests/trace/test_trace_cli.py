"""``flashattn-teach replay`` through ``add_arguments``/``run``: every format, and lazy optional imports."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from flashattn_teach.trace import replay
from flashattn_teach.trace.cli import add_arguments, run


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_json_replays_the_recorded_recipe(capsys):
    argv = "--seed 3 --batch 2 --seq-len 5 --head-dim 3 --block-m 2 --block-n 3 --query-block 1 --format json"
    assert run(parse(*argv.split())) == 0
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 5, 3, dtype=torch.float64) for _ in range(3))  # q, k, v in this order
    expected = replay(q, k, v, block_m=2, block_n=3, query_block=1).to_experiment()
    assert json.loads(capsys.readouterr().out) == expected


def test_table_shows_every_update_and_the_error_shrinking(tmp_path):
    out = tmp_path / "replay.txt"
    assert run(parse("--causal", "--query-block", "2", "--order", "key-major", "--out", str(out))) == 0
    text = out.read_text(encoding="utf-8")
    for n in (1, 2, 3):
        assert f"Tile update {n}/3" in text
    assert "The error shrinks to zero at the last tile" in text
    assert "masked" in text and "-inf" in text and "Causally skipped tiles" in text


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
    assert "flashattn-teach replay:" in capsys.readouterr().err


def test_json_and_html_import_neither_rich_nor_matplotlib():
    code = (
        "import sys; from flashattn_teach.trace.cli import main\n"
        "assert main(['--format', 'json']) == 0 and main(['--format', 'html']) == 0\n"
        "assert not {'rich', 'matplotlib'} & set(sys.modules), sorted({'rich', 'matplotlib'} & set(sys.modules))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
