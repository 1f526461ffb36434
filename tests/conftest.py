"""Test-wide setup: hypothesis profiles, the Triton interpreter on machines without CUDA, and two workers for
the whole suite.

``TRITON_INTERPRET=1`` must be in the environment before any ``@triton.jit`` kernel is defined, so it is
set here, at collection time, and only when no CUDA GPU is present. Nothing here initialises CUDA:
``torch.cuda.is_available()`` only asks the driver.

A plain ``pytest`` (the README's command: the whole suite, from ``testpaths``) runs on two worker processes
when pytest-xdist is installed (the ``test`` extra has it), one test file to a worker (``--dist loadfile``:
a module's shared compiles and browser stay in one process). Naming files, ``-n``, ``--pdb`` or
``-p no:xdist`` keeps one process; ``-n 0`` turns the workers off for the whole suite. The files go to the
workers longest first: those of ``START_FIRST`` (ahead-of-time compiles: their subprocesses wait on ptxas and
cuobjdump for minutes), then the rest by their number of tests (pytest-xdist's own order), so that no long
file starts last while the other worker has nothing left.

Every process of the run (the workers, their compile and CLI subprocesses) waits for OpenMP passively
(``OMP_WAIT_POLICY=PASSIVE``, unless the environment already names a policy). torch's CPU ops run in OpenMP
regions of ``torch.get_num_threads()`` threads (two on the target machine); two workers and their
subprocesses on two cores put several such threads on each core, and with the default policy a thread that
waits at a region's barrier spins on the core its partner needs. Measured on the 2-core machine, two
processes at once: 1500 small attention steps 285 s of wall and 52 s of CPU each by default, 7 s and 4.5 s
passive; tests/reference/test_reference_properties.py 48 s -> 17 s. The thread count is unchanged (the CPU
reference's default worker count reads it). numpy's OpenBLAS (the Triton interpreter's ``tl.dot``) runs one
thread a process (``OPENBLAS_NUM_THREADS=1``): its threads spin the same way, and a 128 x 128 product is
large enough to be split; two processes at once, 5000 such products: 43 s of wall and 14 s of CPU each with
its default two threads, 0.9 s and 0.3 s with one. Both libraries read their variable when they load, so
both are set before ``import torch`` here (which loads both); the workers and subprocesses inherit them.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

# Before torch loads libgomp and numpy OpenBLAS (see the module docstring); values already set are kept
OMP_WAIT = os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
OPENBLAS_THREADS = os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

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
# Set by the plain run's main process for its workers (which get its command line, not its options)
ORDER_VARIABLE = "PYTEST_FLASHATTN_TEACH_ORDER"
# Files whose wall time is mostly ahead-of-time compile subprocesses, the longest first (paths under tests/)
START_FIRST = (
    "triton/test_triton_compile.py",
    "triton/test_triton_specializations.py",
    "triton/test_triton_paged.py",
    "triton/test_triton_decode_split_lanes.py",
    "triton/test_triton_loops.py",
    "triton/test_triton_decode.py",
    # one compile subprocess of 15-60 s or more each and few tests: by their number of tests they came last
    "triton/test_triton_trace_backward_sass.py",
    "triton/test_triton_trace_sass.py",
    "triton/test_triton_trace_decode_sass.py",
    "triton/test_triton_split_head_dim_compile.py",
    "triton/test_triton_flex_loops.py",
    "triton/test_triton_compile_fp8.py",
    "core/test_core_kernel_compile.py",
    "core/test_core_kernel_trace_sass.py",
    "triton/test_triton_loops_ws.py",
)


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
            config.option.loadscopereorder = False  # the order is pytest_collection_modifyitems' below
            os.environ[ORDER_VARIABLE] = "1"  # the workers (their own processes) inherit it


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker of the plain run: the ``START_FIRST`` files first, then the others by their number of tests,
    most first (stable: a file's tests keep their order). Every worker sorts alike, as xdist requires."""
    if not hasattr(config, "workerinput") or os.environ.get(ORDER_VARIABLE) != "1":
        return
    here = Path(__file__).resolve().parent
    counts = Counter(item.path for item in items)

    def rank(item: pytest.Item) -> tuple[int, int, str]:
        relative = item.path.relative_to(here).as_posix() if item.path.is_relative_to(here) else ""
        first = START_FIRST.index(relative) if relative in START_FIRST else len(START_FIRST)
        return first, -counts[item.path], str(item.path)

    items.sort(key=rank)
