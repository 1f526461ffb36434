"""Patching a library function where it is used: the modules that imported it by name hold their own
reference, so a probe that counts its calls replaces it in every loaded module of the package."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest


def patch_everywhere(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str, replacement: Callable[..., Any]
) -> None:
    """``module.name`` and every ``flashattn_teach`` module's binding of the same object become
    ``replacement`` for the test (``monkeypatch`` undoes it)."""
    original = getattr(module, name)
    for loaded in list(sys.modules.values()):
        if getattr(loaded, "__name__", "").startswith("flashattn_teach") and getattr(loaded, name, None) is original:
            monkeypatch.setattr(loaded, name, replacement)
