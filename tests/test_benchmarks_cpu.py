"""Smoke tests of the benchmark scripts on a CPU: they run, write what the README documents, and on a machine
without CUDA the GPU suite says so and exits 0. Nothing here looks at a timing."""

from __future__ import annotations

import csv
import json
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
    assert "planned total:" in proc.stdout  # the first light's plan (benchmarks/first_light.py --dry-run)
    assert "standard (FA1 Alg. 0)" in (tmp_path / "iomodel.txt").read_text()
    assert (tmp_path / "bench" / "iomodel_grid.csv").exists()


def test_bench_variants_quick_writes_its_rows(tmp_path):
    argv = ["--quick", "--min-time", "0", "--cases", "window", "varlen", "--impls", "ours", "sdpa"]
    proc = _run([sys.executable, str(BENCH / "bench_variants.py"), *argv, "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "variants.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["case"], r["impl"]) for r in rows] == [("window", "ours"), ("window", "sdpa"), ("varlen", "ours"),
                                                      ("varlen", "sdpa")]  # fmt: skip
    for r in rows:
        if r["case"] == "varlen" and r["impl"] == "ours" and r["status"].startswith("skipped"):
            continue  # flash_attention_varlen not there yet
        assert r["status"] == "ok", r
        assert float(r["time_ms"]) > 0 and float(r["peak_rss_mib"]) > 0 and float(r["added_mib"]) >= 0
    record = json.loads((tmp_path / "variants.json").read_text())
    assert {"cpu", "torch", "date"} <= set(record["machine"]) and len(record["rows"]) == len(rows)


def test_bench_variants_rows_compute_the_same_attention(monkeypatch):
    """Every row's call, built in this process at the quick sizes: ours, SDPA with its dense mask and the dense
    path agree, so the rows compare the same attention."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_variants
    import flashattn_teach

    for case in bench_variants.CASES:
        if case == "varlen" and not hasattr(flashattn_teach, "flash_attention_varlen"):
            continue
        outs = {impl: bench_variants.build(case, impl, bench_variants.QUICK)[1]() for impl in bench_variants.IMPLS}
        for impl in ("ours", "sdpa"):
            torch.testing.assert_close(outs[impl], outs["dense"], rtol=1e-4, atol=1e-5, msg=f"{case} {impl}")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's clear_refs")
def test_bench_variants_memory_probe_sees_a_freed_block_of_known_size():
    """The probe bench_variants uses, with a negative control: 64 MiB allocated and freed after the reset is
    seen as about 64 MiB of peak over the RSS before; nothing allocated is seen as about 0."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import torch\n"
        "from bench_variants import _peak_mib, _reset_peak, _rss_mib\n"
        "torch.ones(2**24); assert _reset_peak(); before = _rss_mib()\n"
        "idle = _peak_mib(True) - before\n"
        "x = torch.ones(2**24); del x\n"
        "print(idle, _peak_mib(True) - before)\n"
    )
    proc = _run([sys.executable, "-c", code, str(BENCH)], MALLOC_MMAP_THRESHOLD_="131072")
    assert proc.returncode == 0, proc.stderr
    idle, seen = map(float, proc.stdout.split())
    assert idle < 4 and 60 < seen < 70


def test_bench_gpu_variants_dry_run_fails_soft_and_checks_outputs(tmp_path):
    argv = ["--dry-run", "--cases", "window", "softcap", "--providers", "triton", "sdpa", "flex", "ours_flex"]
    argv += ["--passes", "fwd"]
    proc = _run([sys.executable, str(BENCH / "bench_gpu_variants.py"), *argv, "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {(r["case"], r["provider"]): r for r in json.loads((tmp_path / "variants.json").read_text())["rows"]}
    assert len(rows) == 8
    for case in ("window", "softcap"):  # this library's flex_attention with the same functions, uncompiled
        assert rows[(case, "ours_flex")]["status"] == "ok" and rows[(case, "ours_flex")]["max_err"] < 1e-5
    assert rows[("window", "sdpa")]["status"] == "ok" and rows[("window", "sdpa")]["max_err"] < 1e-5
    assert rows[("softcap", "sdpa")]["status"].startswith("not available: torch SDPA cannot cap scores")
    assert rows[("window", "triton")]["status"] != ""  # ok once the kernels have it; a status either way
    if _has("torch.nn.attention.flex_attention"):
        assert rows[("softcap", "flex")]["status"] == "ok" and rows[("softcap", "flex")]["max_err"] < 1e-5


@no_cuda
def test_bench_gpu_variants_without_cuda_says_so_and_exits_0(tmp_path):
    proc = _run([sys.executable, str(BENCH / "bench_gpu_variants.py"), "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    assert "CUDA is absent" in proc.stdout


def test_bench_decode_cpu_writes_its_rows(tmp_path):
    proc = _run([sys.executable, str(BENCH / "bench_decode.py"), "--cpu", "--providers", "ours", "sdpa-mask",
                 "--out", str(tmp_path)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "decode.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and {r["provider"] for r in rows} == {"ours", "sdpa-mask"}
    assert all(r["status"] == "ok" and float(r["time_ms"]) > 0 and float(r["gbps"]) > 0 for r in rows), rows
    assert (tmp_path / "decode.md").read_text().count("\n| ") == 4 + 1  # the header and one line per shape
    assert set(json.loads((tmp_path / "decode.json").read_text())["machine"]) >= {"cpu", "torch", "date"}


@no_cuda
def test_bench_decode_without_cuda_says_so_and_exits_0(tmp_path):
    proc = _run([sys.executable, str(BENCH / "bench_decode.py"), "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    assert "CUDA is absent" in proc.stdout


def test_bench_cpu_small_calls_writes_its_rows(tmp_path):
    """``--small-calls`` in a tiny mode: every case runs, idle and loaded, ours agrees with SDPA, and the
    targets table has one row per case and condition (no timing is looked at)."""
    argv = ["--small-calls", "--calls", "2", "--warmup", "1", "--block", "1", "--threads", "1", "--clock", "thread"]
    proc = _run([sys.executable, str(BENCH / "bench_cpu.py"), *argv, "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "cpu_small_calls.json").read_text())
    # the command that reruns these rows is written with them
    assert record["command"] == " ".join(["python benchmarks/bench_cpu.py", *argv, "--out", str(tmp_path)])
    assert f"Rerun: `{record['command']}`" in (tmp_path / "small_calls.md").read_text()
    assert "clock: thread" in (tmp_path / "small_calls.md").read_text()
    cases = ["flash_attention", "scaled_dot_product_attention", "kvcache_decode", "flash_attention_128",
             "host_overhead"]  # fmt: skip
    rows = record["small_calls"]
    assert [(r["case"], r["condition"]) for r in rows] == [(c, cond) for cond in ("idle", "loaded") for c in cases]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["calls"] == 2 and r["ours_us"] > 0
        if r["case"] != "host_overhead":
            assert r["sdpa_us"] > 0 and r["ratio"] > 0 and r["max_err"] < 1e-4, r
    assert len(record["targets"]) == 2 * len(cases)
    assert {t["unit"] for t in record["targets"]} == {"x", "us"}
    # two tables (targets, measurements), each a header and one line per case and condition
    assert (tmp_path / "small_calls.md").read_text().count("\n| ") == 2 * (1 + 2 * len(cases))
