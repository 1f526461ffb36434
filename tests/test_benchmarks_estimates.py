"""benchmarks/estimates.py puts the loop profile's estimate of each pass, and what it rests on, beside the
measured Triton rows: the warp-specialised forward's as uncalibrated, each backward's beside the backward
that provider runs (two kernels for ``triton-det``, the one-kernel backward for the others), no forward
estimate beside a provider that runs another forward, and "not measured" where the GPU run failed."""

from __future__ import annotations

import csv
import importlib
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

LOOPS = """\
forward  bfloat16    64 ... a table row, not an estimate
# forward  bfloat16  D=64     609 TFLOP/s estimated, uncalibrated: warp-specialised, factor 0.75 borrowed (no overlap of its consumers: 335)
# backward bfloat16  D=128    313 TFLOP/s estimated, calibrated on the H200 2026-11-30, non-specialised kernels, two kernels
# backward bfloat16  D=128    390 TFLOP/s estimated, calibrated on the H200 2026-11-30, non-specialised kernels, one kernel (dQ by atomics, their cost assumed)
# forward  bfloat16  D=128    490 TFLOP/s estimated
"""  # noqa: E501  (the last line: a loop profile from before the basis was printed)
FIELDS = ("provider", "dtype", "head_dim", "causal", "seq_len", "pass", "status", "tflops")
ROWS = [
    ("triton", "bf16", "64", "False", "8192", "fwd", "ok", "373.4"),
    ("triton-det", "bf16", "128", "False", "8192", "bwd", "ok", "250.2"),
    ("triton", "bf16", "128", "False", "8192", "bwd", "ok", "330.0"),
    ("triton", "bf16", "128", "False", "8192", "fwd", "ok", "500.0"),
    ("triton", "bf16", "64", "True", "8192", "fwd", "ok", "300"),  # causal: left out
    ("triton", "bf16", "64", "False", "2048", "fwd", "ok", "390"),  # another N: left out
    ("sdpa-flash", "bf16", "64", "False", "8192", "fwd", "ok", "400"),  # not ours: left out
    ("triton", "bf16", "64", "False", "8192", "fwd+bwd", "ok", "320"),  # no estimate of its own: left out
    ("triton-nows", "bf16", "64", "False", "8192", "fwd", "error: TypeError: boom", ""),
]


def test_estimates_stand_labelled_beside_the_measured_rows(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    estimates = importlib.import_module("estimates")
    (tmp_path / "loops.txt").write_text(LOOPS)
    with open(tmp_path / "attention.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        w.writerows(ROWS)
    assert estimates.main([str(tmp_path / "loops.txt"), str(tmp_path / "attention.csv")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[4:7] == ["estimate", "basis", "measured"]
    rows = [line.split() for line in out[1:] if not line.startswith("#")]
    assert rows == [
        ["forward", "bfloat16", "64", "triton", "609", "uncalibrated", "373"],
        ["backward", "bfloat16", "128", "triton-det", "313", "calibrated", "250"],
        ["backward", "bfloat16", "128", "triton", "390", "calibrated", "330"],
        ["forward", "bfloat16", "128", "triton", "490", "calibrated", "500"],
        # the forward without warp specialisation is another kernel: no estimate beside it
        ["forward", "bfloat16", "64", "triton-nows", "-", "-", "not", "measured:", "error:", "TypeError:", "boom"],
    ]
    footer = [line for line in out if line.startswith("# ")]
    uncalibrated = "# uncalibrated, as the loop profile printed it: uncalibrated: warp-specialised"
    assert any(line.startswith(uncalibrated) for line in footer), footer
    assert any("one kernel (dQ by atomics, their cost assumed)" in line for line in footer), footer
