"""``flashattn-teach ladder``: on a CPU every rung runs (the kernels in Triton's interpreter) and agrees with
float64 dense; the table has a row per rung and fits 80 columns; its bytes are the papers' counts; a broken
rung fails the command and is the one named; without triton the kernel rungs are one line each, the CPU rungs
still run and the command exits 0."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashattn_teach import ladder
from flashattn_teach.cli import main

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["dense", "query-major loop", "key-major loop", "tutorial kernel", "production kernel"]
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs the [triton] extra")
# a row that ran: number, name, BLOCK_M x BLOCK_N = held, bytes and unit, share of dense, time, the two diffs
RAN = re.compile(
    r"^(\d) ([a-z -]+?) +(\d+)x(\d+)=(\d+) +([\d.]+) (B|KiB|MiB) ([\d.]+)x +(interp\.\*|\S+ \S+) +(\S+) +(\S+)$"
)
NOT_RUN = re.compile(r"^(\d) ([a-z -]+?) +- +- +not run +- +-$")
UNIT = {"B": 1, "KiB": 1024, "MiB": 1024**2}


@dataclasses.dataclass
class Row:
    number: int
    name: str
    held: tuple[int, int] | None = None  # (BLOCK_M, BLOCK_N), (N, N) for dense
    kib: float = 0.0
    time: str = ""
    vs_previous: float | None = None
    vs_oracle: float = math.nan


def outcome(argv: list[str], capsys) -> tuple[int, str]:
    status = main(["ladder", *argv])
    captured = capsys.readouterr()
    assert captured.err == "", captured.err
    return status, captured.out


def rows(out: str) -> list[Row]:
    found = []
    for line in out.splitlines():
        if m := RAN.match(line):
            bm, bn, held = int(m[3]), int(m[4]), int(m[5])
            assert bm * bn == held, line
            found.append(
                Row(
                    int(m[1]),
                    m[2],
                    (bm, bn),
                    float(m[6]) * UNIT[m[7]] / 1024,
                    m[9],
                    None if m[10] == "-" else float(m[10]),
                    float(m[11]),
                )
            )
        elif m := NOT_RUN.match(line):
            found.append(Row(int(m[1]), m[2]))
    return found


def standard_bytes(B: int, H: int, N: int, d: int, elem: int) -> int:
    """FA1 Theorem 2's standard attention (Alg. 0): S and P written and read back, ``4 N^2 + 4 N d``."""
    return B * H * (4 * N * N + 4 * N * d) * elem


def query_major_bytes(B: int, H: int, N: int, d: int, elem: int, block_m: int) -> int:
    """FA2 Alg. 1 without a mask: Q and O once, K and V once per query block, lse (float32) once."""
    T_r = math.ceil(N / block_m)
    return B * H * ((2 * N * d + 2 * T_r * N * d) * elem + 4 * N)


@needs_triton
@pytest.mark.parametrize("causal", [False, True])
def test_every_rung_runs_on_the_cpu_and_agrees_with_float64_dense(causal, capsys):
    from flashattn_teach.triton import TEST_CONFIG

    argv = ["--n", "77", "--d", "32", "--block-m", "16", "--block-n", "32", "--repeats", "1"]
    status, out = outcome(argv + ["--causal"] * causal, capsys)
    assert status == 0, out
    table = rows(out)
    assert [(r.number, r.name) for r in table] == list(enumerate(NAMES, start=1)), out
    assert all(r.held is not None for r in table), "a rung did not run:\n" + out
    assert all(r.vs_oracle < 2e-5 for r in table), out
    assert table[0].vs_previous is None and all(r.vs_previous < 4e-5 for r in table[1:]), out
    # what each holds: dense every score, the loops and the tutorial kernel the tile asked for, the production
    # kernel its test tile
    assert table[0].held == (77, 77) and table[1].held == table[2].held == table[3].held == (16, 32)
    assert table[4].held == (TEST_CONFIG.forward.BLOCK_M, TEST_CONFIG.forward.BLOCK_N)
    n_held = [r.held[0] * r.held[1] for r in table]
    assert all(n < n_held[0] for n in n_held[1:])
    # CPU rungs timed, kernels in the interpreter not
    assert all(r.time != "interp.*" for r in table[:3]) and all(r.time == "interp.*" for r in table[3:])
    assert "interpreter: not timed; timed by benchmarks/run_gpu_suite.sh on a GPU" in " ".join(out.split())
    assert "check: ok, 5 of 5 rungs" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_the_bytes_are_the_papers_counts(capsys):
    status, out = outcome(["--n", "113", "--d", "64", "--block-m", "32", "--block-n", "32", "--repeats", "1"], capsys)
    assert status == 0, out
    dense, query_major, key_major, *_ = rows(out)
    assert dense.kib == pytest.approx(standard_bytes(1, 2, 113, 64, 4) / 1024, abs=0.05)
    assert query_major.kib == pytest.approx(query_major_bytes(1, 2, 113, 64, 4, 32) / 1024, abs=0.05)
    # key-major re-reads and rewrites O_i, l_i, m_i for every key block: more than query-major moves
    assert key_major.kib > query_major.kib


