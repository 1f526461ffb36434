"""Smoke tests of the benchmark scripts on a CPU: they run, write what the README documents, and on a machine
without CUDA the GPU suite says so and exits 0. Nothing here looks at a timing."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
# The columns benchmarks/README.md documents, in order.
CPU_COLUMNS = [
    "impl",
    "mode",
    "batch",
    "heads",
    "seq_len",
    "head_dim",
    "dtype",
    "threads",
    "repeats",
    "time_ms",
    "time_min_ms",
    "gflops",
    "peak_rss_mib",
    "baseline_rss_mib",
    "added_mib",
    "status",
    "cpu",
    "torch",
    "date",
]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def _env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**_env(), **env})


def test_bench_cpu_quick_writes_the_documented_csv(tmp_path):
    proc = _run(
        [
            sys.executable,
            str(BENCH / "bench_cpu.py"),
            "--quick",
            "--sizes",
            "128",
            "--impls",
            "dense",
            "online",
            "--modes",
            "fwd",
            "--threads",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "cpu.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == CPU_COLUMNS
    assert {(r["impl"], r["mode"], r["seq_len"], r["status"]) for r in rows} == {
        ("dense", "fwd", "128", "ok"),
        ("online", "fwd", "128", "ok"),
    }
    for r in rows:
        assert float(r["time_ms"]) > 0 and float(r["peak_rss_mib"]) > 0 and float(r["added_mib"]) >= 0
    assert (tmp_path / "cpu.json").exists()
    if _has("matplotlib"):
        assert (tmp_path / "cpu.png").stat().st_size > 0


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@no_cuda
def test_bench_attention_without_cuda_reports_it_and_exits_0(tmp_path):
    proc = _run([sys.executable, str(BENCH / "bench_attention.py"), "--trimmed", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    assert "CUDA is absent" in proc.stdout
    with open(tmp_path / "iomodel_grid.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 * 2 * 2 * 2 * 3  # bf16; D = 64, 128; causal and not; N = 2k, 8k; three passes
    assert {r["seq_len"] for r in rows} == {"2048", "8192"}


@no_cuda
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_suite_without_cuda_says_so_and_exits_0(tmp_path):
    proc = _run(["bash", str(BENCH / "run_gpu_suite.sh")], OUT=str(tmp_path), PYTHON=sys.executable)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CUDA is absent" in proc.stdout
    assert "standard (FA1 Alg. 0)" in (tmp_path / "iomodel.txt").read_text()
    assert (tmp_path / "bench" / "iomodel_grid.csv").exists()
