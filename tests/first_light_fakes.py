"""Fake first-light cases for tests/test_first_light.py: a hang, a crash, an exception, a wrong answer, a
right one and a skip, as the GPU cases would fail, without a GPU (NEEDS_CUDA is False)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from first_light_runner import Case, Error, Group, Skip

NEEDS_CUDA = False
PRECOMPILE_BUDGET_S = 5.0
REPORT_BUDGET_S = 1.0
HANG_TIMEOUT_S = 1.5  # the sleeping case's timeout; it sleeps far longer
PIDFILE = "FIRST_LIGHT_FAKE_PIDFILE"  # where the hanging case writes its child's pid, when set


def sleeps() -> None:
    """Hangs, with a child process of its own (as a kernel compile's ptxas would be)."""
    child = subprocess.Popen(["sleep", "600"])
    if os.environ.get(PIDFILE):
        Path(os.environ[PIDFILE]).write_text(str(child.pid))
    time.sleep(600)


def raises() -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")


def refuses() -> None:
    raise ValueError("head_dim must be between 1 and 256, got 300 (an ordinary refusal: the context is fine)")


def aborts() -> None:
    print("about to abort", flush=True)
    os.abort()


def off() -> list[Error]:
    return [Error("O", 0.004, 0.002), Error("lse", 1e-6, 1e-4)]


def right() -> list[Error]:
    return [Error("O", 0.001, 0.002), Error("dq", 0.0, 0.0)]


def no_fp8() -> None:
    raise Skip("no FP8 on this card (simulated sm_80)")


def pid() -> dict[str, float]:
    return {"pid": float(os.getpid())}


def timed() -> dict[str, float]:
    return {"fwd_ms": 1.25, "fwd_tflops": 500.0}


GROUPS = [
    Group(
        "faults",
        (
            Case("right-before", right, timeout_s=20),
            Case("sleeps", sleeps, timeout_s=HANG_TIMEOUT_S),
            Case("after-hang", right, timeout_s=20),
            Case("raises", raises, timeout_s=20),
            Case("aborts", aborts, timeout_s=20),
            Case("after-abort", right, timeout_s=20),
            Case("off", off, timeout_s=20),
            Case("skips", no_fp8, timeout_s=20),
        ),
        budget_s=40,
        covers="every status",
    ),
    Group("second", (Case("right", right, timeout_s=20),), budget_s=10, covers="a group after a faulty one"),
    Group(
        "pids",
        (Case("one", pid), Case("refuses", refuses), Case("two", pid)),
        budget_s=10,
        part="pids",
        covers="which process ran a case",
    ),
    Group(
        "sticky",
        (Case("before", pid), Case("raises", raises), Case("after", pid)),
        budget_s=10,
        part="sticky",
        covers="a CUDA error breaks the context: the rest gets a fresh process",
    ),
    Group(
        "slow",
        (Case("sleeps-long", sleeps, timeout_s=100), Case("never", right)),
        budget_s=10,
        part="slow",
        covers="a part whose budget runs out",
    ),
    Group("timings", (Case("row", timed, timeout_s=20),), budget_s=10, part="timings", covers="a timing row"),
]
