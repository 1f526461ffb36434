"""benchmarks/estimates.py puts the loop profile's estimate of each pass beside the measured Triton rows."""

from __future__ import annotations

import csv
import importlib
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

LOOPS = """\
forward  bfloat16    64 ... a table row, not an estimate
# forward  bfloat16  D=64     365 TFLOP/s estimated
# backward bfloat16  D=128    313 TFLOP/s estimated
"""
FIELDS = ("provider", "dtype", "head_dim", "causal", "seq_len", "pass", "status", "tflops")
ROWS = [
    ("triton", "bf16", "64", "False", "8192", "fwd", "ok", "373.4"),
    ("triton-det", "bf16", "128", "False", "8192", "bwd", "ok", "250.2"),
    ("triton", "bf16", "64", "True", "8192", "fwd", "ok", "300"),  # causal: left out
    ("triton", "bf16", "64", "False", "2048", "fwd", "ok", "390"),  # another N: left out
    ("sdpa-flash", "bf16", "64", "False", "8192", "fwd", "ok", "400"),  # not ours: left out
    ("triton", "bf16", "64", "False", "8192", "fwd+bwd", "ok", "320"),  # no estimate of its own: left out
    ("triton-nows", "bf16", "64", "False", "8192", "fwd", "error: TypeError: boom", ""),
]


def test_estimates_stand_beside_the_measured_rows(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    estimates = importlib.import_module("estimates")
    (tmp_path / "loops.txt").write_text(LOOPS)
    with open(tmp_path / "attention.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        w.writerows(ROWS)
    assert estimates.main([str(tmp_path / "loops.txt"), str(tmp_path / "attention.csv")]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert lines == [
        ["forward", "bfloat16", "64", "triton", "365", "373"],
        ["backward", "bfloat16", "128", "triton-det", "313", "250"],
        ["forward", "bfloat16", "64", "triton-nows", "365", "error:", "TypeError:", "boom"],
    ]
