"""``flashattn-teach demo``: every line says what its numbers are, the numbers are right, and it ends with what to
run next."""

from __future__ import annotations

import re

from flashattn_teach.cli import main


def demo_lines(capsys) -> list[str]:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    return [line for line in out.splitlines() if line.strip()]


def test_every_line_names_what_it_prints(capsys):
    lines = demo_lines(capsys)
    for line in lines:
        # A label before the first number or list: no bare "[2, 1, 6, 4]" or "5.96e-08" on a line of its own.
        first_value = re.search(r"[\[\(\d]", line)
        label = line[: first_value.start()] if first_value else line
        assert re.search(r"[a-z]{3}", label), f"no label before the value: {line!r}"
        assert len(line) <= 80, line
    shape = next(line for line in lines if "[2, 1, 6, 4]" in line)
    assert "dense, tiled" in shape and "shape" in shape  # what the 2 of the leading axis is
    assert any(line.startswith("inputs q, k, v: (B, N, D) = (1, 6, 4)") for line in lines)


def test_the_printed_errors_are_small_against_float64(capsys):
    lines = demo_lines(capsys)
    dense_tiled = next(line for line in lines if line.startswith("max |dense - tiled|"))
    assert float(dense_tiled.rsplit(" ", 1)[1]) < 1e-6
    tiles = [line for line in lines if line.strip().startswith("tiles ")]
    assert len(tiles) == 5 and all(float(line.rsplit(" ", 1)[1]) < 1e-6 for line in tiles)
    # The scores held at once: N x N = 6 x 6 for dense (inputs (1, 6, 4)), one 2 x 2 tile for the tiled schedule.
    assert "dense N x N = 36, tiled 2 x 2 = 4" in "\n".join(lines)


def test_it_ends_with_what_to_run_next(capsys):
    lines = demo_lines(capsys)
    at = lines.index("next:")
    commands = [line.strip() for line in lines[at + 1 :] if line.startswith("    ")]
    assert commands == ["flashattn-teach replay --format html --out replay.html", "flashattn-teach ladder"]
    assert all(line.endswith(":") for line in lines[at + 1 :] if not line.startswith("    "))  # each says what
