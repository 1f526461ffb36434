"""core/ stays a read-first core: at most 6 files and 800 lines, its package docstring gives the reading order,
importing it never imports triton, and each full-featured path opens with what it changes from a core file."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import flashattn_teach.core

CORE = Path(flashattn_teach.core.__file__).parent
MAX_FILES, MAX_LINES = 6, 800


def test_core_is_at_most_6_files_and_800_lines() -> None:
    files = sorted(CORE.glob("*.py"))
    lines = {f.name: len(f.read_text().splitlines()) for f in files}
    assert {"__init__.py", "dense.py", "online_softmax.py", "loops.py", "backward.py", "kernel.py"} >= set(lines)
    assert len(files) <= MAX_FILES and not [p for p in CORE.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert sum(lines.values()) <= MAX_LINES, lines


def test_importing_core_does_not_import_triton() -> None:
    code = "import flashattn_teach.core, sys; assert 'triton' not in sys.modules, 'core imported triton'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_docstring_gives_the_reading_order_of_every_file() -> None:
    doc = flashattn_teach.core.__doc__ or ""
    names = [f.name for f in sorted(CORE.glob("*.py")) if f.name != "__init__.py"]
    positions = [
        doc.find(f"``{name}``") for name in ("dense.py", "online_softmax.py", "loops.py", "backward.py", "kernel.py")
    ]
    assert all(p >= 0 for p in positions) and positions == sorted(positions)
    assert all(f"``{n}``" in doc for n in names)


FULL_PATHS = [
    "reference/dense.py",
    "reference/query_major.py",
    "reference/key_major.py",
    "reference/backward.py",
    "reference/parallel.py",
    "reference/scores.py",
    "triton/kernels/forward.py",
    "triton/kernels/forward_inner.py",
    "triton/kernels/backward.py",
    "triton/kernels/backward_dkdv.py",
    "triton/kernels/backward_dkdv_inner.py",
    "triton/kernels/backward_dq.py",
    "triton/kernels/backward_dq_inner.py",
]


def test_each_full_path_opens_with_what_it_changes_from_a_core_file() -> None:
    for path in FULL_PATHS:
        doc = ast.get_docstring(ast.parse((CORE.parent / path).read_text())) or ""
        named = re.match(r"Changes from core/(\w+\.py)( and core/(\w+\.py))?", doc)
        assert named, f"{path}: the docstring opens with {doc[:40]!r}"
        for core_file in filter(None, (named.group(1), named.group(3))):
            assert (CORE / core_file).is_file(), f"{path} names core/{core_file}, which does not exist"
