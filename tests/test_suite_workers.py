"""tests/conftest.py runs the whole suite (a plain ``pytest``) on two xdist workers, one file to a worker, and a
run that names files in one process, the compile files first, every process waiting for OpenMP passively.
Checked on small projects that use this conftest."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

PROBE = """
import os

def test_{name}_one():
    # what this process's torch and numpy read when they loaded OpenMP and OpenBLAS
    policy = [os.environ.get(name, "unset") for name in ("OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS")]
    with open(os.environ["POLICY_FILE"], "a") as f:
        f.write(" ".join(policy) + "\\n")

def test_{name}_two():
    pass
"""


def _run(project: Path, *args: str, **extra: str) -> dict[str, str]:
    """``pytest ARGS`` in ``project`` (environment: this one's less pytest's, hypothesis's and OpenMP's, plus
    ``extra``): test name -> the worker that ran it ("none": the main process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_", "OMP_", "OPENBLAS_"))}
    env.update(POLICY_FILE=str(project / "policy.txt"), **extra)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", *args]
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    workers: dict[str, str] = {}
    for line in done.stdout.splitlines():
        # -v: "[gw0] PASSED tests/test_a.py::test_a_one" on a worker, "tests/test_a.py::test_a_one PASSED" without
        if "PASSED" in line and "::" in line:
            name = line.split("::")[-1].split()[0]
            workers[name] = line.split("]")[0].lstrip("[") if line.startswith("[gw") else "none"
    assert len(workers) == 4, done.stdout
    return workers


@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="pytest-xdist is not installed")
def test_the_whole_suite_runs_on_two_workers_one_file_each(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    shutil.copy(HERE / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    for name in ("a", "b"):
        (tmp_path / "tests" / f"test_{name}.py").write_text(PROBE.format(name=name))

    whole = _run(tmp_path)
    assert set(whole.values()) <= {"gw0", "gw1"}, whole
    assert whole["test_a_one"] == whole["test_a_two"] and whole["test_b_one"] == whole["test_b_two"], whole
    # the workers wait for OpenMP passively and run OpenBLAS on one thread (conftest's docstring: why)
    assert (tmp_path / "policy.txt").read_text().splitlines() == ["PASSIVE 1", "PASSIVE 1"]

    # one process; what the environment sets is kept
    (tmp_path / "policy.txt").unlink()
    named = _run(tmp_path, "tests/test_a.py", "tests/test_b.py", OMP_WAIT_POLICY="ACTIVE", OPENBLAS_NUM_THREADS="2")
    assert set(named.values()) == {"none"}
    assert (tmp_path / "policy.txt").read_text().splitlines() == ["ACTIVE 2", "ACTIVE 2"]


ORDER_PROBE = """
import json, os

def test_{name}_writes_the_order(request):
    with open(os.environ["ORDER_FILE"], "a") as f:
        f.write(json.dumps([item.nodeid for item in request.session.items]) + "\\n")
{more}
"""


@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="pytest-xdist is not installed")
def test_the_workers_take_the_compile_files_first_then_the_larger_files(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "triton").mkdir(parents=True)
    shutil.copy(HERE / "conftest.py", tests / "conftest.py")
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    # alphabetically and by size the compile file would come last; test_b.py has more tests than test_a.py
    files = {"test_a.py": 1, "test_b.py": 3, "triton/test_triton_compile.py": 0}
    for path, more in files.items():
        extra = "".join(f"\ndef test_{n}():\n    pass\n" for n in range(more))
        (tests / path).write_text(ORDER_PROBE.format(name=Path(path).stem, more=extra))
    order_file = tmp_path / "order.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HYPOTHESIS_"))}
    env["ORDER_FILE"] = str(order_file)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    orders = {line for line in order_file.read_text().splitlines()}
    assert len(orders) == 1, orders  # every worker sorted alike
    files_in_order = list(dict.fromkeys(nodeid.split("::")[0] for nodeid in json.loads(orders.pop())))
    assert files_in_order == ["tests/triton/test_triton_compile.py", "tests/test_b.py", "tests/test_a.py"]
