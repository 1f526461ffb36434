"""Run transformers' own model tests with flashattn_teach in place of transformers' SDPA, and without it.

    python tools/run_transformers_tests.py --transformers-repo PATH [--slow] [--out-dir DIR] [--models ...] [-k EXPR]

``PATH`` is a checkout of transformers' repository at the tag of the installed version (``v5.2.0`` for
transformers 5.2.0): the source distribution on the package index lacks ``tests/models``. The script runs
``tests/models/<model>/test_modeling_<model>.py`` for Llama, Mistral, Gemma 2 and Qwen2 with
``-k "sdpa or attention or padding or generate"`` twice in that checkout: once as transformers ships it, once
with ``-p transformers_sdpa_plugin --flashattn-swap``, which serves transformers' ``"sdpa"`` attention with
``flashattn_teach.integrations.transformers.attention_forward`` (this checkout's ``src/``) and counts its calls.
It prints a table of both runs and the tests that pass with transformers' SDPA and fail with this library,
reruns those both ways (``--no-recheck`` skips it; one that fails with transformers' SDPA too is flaky),
writes ``summary.json`` (and each run's report and log) to ``--out-dir``, and exits 1 if such a test stands
or if the library run never reached the library (``transformers_outcomes.problems``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from transformers_outcomes import Comparison, Outcome, RunReport, compare, problems, recheck

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent  # this repository: its src/ is the flashattn_teach the library run imports
MODELS = ("llama", "mistral", "gemma2", "qwen2")
SELECTION = "sdpa or attention or padding or generate"
PLUGIN = "transformers_sdpa_plugin"


class CheckoutError(SystemExit):
    """The checkout cannot serve as the installed transformers' tests; the message says what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(f"run_transformers_tests.py: {message}")


def installed_transformers() -> str:
    """The version of the transformers the runs will import (this interpreter's)."""
    return importlib.metadata.version("transformers")


def checkout_version(repo: Path) -> str:
    """The version a transformers checkout declares in its setup.py (``version="5.2.0"``)."""
    setup = repo / "setup.py"
    match = re.search(r'^\s*version="([^"]+)"', setup.read_text(), re.MULTILINE) if setup.is_file() else None
    if match is None:
        raise CheckoutError(f"{repo} is not a checkout of transformers' repository: no version= in {setup}")
    return match.group(1)


def check_checkout(repo: Path, installed: str, models: tuple[str, ...]) -> list[Path]:
    """The test files of ``models`` in ``repo``, once the checkout is known to be the installed version's tag."""
    declared = checkout_version(repo)
    if declared != installed:
        raise CheckoutError(
            f"{repo} is transformers {declared} but {installed} is installed; the tests of one version do not "
            f"test another: check out the installed version's tag (git -C {repo} checkout v{installed}) or "
            f"install the checkout's version (pip install transformers=={declared})"
        )
    files = [repo / "tests" / "models" / m / f"test_modeling_{m}.py" for m in models]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckoutError(
            f"no {', '.join(missing)}: pass a clone of transformers' repository (the package index's source "
            "distribution lacks tests/models)"
        )
    return files


@dataclass(frozen=True)
class Selection:
    """What both runs run: the same tests, the same -k expression, the same per-test time limit."""

    repo: Path
    models: tuple[str, ...]
    targets: list[str]  # test files relative to repo, or node ids (a rerun)
    keyword: str  # "": every test of the targets
    timeout_s: int  # pytest-timeout's per-test limit; 0: none
    slow: bool = False  # RUN_SLOW=1: also the tests transformers marks @slow


def pytest_command(selection: Selection, *, library: bool, report: Path) -> list[str]:
    """The pytest command line of one run, run in the checkout's root (its conftest.py sets transformers' tests up)."""
    command = [sys.executable, "-m", "pytest", *selection.targets]
    if selection.keyword:
        command += ["-k", selection.keyword]
    command += ["-p", PLUGIN, "--flashattn-report", str(report), "-p", "no:cacheprovider"]
    command += ["-q", "-rfE", "--tb=short"]
    if selection.timeout_s and importlib.util.find_spec("pytest_timeout") is not None:
        command += ["--timeout", str(selection.timeout_s)]
    return [*command, "--flashattn-swap"] if library else command


