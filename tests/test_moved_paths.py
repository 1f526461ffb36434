"""The 0.1 module paths keep importing for one release, as the same module objects, with a warning."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flashattn_teach._moved import MOVED, new_path

CASES = [
    ("flashattn_teach.trace", "flashattn_teach.replay"),
    ("flashattn_teach.trace.replay", "flashattn_teach.replay.replay"),
    ("flashattn_teach.online_softmax", "flashattn_teach.core.online_softmax"),
    ("flashattn_teach.iomodel.hbm", "flashattn_teach.tools.iomodel.hbm"),
    ("flashattn_teach.splitkv", "flashattn_teach.serving.splitkv"),
    ("flashattn_teach.decode.step", "flashattn_teach.serving.step"),
    ("flashattn_teach.triton.decode_launch", "flashattn_teach.serving.launch"),
]


@pytest.mark.parametrize(("old", "new"), CASES)
def test_an_old_path_is_the_new_module_with_a_deprecation_warning(old, new):
    code = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old!r})\n"
        f"new = importlib.import_module({new!r})\n"
        "assert old is new, (old, new)\n"
        f"assert any(issubclass(w.category, DeprecationWarning) and {new!r} in str(w.message) for w in caught), "
        "[str(w.message) for w in caught]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_new_path_exists_and_no_old_path_is_a_file():
    import importlib.util
    from pathlib import Path

    import flashattn_teach

    root = Path(flashattn_teach.__file__).parent
    for old, new in MOVED.items():
        assert importlib.util.find_spec(f"flashattn_teach.{new}") is not None, new
        left = root / Path(*old.split("."))
        assert not left.with_suffix(".py").exists() and not (left / "__init__.py").exists(), f"{old} still on disk"


def test_names_that_did_not_move_are_left_alone():
    assert new_path("flashattn_teach.reference.dense") is None
    assert new_path("flashattn_teach.tracer") is None  # a prefix of the name, not of a dotted part
    assert new_path("flashattn_teach.triton.launch") is None
    assert new_path("torch.trace") is None  # another package


def test_a_moved_top_level_module_is_an_attribute_of_the_package_with_the_warning():
    code = (
        "import warnings, flashattn_teach\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    trace = flashattn_teach.trace\n"
        "import flashattn_teach.replay\n"
        "assert trace is flashattn_teach.replay and callable(trace.replay)\n"
        "assert any(issubclass(w.category, DeprecationWarning) for w in caught)\n"
        "try:\n"
        "    flashattn_teach.no_such_module\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('a made-up attribute must raise')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
