"""Smoke test of benchmarks/decode_paged_cpu.py: it runs, every layout gives the contiguous cache's output,
and it writes its JSON with the machine and the load. Nothing here looks at a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_decode_paged_cpu_writes_its_rows(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "decode_paged_cpu.py"), "--length", "512", "--repeats", "2",
           "--threads", "1", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "decode_paged_cpu.json").read_text())
    assert [r["layout"] for r in record["rows"]] == ["contiguous", "paged-16", "paged-256", "paged-16-fa"]
    assert all(r["max_diff_vs_contiguous"] < 1e-5 for r in record["rows"])
    assert {"cpu", "torch", "date"} <= set(record["machine"]) and len(record["load"]) == 2
