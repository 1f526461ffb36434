"""The ``flashattn-teach`` command line: --version, strict top-level parsing, one-line errors naming the
option for every bad value, a quiet end on a closed pipe, and a replay far larger than an N x N matrix."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from importlib.metadata import version

import numpy as np
import pytest
import torch

import flashattn_teach
from flashattn_teach.cli import EXIT_SIGPIPE, main


@pytest.fixture(autouse=True)
def _keep_triton_interpret(monkeypatch):
    """``kernels`` unsets TRITON_INTERPRET in its process; run in-process here, it must not leak into the
    interpreter tests that follow."""
    value = os.environ.get("TRITON_INTERPRET")
    if value is not None:
        monkeypatch.setenv("TRITON_INTERPRET", value)  # restored at teardown, whatever the command did


def outcome(argv: list[str], capsys) -> tuple[int, str, str]:
    """``main(argv)`` in this process: (exit status, stdout, stderr), whether it returns or exits."""
    try:
        status = main(argv)
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "flashattn_teach.cli", *argv]


def test_version_prints_the_package_version(capsys):
    status, out, err = outcome(["--version"], capsys)
    assert (status, err) == (0, "")
    assert out == f"flashattn-teach {flashattn_teach.__version__}\n"
    assert flashattn_teach.__version__ == version("flashattn-teach")


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--bogus"], "--bogus"), (["--bogus", "demo"], "--bogus"), (["-x", "replay"], "-x"), (["bogus"], "bogus")],
)
def test_unknown_top_level_options_and_commands_exit_2(argv, named, capsys):
    status, out, err = outcome(argv, capsys)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("flashattn-teach: error:") and named in err


def test_no_command_prints_help_without_importing_triton():
    code = (
        "import sys; from flashattn_teach.cli import main\n"
        "assert main([]) == 0\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "COMMAND" in done.stdout and all(name in done.stdout for name in ("demo", "replay", "kernels", "iomodel"))


# Each bad value, and the option the one-line message must name.
BAD_VALUES = [
    ("demo", "--seed 1e20", "--seed"),
    ("demo", f"--seed {2**64}", "--seed"),
    ("demo", f"--seed {-(2**63) - 1}", "--seed"),
    ("replay", "forward --seq-len -1", "--seq-len"),
    ("replay", "forward --seq-len 0", "--seq-len"),
    ("replay", "forward --head-dim 0", "--head-dim"),
    ("replay", "forward --block-m 0", "--block-m"),
    ("replay", "forward --block-n -3", "--block-n"),
    ("replay", "forward --batch 0", "--batch"),
    ("replay", "forward --batch-index -1", "--batch-index"),
    ("replay", "forward --batch 2 --batch-index 2", "--batch-index"),
    ("replay", "forward --query-block -1", "--query-block"),
    ("replay", "forward --query-block 3", "--query-block"),
    ("replay", "forward --seed 1.5", "--seed"),
    ("replay", "forward --scale nan", "--scale"),
    ("replay", "forward --scale inf", "--scale"),
    ("replay", "forward --dtype float8", "--dtype"),
    ("replay", "forward --order key-major", "--order"),
    ("replay", "forward --out /no/such/folder/replay.json", "--out"),
    ("replay", "forward --format png", "--format"),
    ("replay", "forward --format html --seq-len 300", "--format"),
    ("replay", "forward --format json --extensions --seq-len 3000", "--extensions"),
    ("replay", "forward --format png --out {tmp}/r.png --step 0", "--step"),
    ("replay", "forward --format png --out {tmp}/r.png --step 7", "--step"),
    ("iomodel", "--sram-kib nan", "--sram-kib"),
    ("iomodel", "--sram-kib inf", "--sram-kib"),
    ("iomodel", "--sram-kib -1", "--sram-kib"),
    ("iomodel", "--sram-kib 0", "--sram-kib"),
    ("iomodel", "--sram-kib 1e307", "--sram-kib"),
    ("iomodel", "--sram-kib 0.1", "--sram-kib"),
    ("iomodel", "--sram-kib 0.5", "--sram-kib"),
    ("iomodel", "--sram-kib 1", "--sram-kib"),
    ("iomodel", "--seq-len 0", "--seq-len"),
    ("iomodel", "--head-dim -1", "--head-dim"),
    ("iomodel", "--batch 0", "--batch"),
    ("iomodel", "--heads 0", "--heads"),
    ("iomodel", "--elem-bytes 0", "--elem-bytes"),
    ("iomodel", "--block-m 0", "--block-m"),
    ("iomodel", "--block-n 1.5", "--block-n"),
    ("kernels", "--head-dim 0", "--head-dim"),
    ("kernels", "--head-dim 48", "--head-dim"),
    ("kernels", "--arch sm70", "--arch"),
    ("kernels", "--dtype float64", "--dtype"),
    ("kernels", "--kernel bogus", "--kernel"),
    ("kernels", "--dtype float32 --head-dim 256", "--head-dim 256"),
]


@pytest.mark.parametrize(("subcommand", "options", "named"), BAD_VALUES)
def test_every_bad_value_is_one_line_naming_its_option_and_exit_2(subcommand, options, named, capsys, tmp_path):
    status, out, err = outcome([subcommand, *options.format(tmp=tmp_path).split()], capsys)
    subcommand += " forward" if subcommand == "replay" else ""  # its errors name the subcommand
    assert status == 2, err
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"flashattn-teach {subcommand}: error:"), err
    assert named in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--seed", "3"],
        ["replay", "forward", "--seq-len", "5", "--block-m", "2", "--block-n", "3", "--format", "json"],
        ["iomodel", "--seq-len", "1024", "--head-dim", "64", "--sram-kib", "100"],
    ],
)
def test_good_values_exit_0(argv, capsys):
    """The negative control of the test above: valid options run, print, and say nothing on stderr."""
    status, out, err = outcome(argv, capsys)
    assert (status, err) == (0, "") and out


@pytest.mark.parametrize(
    ("argv", "with_equals"),
    [
        (["--window", "-1,0"], ["--window=-1,0"]),
        (["--batch", "2", "--alibi", "-0.5,-1"], ["--batch", "2", "--alibi=-0.5,-1"]),
    ],
)
def test_a_value_that_starts_with_a_negative_number_is_a_value(argv, with_equals, capsys):
    """The help says -1 is an unbounded window side; ``--window -1,0`` must not read as an option ``-1,0``."""
    status, out, err = outcome(["replay", "forward", "--format", "json", *argv], capsys)
    assert (status, err) == (0, "")
    assert out == outcome(["replay", "forward", "--format", "json", *with_equals], capsys)[1]


def test_out_writes_only_the_named_file(tmp_path, capsys):
    out = tmp_path / "replay.json"
    assert outcome(["replay", "forward", "--format", "json", "--out", str(out)], capsys)[:2] == (0, "")
    assert json.loads(out.read_text(encoding="utf-8"))["kind"] == "schedule"
    assert [p.name for p in tmp_path.iterdir()] == ["replay.json"]


@pytest.mark.parametrize(
    ("argv", "read_lines"),
    [
        (["demo"], 0),
        (["replay", "forward", "--format", "json", "--seq-len", "2000"], 1),
        (["replay", "forward", "--seq-len", "2000"], 0),
    ],
)
def test_a_closed_pipe_ends_quietly(argv, read_lines):
    # Like ``flashattn-teach ... | head``: read a line (or nothing), then close the pipe while it writes.
    proc = subprocess.Popen(command(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    for _ in range(read_lines):
        assert proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    status = proc.wait(timeout=600)
    assert err == "", err
    assert status in (EXIT_SIGPIPE, 1)  # 1: rich ends the table itself, also quietly


def test_replay_far_beyond_an_n_by_n_matrix_runs_in_little_memory(tmp_path):
    """N = 100000: the N x N float64 scores alone would be 80 GB. The replay needs O(N D)."""
    N, D, block_n, i = 100_000, 4, 1000, 25_000
    out = tmp_path / "replay.json"
    options = f"--seq-len {N} --head-dim {D} --block-n {block_n} --query-block {i} --causal --order key_major"
    argv = command("replay", "forward", *options.split(), "--format", "json", "--out", str(out))
    # A fresh parent, so RUSAGE_CHILDREN sees only the replay (not earlier children of pytest).
    measure = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.stderr.write(done.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", measure, *argv], capture_output=True, text=True, timeout=600)
    status, peak_kib = map(int, done.stdout.split())
    assert status == 0, done.stderr
    assert peak_kib < 1024 * 1024, f"peak RSS {peak_kib / 1024:.0f} MiB"  # Linux reports KiB

    # The last update equals attention computed independently, for query row r0 = 2 i, from the same inputs.
    cases = json.loads(out.read_text(encoding="utf-8"))["cases"]
    r0 = 2 * i
    assert len(cases) == math.ceil((r0 + 2) / block_n)  # causal: key blocks up to the diagonal
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, N, D, dtype=torch.float64)[0, : r0 + 1].numpy() for _ in range(3))
    s = k @ q[r0] / math.sqrt(D)  # row r0 sees keys 0 .. r0
    p = np.exp(s - s.max())
    expected = p @ v / p.sum()
    last = {vector["label"]: vector["values"] for vector in cases[-1]["vectors"]}
    np.testing.assert_allclose(last[f"Final dense output · query {r0}"], expected, rtol=1e-10)
    np.testing.assert_allclose(last[f"Partial output · query {r0}"], expected, rtol=1e-10)
