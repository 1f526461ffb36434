"""The headless-browser fixture: skips cleanly without Chromium, except on CI, where Chromium must be there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cdp_pipe import Browser, find_chromium

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")  # one Chromium for every page test (each test opens its own page)
def browser():
    executable = find_chromium()
    if executable is None:
        if on_ci():
            pytest.fail("CI is set but chromium is missing: run .ci/install-chromium.sh")
        pytest.skip("chromium not installed (apt-get install chromium, or .ci/install-chromium.sh)")
    b = Browser(executable)
    yield b
    b.close()


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
