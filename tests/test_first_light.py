"""The first light's machinery on a CPU, with simulated faults (tests/first_light_fakes.py): a hang is HANG
and its process group is killed, an exception and a dead process are ERROR, a wrong answer FAIL with its
error and bound, and the rest still runs; the dry run of the real case list plans at most 300 s."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
FAKES = str(REPO / "tests" / "first_light_fakes.py")
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO / "tests"))

import first_light_fakes as fakes  # noqa: E402
from first_light_runner import run_groups  # noqa: E402


def groups(*names: str):
    return [g for g in fakes.GROUPS if g.name in names]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for init to reap it does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), **extra}


def test_every_fault_is_reported_and_the_rest_still_runs(tmp_path, monkeypatch) -> None:
    pidfile = tmp_path / "child.pid"
    monkeypatch.setenv(fakes.PIDFILE, str(pidfile))
    start = time.monotonic()
    outcomes = run_groups(FAKES, groups("faults", "second"), budget_s=60)
    took = time.monotonic() - start
    by_name = {o.case: o for o in outcomes}
    assert [(o.group, o.case) for o in outcomes] == [
        (g.name, c.name) for g in groups("faults", "second") for c in g.cases
    ]
    assert {n: o.status for n, o in by_name.items()} == {
        "right-before": "PASS",
        "sleeps": "HANG",
        "after-hang": "PASS",
        "raises": "ERROR",
        "aborts": "ERROR",
        "after-abort": "PASS",
        "off": "FAIL",
        "skips": "SKIP",
        "right": "PASS",
    }
    hang = by_name["sleeps"]
    assert fakes.HANG_TIMEOUT_S <= hang.seconds < fakes.HANG_TIMEOUT_S + 5 and took < 30
    assert "timeout" in hang.detail and "killed" in hang.detail
    assert "illegal memory access" in by_name["raises"].detail  # the exception's last lines
    assert "SIGABRT" in by_name["aborts"].detail and "about to abort" in by_name["aborts"].detail
    off = by_name["off"]
    assert "O: error 0.004 > bound 0.002" in off.detail
    assert {e["output"]: (e["err"], e["bound"]) for e in off.errors} == {"O": (0.004, 0.002), "lse": (1e-6, 1e-4)}
    assert by_name["skips"].detail == "no FP8 on this card (simulated sm_80)"
    # the hung case's child (a ptxas, say) went with its process group
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)


def test_a_part_whose_budget_runs_out_is_cut_and_says_so() -> None:
    start = time.monotonic()
    outcomes = run_groups(FAKES, groups("slow"), budget_s=2)
    assert time.monotonic() - start < 10
    first, never = outcomes
    assert (first.status, never.status) == ("SKIP", "SKIP")
    assert "budget ran out while it ran" in first.detail
    assert "not run" in never.detail


def test_a_group_shares_one_process_and_the_precompile_gives_each_case_its_own() -> None:
    shared = run_groups(FAKES, groups("pids"), budget_s=30)
    warmed = run_groups(FAKES, groups("pids"), budget_s=30, jobs=2, warm=True)
    assert [o.status for o in shared + warmed] == ["PASS", "ERROR", "PASS"] * 2
    assert shared[0].data["pid"] == shared[2].data["pid"]  # an ordinary exception keeps the process
    assert warmed[0].data["pid"] != warmed[2].data["pid"]


def test_after_an_exception_the_rest_of_the_group_runs_in_a_fresh_process() -> None:
    """A CUDA error (an illegal memory access) is sticky: nothing after it in that process could pass."""
    before, raised, after = run_groups(FAKES, groups("sticky"), budget_s=30)
    assert (before.status, raised.status, after.status) == ("PASS", "ERROR", "PASS")
    assert raised.detail.startswith("RuntimeError: CUDA error: an illegal memory access")
    assert before.data["pid"] != after.data["pid"]


def test_the_command_writes_its_tables_and_fails_on_a_fault(tmp_path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / "first_light.py"), "--cases-module", FAKES, "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env(), cwd=REPO)
    assert run.returncode == 1, run.stdout + run.stderr  # a FAIL, an ERROR and a HANG among the cases
    record = json.loads((out / "first-light.json").read_text())
    assert {"date", "torch", "triton", "python"} <= set(record["machine"])
    statuses = {o["case"]: o["status"] for o in record["results"]["correctness"]}
    assert statuses["sleeps"] == "HANG" and statuses["off"] == "FAIL" and statuses["right"] == "PASS"
    assert record["results"]["timings"][0]["data"] == {"fwd_ms": 1.25, "fwd_tflops": 500.0}
    table = (out / "first-light.txt").read_text()
    assert re.search(r"HANG\s+[\d.]+\s+faults/sleeps", table)
    assert re.search(r"row\s+1\.25\s+500\.00\s+-\s+-\s+PASS", table)


def test_the_dry_run_plans_every_group_within_five_minutes() -> None:
    cmd = [sys.executable, str(BENCH / "first_light.py"), "--dry-run"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env(), cwd=REPO)
    assert run.returncode == 0, run.stderr
    total = float(re.search(r"planned total: (\d+) s", run.stdout).group(1))
    parts = [float(s) for s in re.findall(r"^(?:precompile|correctness|timings|report): (\d+) s", run.stdout, re.M)]
    assert len(parts) == 4 and sum(parts) == total and total <= 300
    for group in ("bf16-hd64", "fp32", "masks", "decode", "fp8", "deterministic", "cuda-graph", "warp-specialised"):
        assert f"  {group}: " in run.stdout
    assert "FLASHATTN_TEACH_WARP_SPECIALIZE=1" in run.stdout


def test_case_names_are_unique_within_each_group() -> None:
    """The worker finds a group's cases by name: two of one name would run twice and report once."""
    from first_light_runner import load_cases

    module = load_cases(str(BENCH / "first_light_cases.py"))
    for g in module.GROUPS:
        names = [c.name for c in g.cases]
        assert len(names) == len(set(names)), g.name
    assert len({g.name for g in module.GROUPS}) == len(module.GROUPS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the real run would start")
def test_without_cuda_the_real_run_prints_one_line_and_exits_0(tmp_path) -> None:
    cmd = [sys.executable, str(BENCH / "first_light.py"), "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env(), cwd=REPO)
    assert run.returncode == 0
    assert run.stdout.strip().splitlines() == [
        "no CUDA: dry run only (python benchmarks/first_light.py --dry-run prints the plan)"
    ]
    assert not any(tmp_path.iterdir())


def test_a_precompile_case_may_compile_for_the_whole_budget() -> None:
    """Compiling alongside many others is slow, not hung: the precompile cuts at its budget, not at 1.5 s."""
    outcomes = {o.case: o for o in run_groups(FAKES, groups("faults"), budget_s=4, jobs=8, warm=True)}
    assert outcomes["sleeps"].status == "SKIP" and "budget ran out while it ran" in outcomes["sleeps"].detail
    assert outcomes["sleeps"].seconds > 3
    assert outcomes["right-before"].status == "PASS" and outcomes["off"].status == "FAIL"
