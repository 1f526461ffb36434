"""Fixtures shared by the transformers integration tests."""

from __future__ import annotations

import pytest

import flashattn_teach.api.attention as api


@pytest.fixture
def backends(monkeypatch):
    """The backend of every flashattn_teach call made during the test."""
    seen: list[str] = []
    run = api._run

    def record(p, *args):
        seen.append(p.backend)
        return run(p, *args)

    monkeypatch.setattr(api, "_run", record)
    return seen
