"""Fake first-light cases for tests/test_first_light.py: a hang, a crash, an exception, a wrong answer, a
right one and a skip, as the GPU cases would fail, without a GPU (NEEDS_CUDA is False)."""

from __future__ import annotations

import os
import time

from first_light_runner import Case, Error, Group, Skip

NEEDS_CUDA = False
HANG_TIMEOUT_S = 1.5  # the sleeping case's timeout; it sleeps far longer


def sleeps() -> None:
    time.sleep(600)


def raises() -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")


def aborts() -> None:
    print("about to abort", flush=True)
    os.abort()


def off() -> list[Error]:
    return [Error("O", 0.004, 0.002), Error("lse", 1e-6, 1e-4)]


def right() -> list[Error]:
    return [Error("O", 0.001, 0.002), Error("dq", 0.0, 0.0)]


def no_fp8() -> None:
    raise Skip("no FP8 on this card (simulated sm_80)")


def timed() -> dict[str, float]:
    return {"fwd_ms": 1.25}


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
    Group("timings", (Case("row", timed, timeout_s=20),), budget_s=10, part="timings", covers="a timing row"),
]
PRECOMPILE_BUDGET_S = 20.0
REPORT_BUDGET_S = 1.0