def run(selection: Selection, *, library: bool, out_dir: Path, suffix: str = "", reuse: bool = False) -> RunReport:
    """Run pytest once, its output to ``<name>.log``, and read the report the plugin wrote (with ``reuse``, only
    read the report an earlier run left)."""
    name = ("library" if library else "baseline") + suffix
    report, log = out_dir / f"{name}.json", out_dir / f"{name}.log"
    if reuse:
        return RunReport.load(report)
    report.unlink(missing_ok=True)
    command = pytest_command(selection, library=library, report=report)
    # The plugin and its outcomes module live in tools/; the library run imports this checkout's flashattn_teach.
    path = os.pathsep.join([str(TOOLS), str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}  # no test may wait on the network
    env["RUN_SLOW"] = "1" if selection.slow else "0"
    print(f"[{name}] {shlex.join(command)}\n[{name}] log: {log}", flush=True)
    with log.open("w") as stream:
        code = subprocess.call(command, cwd=selection.repo, env=env, stdout=stream, stderr=subprocess.STDOUT)
    if not report.is_file():
        raise SystemExit(f"[{name}] pytest exited {code} without writing {report}; see {log}")
    return RunReport.load(report)


def model_of(node: str) -> str:
    """``tests/models/llama/test_modeling_llama.py::LlamaModelTest::test_x`` -> ``llama``."""
    parts = node.split("::", 1)[0].split("/")
    return parts[2] if len(parts) > 3 and parts[:2] == ["tests", "models"] else parts[0]


def count_rows(report: RunReport, models: tuple[str, ...]) -> list[dict[str, int | str]]:
    """One row per model and a total: the number of tests of each outcome and the "sdpa" calls during them."""
    rows: list[dict[str, int | str]] = []
    for model in (*models, "all"):
        results = [r for node, r in report.tests.items() if model in ("all", model_of(node))]
        row: dict[str, int | str] = {
            "model": model,
            "tests": len(results),
            "reached": sum(r.calls > 0 for r in results),
        }
        row.update({o.value: sum(r.outcome == o for r in results) for o in Outcome})
        row["calls"] = report.calls if model == "all" else sum(r.calls for r in results)
        rows.append(row)
    return rows


def render(baseline: RunReport, library: RunReport, comparison: Comparison, models: tuple[str, ...]) -> str:
    """The table of both runs, then the regressions with their errors."""
    columns = ["model", "tests", "reached", *(o.value for o in Outcome), "calls"]
    lines = ["run                 " + "".join(f"{c:>9}" for c in columns) + "   time"]
    for title, report in (("transformers' SDPA", baseline), ("flashattn_teach", library)):
        for row in count_rows(report, models):
            cells = "".join(f"{row[c]!s:>9}" for c in columns)
            time_s = f"{report.duration_s:>6.0f} s" if row["model"] == "all" else ""
            lines.append(f"{title:<20}{cells}   {time_s}")
    lines.append("reached: tests that called the function serving transformers' 'sdpa' at least once; calls: its calls")
    lines.append(f"\n{len(comparison.regressions)} pass with transformers' SDPA and fail with flashattn_teach:")
    rerun = {None: "", True: " (failed again on a rerun)", False: " (passed on a rerun)"}
    for r in comparison.regressions:
        lines.append(f"  {r.node}{rerun[r.reproduced]}")
        lines.append(f"      {r.library.value if r.library else 'not run'}: {r.message[:300]}")
    if comparison.flaky:
        lines.append(f"\n{len(comparison.flaky)} failed with flashattn_teach, then with transformers' SDPA on a rerun:")
        lines += [f"  {r.node}\n      {r.message[:300]}" for r in comparison.flaky]
    if comparison.fixed:
        lines.append(f"\n{len(comparison.fixed)} fail with transformers' SDPA and pass with flashattn_teach:")
        lines += [f"  {node}" for node in comparison.fixed]
    if comparison.changed:
        lines.append(f"\n{len(comparison.changed)} other changes of outcome:")
        lines += [f"  {change}" for change in comparison.changed]
    return "\n".join(lines)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def summary(
    selection: Selection, baseline: RunReport, library: RunReport, comparison: Comparison, found: list[str]
) -> dict[str, object]:
    """Everything the table shows, with the command, the versions and the machine, for summary.json."""
    versions = {p: _version(p) for p in ("torch", "transformers", "pytest")}
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "versions": versions,
        "repo": str(selection.repo),
        "targets": selection.targets,
        "keyword": selection.keyword,
        "timeout_s": selection.timeout_s,
        "slow": selection.slow,
        "runs": {
            "baseline": {"rows": count_rows(baseline, selection.models), "duration_s": baseline.duration_s},
            "library": {
                "rows": count_rows(library, selection.models),
                "duration_s": library.duration_s,
                "flashattn_teach_file": library.flashattn_teach_file,
            },
        },
        "regressions": [
            {"node": r.node, "library": r.library and r.library.value, "error": r.message, "reproduced": r.reproduced}
            for r in comparison.regressions
        ],
        "flaky": [{"node": r.node, "error": r.message} for r in comparison.flaky],
        "fixed": comparison.fixed,
        "changed": comparison.changed,
        "problems": found,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers-repo", type=Path, required=True, help="checkout at the installed tag")
    parser.add_argument("--models", nargs="+", default=list(MODELS), help=f"default: {' '.join(MODELS)}")
    parser.add_argument("-k", dest="keyword", default=SELECTION, help=f"pytest -k expression (default: {SELECTION})")
    parser.add_argument("--timeout", type=int, default=900, help="per-test limit in s with pytest-timeout; 0: none")
    parser.add_argument(
        "--slow",
        action="store_true",
        help="RUN_SLOW=1: also transformers' @slow tests (its integration tests then fail both ways: no weights)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("transformers-tests"), help="reports, logs, summary")
    parser.add_argument("--compare-only", action="store_true", help="compare the reports in --out-dir, run nothing")
    parser.add_argument(
        "--recheck",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rerun the regressed tests both ways; one that fails with transformers' SDPA too is flaky (default: on)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    repo, models = args.transformers_repo.resolve(), tuple(args.models)
    files = check_checkout(repo, installed_transformers(), models)
    targets = [str(f.relative_to(repo)) for f in files]
    selection = Selection(repo, models, targets, args.keyword, args.timeout, args.slow)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    reuse, out = args.compare_only, args.out_dir
    baseline = run(selection, library=False, out_dir=out, reuse=reuse)
    library = run(selection, library=True, out_dir=out, reuse=reuse)
    comparison = compare(baseline, library)
    can_recheck = not reuse or (out / "library-recheck.json").is_file()
    if args.recheck and comparison.regressions and can_recheck:
        again = replace(selection, targets=[r.node for r in comparison.regressions], keyword="")
        baseline_again = run(again, library=False, out_dir=out, suffix="-recheck", reuse=reuse)
        library_again = run(again, library=True, out_dir=out, suffix="-recheck", reuse=reuse)
        comparison = recheck(comparison, baseline_again, library_again)
    found = problems(baseline, library, comparison)
    print(render(baseline, library, comparison, models))
    record = summary(selection, baseline, library, comparison, found)
    (out / "summary.json").write_text(json.dumps(record, indent=1) + "\n")
    for problem in found:
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
