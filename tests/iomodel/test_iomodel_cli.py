"""The ``flashattn-teach iomodel`` command: its tables, the tiles it shows for an SRAM budget, and one-line
errors naming the option for every bad value."""

from __future__ import annotations

import argparse
import itertools
import re

import pytest

from flashattn_teach.cli import main
from flashattn_teach.tools import iomodel


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        status = main(["iomodel", *argv])
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_cli_prints_every_schedule(capsys):
    parser = argparse.ArgumentParser()
    iomodel.add_arguments(parser)
    assert iomodel.run(parser.parse_args(["--seq-len", "8192", "--head-dim", "128", "--sram-kib", "228"])) == 0
    out = capsys.readouterr().out
    for needle in (
        "standard (FA1 Alg. 0)",
        "key-major (FA1 Alg. 1)",
        "query-major (FA2)",
        "FA1 Alg. 4",
        "split dK/dV",
        "34.36 GFLOP",
    ):
        assert needle in out


def test_cli_rejects_bad_sizes_with_a_message(capsys):
    parser = argparse.ArgumentParser()
    iomodel.add_arguments(parser)
    assert iomodel.run(parser.parse_args(["--head-dim", "128", "--sram-kib", "0.1"])) == 2
    err = capsys.readouterr().err
    assert "argument --sram-kib: 0.1 KiB holds no tile at --head-dim 128 and --elem-bytes 2" in err
    assert "4 x 128 x 2 = 1024 bytes; use --sram-kib 1 or more" in err and err.count("\n") == 1


def _reported_tiles(out: str) -> list[tuple[int, int]]:
    """The ``Br x Bc`` column of the traffic table, for each tiled row, in the table's order."""
    rows = [line for line in out.splitlines() if line.startswith(("forward ", "backward "))]
    return [tuple(map(int, w.split("x"))) for row in rows for w in row.split() if re.fullmatch(r"\d+x\d+", w)]


@pytest.mark.parametrize(
    ("sram_kib", "d", "e", "blocks"),
    list(itertools.product([0.5, 1, 1.5, 3.3, 64, 100, 228], [64, 128], [2, 4], [(1, 1), (128, 64)])),
)
def test_the_command_shows_only_tiles_that_fit_m_or_names_the_budget_that_does(sram_kib, d, e, blocks, capsys):
    """A tile fits when its Q_i, O_i, K_j, V_j do (what FA1 Alg. 1 line 1 sizes): 2 (Br + Bc) d e <= M bytes.
    A refusal's budget is checked by running one byte below it (the same refusal) and at it (not that one)."""
    base = ["--seq-len", "1024", "--head-dim", str(d), "--elem-bytes", str(e)]
    base += ["--block-m", str(blocks[0]), "--block-n", str(blocks[1])]
    status, out, err = _main([*base, "--sram-kib", str(sram_kib)], capsys)
    if status == 0:
        tiles = _reported_tiles(out)
        assert len(tiles) == 4  # key-major forward, query-major, key-major backward, split
        assert all(2 * (br + bc) * d * e <= sram_kib * 1024 for br, bc in tiles), tiles
        paper = iomodel.paper_block_sizes(int(sram_kib * 1024), d, e)
        if 2 * sum(paper) * d * e <= sram_kib * 1024:
            assert tiles[0] == paper  # the paper's tile wherever it fits
        return
    assert (status, out) == (2, "") and err.startswith("flashattn-teach iomodel: error: argument --sram-kib:")
    found = re.search(r"= (\d+) bytes; use --sram-kib (\S+) or more", err)
    assert found is not None, err
    need, kib = int(found[1]), found[2]
    assert float(kib) * 1024 == need > sram_kib * 1024
    below = _main([*base, "--sram-kib", repr((need - 1) / 1024)], capsys)
    assert below[0] == 2 and found[0] in below[2]
    at = _main([*base, "--sram-kib", kib], capsys)
    assert at[0] == 0 or found[0] not in at[2]


def test_cli_prints_the_roofline_the_l2_level_and_the_ring(capsys):
    status, out, err = _main(["--seq-len", "8192", "--head-dim", "128", "--sram-kib", "228", "--ring", "8"], capsys)
    assert (status, err) == (0, "")
    assert "ridge point 989 TFLOP/s / 4.8 TB/s = 206 FLOP/B" in out
    assert "L2 reuse: 50.0 MiB of L2, 132 programs" in out and "With L2 applies where every pass fits" in out
    table, l2_row = [line.split() for line in out.splitlines() if line.startswith("forward  query-major")]
    assert table[-2:] == ["126.0", "memory"]  # every load from HBM: memory-bound
    assert l2_row[5:7] == ["126.0", "memory"] and l2_row[-1] == "compute"  # with L2 reuse: compute-bound
    assert "Ring over W = 8 devices: N/W = 1024 tokens" in out
    (fwd,) = [line for line in out.splitlines() if line.startswith("forward") and "GFLOP" in line]
    assert fwd.split()[-3:] == ["no", "1099", "8792"]  # 1024 < N/W* = 1098.9
    assert "Ring over" not in _main([], capsys)[1]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ("--ring 1", "--ring"),
        ("--ring 3", "--ring"),
        ("--ring 0", "--ring"),
        ("--causal --seq-len 8200 --ring 8", "--ring"),
        ("--heads 4 --kv-heads 3 --ring 2", "--kv-heads"),
        ("--heads 4 --kv-heads 8 --ring 2", "--kv-heads"),
        ("--efficiency 1.5 --ring 2", "--efficiency"),
        ("--efficiency 0", "--efficiency"),
        ("--l2-mib 0", "--l2-mib"),
        ("--l2-mib 1e307", "--l2-mib"),
        ("--l2-mib nan", "--l2-mib"),
        ("--programs 0", "--programs"),
        ("--link-gbs -1", "--link-gbs"),
        ("--peak-tflops inf", "--peak-tflops"),
        ("--hbm-tbs 0", "--hbm-tbs"),
    ],
)
def test_cli_rejects_bad_l2_roofline_and_ring_values_in_one_line(options, named, capsys):
    status, out, err = _main(options.split(), capsys)
    assert (status, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("flashattn-teach iomodel: error:") and f"argument {named}" in err


@pytest.mark.parametrize("option", ["--kv-heads 2", "--link-gbs 50", "--efficiency 0.7"])
def test_cli_refuses_a_ring_option_without_the_ring(option, capsys):
    status, out, err = _main(["--heads", "4", *option.split()], capsys)
    assert (status, out) == (2, "")
    assert f"argument {option.split()[0]}: describes the ring, needs --ring W (got {option})" in err
    status, out, err = _main(["--heads", "4", "--ring", "2", *option.split()], capsys)  # the negative control
    assert (status, err) == (0, "") and "Ring over W = 2 devices" in out


def test_cli_accepts_good_ring_values(capsys):
    """The negative control of the test above."""
    status, out, err = _main("--causal --seq-len 8192 --ring 4 --heads 8 --kv-heads 2 --efficiency 1".split(), capsys)
    assert (status, err) == (0, "") and "zigzag" in out and "H_kv = 2" in out