def _broken(name: str, which: str, monkeypatch) -> None:
    """Rung ``name`` with ``O`` (or ``lse``) off by 1e-2 everywhere."""
    build = ladder.RUNGS[name]

    def broken_build(x: ladder.Inputs) -> ladder.Rung | str:
        rung = build(x)
        assert not isinstance(rung, str), rung

        def forward(q, k, v):
            O, lse = rung.forward(q, k, v)
            return (O + 1e-2, lse) if which == "O" else (O, lse + 1e-2)

        return dataclasses.replace(rung, forward=forward)

    monkeypatch.setitem(ladder.RUNGS, name, broken_build)


@pytest.mark.parametrize("which", ["O", "lse"])
def test_a_broken_rung_fails_the_command_and_is_the_one_named(which, monkeypatch, capsys):
    _broken("key-major loop", which, monkeypatch)
    status, out = outcome(["--n", "40", "--d", "16", "--block-m", "16", "--block-n", "16", "--repeats", "1"], capsys)
    assert status == 1, out
    assert f"rung 3 key-major loop: max |{which} - float64 dense| = 1.0e-02, beyond 2e-05" in out
    # the rungs after it are compared with rung 2, the last that passed: only rung 3 is named
    assert set(re.findall(r"^rung (\d) .*beyond", out, flags=re.MULTILINE)) == {"3"}
    assert "check: FAILED" in out


def test_without_triton_the_kernel_rungs_are_one_line_each_and_the_cpu_rungs_run(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    status, out = outcome(["--n", "50", "--d", "16", "--repeats", "1"], capsys)
    assert status == 0, out
    for n, name in ((4, "tutorial kernel"), (5, "production kernel")):
        assert f"rung {n} {name}: needs triton: pip install 'flashattn-teach[triton]'\n" in out
    table = rows(out)
    assert [r.number for r in table] == [1, 2, 3, 4, 5]
    assert all(r.held is not None and r.vs_oracle < 2e-5 for r in table[:3]), out
    assert all(r.held is None for r in table[3:]), out
    assert "check: ok, 3 of 5 rungs" in out and "Traceback" not in out


@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(), reason="needs triton and a machine without CUDA")
def test_the_command_sets_the_interpreter_itself_without_cuda():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    argv = ["-m", "flashattn_teach.cli", "ladder", "--n", "33", "--d", "16", "--repeats", "1"]
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(no CUDA device: TRITON_INTERPRET=1 set here)" in done.stdout
    assert all(r.held is not None for r in rows(done.stdout)), done.stdout


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ("--n 0", "--n"),
        ("--d -1", "--d"),
        ("--block-m 0", "--block-m"),
        ("--block-n 24", "--block-n"),
        ("--dtype float8", "--dtype"),
    ],
)
def test_a_bad_value_is_one_line_naming_its_option(options, named, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["ladder", *options.split()])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and named in err, err


def test_two_rungs_may_differ_by_the_sum_of_their_tolerances():
    """On a GPU the tutorial kernel multiplies float32 in TF32 (float16's tolerance) and the production kernel
    after it in tf32x3 (float32's): their difference is judged by the two tolerances together."""
    loose, tight = ladder.TOLERANCE[torch.float16], ladder.TOLERANCE[torch.float32]
    tutorial = ladder.Step(4, "tutorial kernel", tolerance=loose, vs_oracle=1e-3, lse_vs_oracle=1e-3)

    def production(vs_previous: float) -> ladder.Step:
        return ladder.Step(5, "production kernel", tolerance=tight, vs_previous=vs_previous, previous_tolerance=loose)

    assert ladder.failures([tutorial, production(1e-3)]) == []
    assert ladder.failures([tutorial, production(2 * loose)]) == [
        f"rung 5 production kernel: max |O - previous rung| = {2 * loose:.1e}, beyond {loose + tight:.0e}"
    ]
    assert ladder.failures([ladder.Step(1, "dense", tolerance=tight, vs_oracle=math.nan)])  # NaN fails
