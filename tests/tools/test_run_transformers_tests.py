"""The logic of tools/run_transformers_tests.py, without transformers' test suite or the network.

The comparison is fed made-up runs: a test that passes with transformers' SDPA and fails with the library
must be reported and fail the script, and so must a library run that made no call of the library, however
green. The plugin runs in a real pytest session over a few made-up tests, against a stand-in ``transformers``
package that has only what the plugin touches, so its outcomes and call counts are checked against what
the tests did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"


@pytest.fixture
def tools(monkeypatch):
    """The tools/ modules, imported as the script imports them (tools/ first on sys.path)."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import run_transformers_tests
    import transformers_outcomes

    return transformers_outcomes, run_transformers_tests


def _report(outcomes, *, library: bool, calls: int, **tests: str):
    return outcomes.RunReport(
        library=library,
        transformers_version="5.2.0",
        transformers_file="transformers/__init__.py",
        calls=calls,
        tests={node: outcomes.TestResult(outcomes.Outcome(o), f"error in {node}" * (o == "failed"), 1)
               for node, o in tests.items()},
    )  # fmt: skip


def test_a_test_passing_with_sdpa_and_failing_with_the_library_is_a_regression(tools):
    outcomes, _ = tools
    baseline = _report(outcomes, library=False, calls=9, a="passed", b="passed", c="failed", d="passed", e="skipped")
    library = _report(outcomes, library=True, calls=9, a="passed", b="failed", c="passed", d="skipped", e="skipped")
    comparison = outcomes.compare(baseline, library)
    assert [(r.node, r.baseline, r.library, r.message) for r in comparison.regressions] == [
        ("b", outcomes.Outcome.PASSED, outcomes.Outcome.FAILED, "error in b")
    ]
    assert comparison.fixed == ["c"] and comparison.changed == ["d: passed -> skipped"]
    assert outcomes.problems(baseline, library, comparison) == [
        "1 tests pass with transformers' SDPA and fail with flashattn_teach"
    ]
    # Negative control: the same outcomes in both runs are no problem at all.
    same = outcomes.compare(baseline, _report(outcomes, library=True, calls=9, a="passed", b="passed", c="failed",
                                              d="passed", e="skipped"))  # fmt: skip
    assert same.regressions == same.fixed == same.changed == []


def test_a_test_the_library_run_never_reached_is_a_regression(tools):
    outcomes, _ = tools
    baseline = _report(outcomes, library=False, calls=3, a="passed", b="passed", c="failed")
    library = _report(outcomes, library=True, calls=3, a="passed")  # stopped after a
    regressions = outcomes.compare(baseline, library).regressions
    assert [(r.node, r.library) for r in regressions] == [("b", None)]  # c failed anyway: not a regression


def test_a_library_run_that_never_reached_the_library_fails_however_green(tools):
    outcomes, _ = tools
    baseline = _report(outcomes, library=False, calls=5, a="passed")
    library = _report(outcomes, library=True, calls=0, a="passed")
    found = outcomes.problems(baseline, library, outcomes.compare(baseline, library))
    assert len(found) == 1 and "never reached the library" in found[0]
    library.calls = 1
    assert outcomes.problems(baseline, library, outcomes.compare(baseline, library)) == []
    swapped = outcomes.problems(library, baseline, outcomes.compare(library, baseline))
    assert any("swapped" in p for p in swapped)


def test_a_regression_that_fails_with_sdpa_too_on_a_rerun_is_flaky_and_fails_nothing(tools):
    outcomes, _ = tools
    baseline = _report(outcomes, library=False, calls=4, a="passed", b="passed", c="passed")
    library = _report(outcomes, library=True, calls=4, a="failed", b="failed", c="failed")
    first = outcomes.compare(baseline, library)
    again = outcomes.recheck(
        first,
        _report(outcomes, library=False, calls=3, a="passed", b="failed", c="passed"),
        _report(outcomes, library=True, calls=3, a="failed", b="failed", c="passed"),
    )
    assert [(r.node, r.reproduced) for r in again.regressions] == [("a", True), ("c", False)]
    assert [r.node for r in again.flaky] == ["b"]
    assert outcomes.problems(baseline, library, again) == [
        "2 tests pass with transformers' SDPA and fail with flashattn_teach"
    ]


def _fake_checkout(path: Path, version: str, models=("llama",)) -> Path:
    (path / "setup.py").write_text(f'setup(\n    name="transformers",\n    version="{version}",  # x.y.z\n)\n')
    for m in models:
        (path / "tests" / "models" / m).mkdir(parents=True)
        (path / "tests" / "models" / m / f"test_modeling_{m}.py").write_text("")
    return path


