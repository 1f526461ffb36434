"""Skip the Triton tests, with a reason, where triton is not installed (macOS, Linux on ARM)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _triton_missing() -> str | None:
    try:
        importlib.import_module("triton")
    except ImportError as e:
        return f"triton is not installed ({e})"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _triton_missing()
    if reason is None:
        return
    for item in items:
        if Path(item.path).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.skip(reason=reason))
