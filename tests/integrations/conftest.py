"""Fixtures shared by the transformers integration tests."""

from __future__ import annotations

import pytest

from flashattn_teach.dispatch import runner


@pytest.fixture
def backends(monkeypatch):
    """The backend of every flashattn_teach call made during the test."""
    seen: list[str] = []
    run = runner.run

    def record(p, *args):
        seen.append(p.backend)
        return run(p, *args)

    monkeypatch.setattr(runner, "run", record)
    return seen
