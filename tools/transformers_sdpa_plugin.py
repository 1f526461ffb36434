"""pytest plugin: run transformers' own tests with flashattn_teach serving transformers' ``"sdpa"`` attention.

Loaded into a pytest run of transformers' test suite by ``-p transformers_sdpa_plugin`` (with this folder on
``PYTHONPATH``; ``run_transformers_tests.py`` does both). transformers' models look their attention function
up at every forward, ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``, in a mapping
whose class-wide entries ``AttentionInterface.register`` replaces (``modeling_utils.py``). This plugin
registers a counting wrapper under ``"sdpa"``:

    --flashattn-swap       the wrapper calls flashattn_teach.integrations.transformers.attention_forward
    (without it)           the wrapper calls transformers' own sdpa_attention_forward, so the plain run is
                           counted the same way

The mask function stays transformers' SDPA one (``register()`` installs that same function for its own name),
so the library gets exactly the masks torch's SDPA would. Every test's outcome and the wrapper's calls during
it go to the JSON file ``--flashattn-report`` names (a :class:`transformers_outcomes.RunReport`), written when
the session ends; the whole session's call count is what shows a run that never reached the library.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers_outcomes import Outcome, RunReport, TestResult


class _Counter:
    """Calls of the attention function registered under "sdpa": the session's total and each test's share.

    Calls are counted in eager only. While ``torch.compile`` traces, the count is left alone: a traced
    ``self.calls += 1`` makes dynamo guard on the count, which then fails at the next call and recompiles
    every time (``test_generate_compile_model_forward_fullgraph`` failed so in both runs). The compiled
    graph's runs are not counted; the eager calls of the same session are."""

    def __init__(self) -> None:
        self.calls = 0
        self.at_test_start = 0

    def wrap(self, attention: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling():
                self.calls += 1
            return attention(*args, **kwargs)

        counted.__name__ = f"counted_{attention.__name__}"
        return counted


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("flashattn_teach")
    group.addoption("--flashattn-swap", action="store_true", help="serve transformers' 'sdpa' with flashattn_teach")
    group.addoption("--flashattn-report", type=Path, help="write every test's outcome and call count to this JSON")


def pytest_configure(config: pytest.Config) -> None:
    # Imported here, once transformers' root conftest.py has run: the report names the transformers the tests
    # import (the installed one: that conftest imports it before it puts the checkout's src/ on sys.path).
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    library = bool(config.getoption("--flashattn-swap"))
    flashattn_teach_file = ""
    attention: Callable[..., Any] = sdpa_attention_forward
    if library:
        import flashattn_teach
        from flashattn_teach.integrations.transformers import attention_forward

        attention, flashattn_teach_file = attention_forward, str(flashattn_teach.__file__)
    counter = _Counter()
    AttentionInterface.register("sdpa", counter.wrap(attention))
    report = RunReport(
        library=library,
        transformers_version=transformers.__version__,
        transformers_file=str(transformers.__file__),
        flashattn_teach_file=flashattn_teach_file,
    )
    config.pluginmanager.register(_Recorder(counter, report, config.getoption("--flashattn-report")))


def _message(report: pytest.TestReport) -> str:
    """The first line of a failure's crash message or a skip's reason."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        text = str(longrepr[2])
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(longrepr or "")
    return text.strip().splitlines()[0] if text.strip() else ""


def _outcome(report: pytest.TestReport) -> Outcome | None:
    """The outcome a phase's report settles, or None for a phase that passed and so settles nothing alone."""
    if hasattr(report, "wasxfail"):
        return Outcome.XFAILED if report.skipped else Outcome.XPASSED
    if report.failed:
        return Outcome.FAILED if report.when == "call" else Outcome.ERROR
    if report.skipped:
        return Outcome.SKIPPED
    return Outcome.PASSED if report.when == "call" else None


class _Recorder:
    """Hooks that fill the run's report test by test and write it when the session ends."""

    def __init__(self, counter: _Counter, report: RunReport, path: Path | None) -> None:
        self.counter, self.report, self.path = counter, report, path
        self.start = time.monotonic()

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.counter.at_test_start = self.counter.calls

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        outcome = _outcome(report)
        previous = self.report.tests.get(report.nodeid)
        if outcome is None or (previous is not None and previous.outcome.is_failure):
            return  # a passing setup or teardown, or a phase after the one that already failed
        message = "" if outcome == Outcome.PASSED else _message(report)
        calls = self.counter.calls - self.counter.at_test_start
        self.report.tests[report.nodeid] = TestResult(outcome, message, calls)

    def pytest_sessionfinish(self) -> None:
        self.report.calls = self.counter.calls
        self.report.duration_s = round(time.monotonic() - self.start, 1)
        if self.path is not None:
            self.report.save(self.path)
