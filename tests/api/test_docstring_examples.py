"""The examples in the public functions' docstrings run as written (``doctest``): what ``explain`` and
``explain_with_kvcache`` print is what their docstrings show."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["flashattn_teach.api.explain_call", "flashattn_teach.serving.explain"]


@pytest.mark.parametrize("name", MODULES)
def test_the_docstring_examples_run_as_written(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
