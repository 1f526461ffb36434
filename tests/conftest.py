"""Test-wide setup: hypothesis profiles, the Triton interpreter on machines without CUDA, and two workers for
the whole suite.

``TRITON_INTERPRET=1`` must be in the environment before any ``@triton.jit`` kernel is defined, so it is
set here, at collection time, and only when no CUDA GPU is present. Nothing here initialises CUDA:
``torch.cuda.is_available()`` only asks the driver.

A plain ``pytest`` (the README's command: the whole suite, from ``testpaths``) runs on two worker processes
when pytest-xdist is installed (the ``test`` extra has it), one test file to a worker (``--dist loadfile``:
a module's shared compiles and browser stay in one process). Naming files, ``-n``, ``--pdb`` or
``-p no:xdist`` keeps one process; ``-n 0`` turns the workers off for the whole suite.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # a bare GPU machine may lack hypothesis; its GPU tests still run
    from hypothesis import HealthCheck, settings
except ImportError:
    settings = None

if settings is not None:
    settings.register_profile(
        "ci",
        max_examples=40,
        derandomize=True,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile("dev", max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


WORKERS = 2  # the suite's target machine has two cores; the AOT compile tests' subprocesses use both either way


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Two xdist workers for the whole suite, when nothing on the command line chose otherwise."""
    if not hasattr(config.option, "numprocesses") or hasattr(config, "workerinput"):
        return  # no pytest-xdist, or this is one of its workers
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if whole_suite and config.option.numprocesses is None and not config.getoption("usepdb", False):
        config.option.numprocesses = WORKERS
        if config.option.dist == "no":
            config.option.dist = "loadfile"