def test_a_checkout_of_another_version_or_without_tests_is_refused(tools, tmp_path):
    _, runner = tools
    repo = _fake_checkout(tmp_path, "5.24.0")
    with pytest.raises(SystemExit, match=r"is transformers 5.24.0 but 5.2.0 is installed.*checkout v5.2.0"):
        runner.check_checkout(repo, "5.2.0", ("llama",))
    with pytest.raises(SystemExit, match="lacks tests/models"):
        runner.check_checkout(repo, "5.24.0", ("llama", "qwen2"))
    assert runner.check_checkout(repo, "5.24.0", ("llama",)) == [repo / "tests/models/llama/test_modeling_llama.py"]


def test_main_exits_1_and_lists_the_regression_and_0_when_the_runs_agree(tools, tmp_path, monkeypatch, capsys):
    outcomes, runner = tools
    monkeypatch.setattr(runner, "installed_transformers", lambda: "5.2.0")
    (tmp_path / "hf").mkdir()
    repo, out = _fake_checkout(tmp_path / "hf", "5.2.0"), tmp_path
    node = "tests/models/llama/test_modeling_llama.py::LlamaModelTest::test_x"
    args = ["--transformers-repo", str(repo), "--models", "llama", "--out-dir", str(out), "--compare-only"]
    _report(outcomes, library=False, calls=4, **{node: "passed"}).save(out / "baseline.json")
    _report(outcomes, library=True, calls=4, **{node: "failed"}).save(out / "library.json")
    assert runner.main(args) == 1
    printed = capsys.readouterr()
    assert node in printed.out and f"error in {node}" in printed.out and "FAIL:" in printed.err
    record = json.loads((out / "summary.json").read_text())
    assert [r["node"] for r in record["regressions"]] == [node]
    assert record["runs"]["library"]["rows"][-1] == {
        "model": "all", "tests": 1, "reached": 1, "passed": 0, "failed": 1, "error": 0, "skipped": 0, "xfailed": 0,
        "xpassed": 0, "calls": 4,
    }  # fmt: skip
    _report(outcomes, library=True, calls=4, **{node: "passed"}).save(out / "library.json")
    assert runner.main(args) == 0


FAKE_TRANSFORMERS = {
    "transformers/__init__.py": '__version__ = "0.0.fake"\nfrom .modeling_utils import AttentionInterface\n',
    "transformers/modeling_utils.py": (
        "class AttentionInterface:\n"
        "    _global_mapping = {}\n\n"
        "    @classmethod\n"
        "    def register(cls, key, value):\n"
        "        cls._global_mapping[key] = value\n"
    ),
    "transformers/integrations/__init__.py": "",
    "transformers/integrations/sdpa_attention.py": (
        "def sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs):\n    return 'sdpa', None\n"
    ),
}

FAKE_TESTS = """
import pytest
import torch
from transformers import AttentionInterface

def attend():
    q = torch.randn(1, 2, 3, 4)
    return AttentionInterface._global_mapping["sdpa"](torch.nn.Module(), q, q, q, None)

def test_two_calls():
    attend(); attend()

def test_fails():
    attend()
    raise AssertionError("boom")

def test_skipped():
    pytest.skip("needs a GPU")

@pytest.fixture
def broken():
    raise RuntimeError("setup broke")

def test_setup_error(broken):
    attend()

@pytest.mark.xfail(reason="known")
def test_xfail():
    raise AssertionError("expected")
"""


@pytest.mark.parametrize("library", [False, True], ids=["baseline", "library"])
def test_the_plugin_records_each_outcome_and_the_calls_each_test_made(tools, tmp_path, library):
    outcomes, _ = tools
    for name, text in FAKE_TRANSFORMERS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "test_fake.py").write_text(FAKE_TESTS)
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pytest", "test_fake.py", "-q", "-p", "no:cacheprovider", "-p"]
    command += ["transformers_sdpa_plugin", "--flashattn-report", str(report), *["--flashattn-swap"] * library]
    path = os.pathsep.join([str(tmp_path), str(TOOLS), str(ROOT / "src")])
    done = subprocess.run(command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr  # test_fails failed
    run = outcomes.RunReport.load(report)
    got = {node.split("::")[1]: (r.outcome.value, r.message, r.calls) for node, r in run.tests.items()}
    assert got == {
        "test_two_calls": ("passed", "", 2),
        "test_fails": ("failed", "AssertionError: boom", 1),
        "test_skipped": ("skipped", "Skipped: needs a GPU", 0),
        "test_setup_error": ("error", "RuntimeError: setup broke", 0),
        "test_xfail": ("xfailed", "AssertionError: expected", 0),
    }
    assert run.calls == 3 and run.library is library and run.transformers_version == "0.0.fake"
    assert run.flashattn_teach_file.endswith("flashattn_teach/__init__.py") is library
