"""Outcomes of one pytest run of transformers' model tests, and the comparison of two such runs.

The runner (``run_transformers_tests.py``) runs the same selection of transformers' tests twice: once as
transformers ships it (its ``"sdpa"`` attention function is torch's SDPA) and once with
``flashattn_teach.integrations.transformers.attention_forward`` in its place (``transformers_sdpa_plugin.py``).
Each run writes a :class:`RunReport`; :func:`compare` says which tests pass with transformers' SDPA and fail
with this library (the regressions), and :func:`problems` turns that, and a library run that never reached the
library, into the reasons the runner exits non-zero.

This file imports neither pytest nor transformers, so the comparison is tested on its own
(``tests/tools/test_transformers_outcomes.py``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from pathlib import Path


class Outcome(str, Enum):
    """One test's outcome over its setup, call and teardown phases, as pytest's summary names them."""

    PASSED = "passed"
    FAILED = "failed"  # the test's own body failed (an assertion, an exception, a timeout)
    ERROR = "error"  # its setup or teardown failed
    SKIPPED = "skipped"
    XFAILED = "xfailed"  # marked as expected to fail, and failed
    XPASSED = "xpassed"  # marked as expected to fail, and passed

    @property
    def is_pass(self) -> bool:
        return self in (Outcome.PASSED, Outcome.XPASSED)

    @property
    def is_failure(self) -> bool:
        return self in (Outcome.FAILED, Outcome.ERROR)


@dataclass
class TestResult:
    """One test's outcome, the first line of its failure or skip reason, and the attention calls it made."""

    __test__ = False  # a dataclass named Test*, not a test class: pytest should not collect it

    outcome: Outcome
    message: str = ""
    calls: int = 0


@dataclass
class RunReport:
    """What one pytest run saw: which attention function served ``"sdpa"`` and every test's result."""

    library: bool  # True: flashattn_teach served transformers' "sdpa"; False: transformers' own SDPA
    transformers_version: str
    transformers_file: str
    flashattn_teach_file: str = ""
    calls: int = 0  # calls of the "sdpa" attention function over the whole session
    duration_s: float = 0.0
    tests: dict[str, TestResult] = field(default_factory=dict)  # pytest node id -> result

    def counts(self) -> dict[Outcome, int]:
        """The number of tests of each outcome, every outcome present (0 when none)."""
        counts = dict.fromkeys(Outcome, 0)
        for result in self.tests.values():
            counts[result.outcome] += 1
        return counts

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: Path) -> RunReport:
        """Read a report :meth:`save` wrote; a missing field or an unknown outcome raises, naming the file."""
        try:
            data = json.loads(path.read_text())
            tests = {n: TestResult(Outcome(t["outcome"]), t["message"], t["calls"]) for n, t in data["tests"].items()}
            return cls(**{**data, "tests": tests})
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: not a run report of transformers_sdpa_plugin.py ({err!r})") from err


@dataclass(frozen=True)
class Regression:
    """A test that passed with transformers' SDPA and failed (or did not finish) with flashattn_teach."""

    node: str
    baseline: Outcome
    library: Outcome | None  # None: the library run never reported the test (the run stopped before it)
    message: str
    reproduced: bool | None = None  # failed again with flashattn_teach when rerun; None: not rerun


@dataclass(frozen=True)
class Comparison:
    regressions: list[Regression]
    fixed: list[str]  # failed with transformers' SDPA, pass with flashattn_teach
    changed: list[str]  # any other change of outcome, e.g. passed -> skipped: "node: before -> after"
    flaky: list[Regression] = field(default_factory=list)  # rerun, failed with transformers' SDPA too


def compare(baseline: RunReport, library: RunReport) -> Comparison:
    """Pair the two runs' tests by node id: baseline-pass and library-failure (or absence) is a regression."""
    regressions: list[Regression] = []
    fixed: list[str] = []
    changed: list[str] = []
    for node, before in sorted(baseline.tests.items()):
        after = library.tests.get(node)
        if after is None:
            if before.outcome.is_pass:
                regressions.append(Regression(node, before.outcome, None, "not run with flashattn_teach"))
            continue
        if before.outcome.is_pass and after.outcome.is_failure:
            regressions.append(Regression(node, before.outcome, after.outcome, after.message))
        elif before.outcome.is_failure and after.outcome.is_pass:
            fixed.append(node)
        elif before.outcome != after.outcome:
            changed.append(f"{node}: {before.outcome.value} -> {after.outcome.value}")
    return Comparison(regressions, fixed, changed)


def recheck(comparison: Comparison, baseline_again: RunReport, library_again: RunReport) -> Comparison:
    """Judge the regressions by a rerun of their tests in both ways. transformers' tests draw their inputs from
    unseeded generators, so a test can fail by chance: one that fails with transformers' SDPA on the rerun
    is flaky without the library and moves to ``flaky``; the others stay regressions, each marked with
    whether the library failed it again."""
    regressions: list[Regression] = []
    flaky: list[Regression] = []
    for regression in comparison.regressions:
        before, after = baseline_again.tests.get(regression.node), library_again.tests.get(regression.node)
        judged = replace(regression, reproduced=after is None or after.outcome.is_failure)
        (flaky if before is not None and before.outcome.is_failure else regressions).append(judged)
    return replace(comparison, regressions=regressions, flaky=[*comparison.flaky, *flaky])


def problems(baseline: RunReport, library: RunReport, comparison: Comparison) -> list[str]:
    """Every reason the comparison does not show what it should; empty means the runner exits 0."""
    found: list[str] = []
    if baseline.library or not library.library:
        found.append("the runs are swapped: the baseline must use transformers' SDPA, the other flashattn_teach")
    if baseline.transformers_version != library.transformers_version:
        found.append(
            f"the runs used different transformers: {baseline.transformers_version} ({baseline.transformers_file}) "
            f"and {library.transformers_version} ({library.transformers_file})"
        )
    if not baseline.tests:
        found.append("the baseline run reported no test: check the selection (-k) and the run's log")
    if library.calls == 0:
        found.append(
            "the library run never reached the library: 0 calls of flashattn_teach's attention_forward, so its "
            "passes say nothing about flashattn_teach"
        )
    if comparison.regressions:
        found.append(f"{len(comparison.regressions)} tests pass with transformers' SDPA and fail with flashattn_teach")
    return found
