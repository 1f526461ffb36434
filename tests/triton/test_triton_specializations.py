"""``flashattn-teach kernels --specializations``: a sample compiled for sm_90 with the installed triton (the
specialisations of the GQA decode-step backward whose one-kernel build crashed triton 3.6's ptxas), and every
specialisation the GPU tests and suite launch present in the committed table of this triton, so that the
table cannot fall behind the cases. Runs in subprocesses without ``TRITON_INTERPRET`` (the variable decides
how kernels are built for a whole process)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from flashattn_teach.tools.kernels import specializations as spec
from flashattn_teach.tools.kernels.cases import CASES, GpuCase, suite_calls
from sass_cache import AOT_PYTHON, aot_env

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "specializations"
CRASHED = GpuCase(torch.bfloat16, 64, 1, 300, causal=True, causal_align="bottom_right", B=2, group=4)


def _command(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = aot_env()
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    cli = [*AOT_PYTHON, "-m", "flashattn_teach.cli", "kernels", "--specializations", "--cache", str(tmp_path)]
    return subprocess.run([*cli, *args], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_the_crashed_case_is_one_of_the_gpu_cases_and_the_suite_calls() -> None:
    assert CRASHED in CASES
    assert f"tests-{CRASHED.name}" in [c.name for c in suite_calls()]


def test_the_gqa_decode_step_backward_compiles_for_sm90_without_spills_in_a_loop(tmp_path: Path) -> None:
    out = tmp_path / "sample.json"
    done = _command("--arch", "sm90", "--calls", f"tests-{CRASHED.name}", "--json", str(out), tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    kernels = sorted(r["kernel"] for r in rows)
    # N_q = 1 fills no 64-row one-kernel tile: the two backward kernels run
    assert kernels == ["backward_dkdv", "backward_dq", "backward_preprocess", "forward"], kernels
    for r in rows:
        assert r["error"] is None and not r["loop_local"], r
        assert 0 < r["smem_bytes"] <= spec.SMEM_OPT_IN["sm90"] and r["registers"] <= 255, r
        assert r["constants"].get("N_q") == "1" or r["kernel"] == "backward_preprocess", r["constants"]


def _committed() -> Path:
    import triton

    path = RESULTS / f"triton-{triton.__version__}.json"
    if not path.exists():
        pytest.skip(f"no committed table for triton {triton.__version__} in {RESULTS}")
    return path


def test_every_captured_specialisation_is_in_the_committed_table(tmp_path: Path) -> None:
    path = _committed()
    done = _command("--arch", "sm90", "sm80", "--check", str(path), tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " of " in done.stdout


def documented_loop_spill(r: dict) -> bool:
    """The spills in a loop triton/configs.py names as remaining: head dims that fill their padded lanes only in
    part (40 of 64, 100 of 128), and sm_80's hd128 forward at N_q = 1."""
    if r["head_dim"] in (40, 100):
        return True
    return (r["arch"], r["kernel"], r["head_dim"], r["constants"].get("N_q")) == ("sm80", "forward", 128, "1")


@pytest.mark.parametrize("version", ["3.6.0", "3.9.0"])
def test_the_committed_tables_have_no_compile_failure_and_no_undocumented_spill_in_a_loop(version: str) -> None:
    path = RESULTS / f"triton-{version}.json"
    doc = json.loads(path.read_text())
    assert doc["triton"] == version and {r["arch"] for r in doc["rows"]} == {"sm90", "sm80"}
    failed = [(r["kernel"], r["arch"], r["check"], r["calls"][0]) for r in doc["rows"] if r["error"]]
    assert not failed
    rows = [r for r in doc["rows"] if r["loop_local"] and not documented_loop_spill(r)]
    assert [(r["kernel"], r["arch"], r["check"], r["calls"][0]) for r in rows] == []
    assert all(r["smem_bytes"] <= spec.SMEM_OPT_IN[r["arch"]] for r in doc["rows"])


def test_a_ptxas_crash_is_reported_by_its_signal_not_its_repro_command() -> None:
    # triton 3.6's PTXASError for the hd64 GQA N_q = 1 one-kernel backward, as it was (error code -11: SIGSEGV)
    message = "PTXAS error: `ptxas` failed with error code -11\n`ptxas` stderr:\n\nRepro command: ptxas -v x.ptx\n"
    got = spec._last_line(RuntimeError(message))
    assert got == "RuntimeError: PTXAS error: `ptxas` failed with error code -11"


def test_a_compile_that_killed_its_process_is_recorded_on_the_rerun(tmp_path: Path) -> None:
    class Stub:
        key = "0123456789abcdef"

    path = tmp_path / spec._triton_version() / "sm90" / f"{Stub.key}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pending": True}))  # what cached_compile leaves while it compiles
    result = spec.cached_compile(Stub(), "sm90", tmp_path)  # type: ignore[arg-type]
    assert result["error"] == "the compiling process died (no exception)"
    assert json.loads(path.read_text())["pending"] is False
