"""Every mode of ``flashattn-teach replay`` (forward, ``--backward``, ``--decode``) in every ``--format``
refuses, by name and with exit status 2, every option it does not read, at any value; the options come
from the parser's own list, so an option added later is checked here too (and must be given a value
below). ``--backward --query-block`` was accepted and ignored with table, json and png."""

from __future__ import annotations

import argparse

import pytest

from flashattn_teach.replay.cli import add_arguments, option_dests, run
from flashattn_teach.replay.cli_common import FORMATS
from flashattn_teach.replay.cli_modes import READS, SELECTORS, Mode, refused_option

MODES = {Mode.FORWARD: [], Mode.BACKWARD: ["--backward"], Mode.DECODE: ["--decode"]}
# a value each option's parser takes (not necessarily one that fits the others: only the refusal is judged)
VALUES = {
    "--seed": ["1"],
    "--batch": ["2"],
    "--batch-index": ["1"],
    "--seq-len": ["4"],
    "--head-dim": ["8"],
    "--dtype": ["float32"],
    "--block-m": ["1"],
    "--block-n": ["1"],
    "--query-block": ["1"],
    "--causal": [],
    "--causal-align": ["bottom_right"],
    "--scale": ["0.5"],
    "--order": ["query_major"],
    "--window": ["1,1"],
    "--softcap": ["2"],
    "--alibi": ["0.5"],
    "--seqlens-k": ["3"],
    "--cu-seqlens": ["0,2,6"],
    "--sinks": ["0.5"],
    "--pad-left": ["1"],
    "--mask": ["mask.pt"],
    "--format": ["table"],
    "--extensions": [],
    "--step": ["1"],
    "--out": ["out.txt"],
    "--cache-len": ["3"],
    "--new-kv": ["1"],
    "--new-queries": ["2"],
    "--num-splits": ["2"],
    "--cache-size": ["9"],
    "--merge-order": ["1,0"],
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def flags() -> list[tuple[str, str]]:
    """``(option, dest)`` of every option of the parser but the mode selectors and ``--format`` (the axis)."""
    return [
        (a.option_strings[0], a.dest)
        for a in parser()._actions
        if a.option_strings and a.dest not in (*SELECTORS, "help", "format")
    ]


def test_every_option_of_the_parser_has_a_value_here_and_a_place_in_the_modes() -> None:
    assert {option for option, _ in flags()} | {"--format"} == set(VALUES)
    assert {dest for _, dest in flags()} | {"format"} == set(option_dests())
    for mode in Mode:
        assert set(READS[mode]) == set(FORMATS)


CASES = [(mode, fmt, option, dest) for mode in Mode for fmt in FORMATS for option, dest in flags()]


@pytest.mark.parametrize(("mode", "fmt", "option", "dest"), CASES, ids=lambda x: getattr(x, "value", x))
def test_each_mode_and_format_refuses_by_name_every_option_it_does_not_read(mode, fmt, option, dest, capsys):
    argv = [*MODES[mode], "--format", fmt, option, *VALUES[option]]
    args = parser().parse_args(argv)
    if dest in READS[mode][fmt]:
        assert refused_option(args, option_dests()) is None
        return
    assert run(args) == 2
    err = capsys.readouterr().err
    assert f"argument {option}:" in err, err


@pytest.mark.parametrize("fmt", ["table", "json", "png"])
def test_backward_query_block_is_refused_where_it_was_ignored(fmt, tmp_path, capsys):
    out = tmp_path / f"b.{fmt}"
    args = parser().parse_args(["--backward", "--query-block", "1", "--format", fmt, "--out", str(out)])
    assert run(args) == 2
    assert "argument --query-block: not used with --backward --format " + fmt in capsys.readouterr().err
    assert not out.exists()
    # the control: without it the same command runs
    assert run(parser().parse_args(["--backward", "--format", fmt, "--out", str(out)])) == 0


def test_backward_page_reads_query_block(tmp_path):
    """``--backward --format html`` draws the forward of ``--query-block`` beside the backward: read, so the
    page changes with it."""
    pages = []
    for i in ("0", "1"):
        out = tmp_path / f"b{i}.html"
        assert run(parser().parse_args(["--backward", "--format", "html", "--query-block", i, "--out", str(out)])) == 0
        pages.append(out.read_text(encoding="utf-8"))
    assert pages[0] != pages[1]
