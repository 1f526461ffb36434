"""Module paths that moved in 0.2 (the reading-path layout) keep importing for one release.

``import flashattn_teach.trace`` (or any module below a moved one) gives the module at its new path, the
same object, with a ``DeprecationWarning`` naming the new path. A finder on ``sys.meta_path`` answers for the
old names only; every other import is left to Python's own finders.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

PACKAGE = __name__.rpartition(".")[0]
# old path -> new path, relative to the package; a moved package carries its modules with it
MOVED = {
    "trace": "replay",
    "online_softmax": "core.online_softmax",
    "triton.inspect": "tools.kernels",
    "iomodel": "tools.iomodel",
    "masks.scheduler": "tools.scheduler",
    "decode": "serving",
    "splitkv": "serving.splitkv",
    "_validate.decode": "serving.checks",
    "_validate.pages": "serving.page_checks",
    "_validate.varlen_pages": "serving.varlen_page_checks",
    "ops.decode": "serving.ops",
    "ops.decode_traced": "serving.ops_traced",
    "triton.decode_launch": "serving.launch",
    "api.decode": "serving.api",
    "api.explain_decode": "serving.explain",
    "api.varlen_pages": "serving.varlen_pages",
}

# the moved modules that sat directly in the package (reachable as attributes: ``flashattn_teach.trace``)
TOP_LEVEL = frozenset(f"{PACKAGE}.{old}" for old in MOVED if "." not in old)


def new_path(name: str) -> str | None:
    """The new dotted path of the old module ``name`` (``flashattn_teach.trace.replay`` ->
    ``flashattn_teach.replay.replay``), or None if it did not move. The longest moved prefix decides."""
    rel = name.removeprefix(PACKAGE + ".")
    if rel == name:
        return None
    best = max((old for old in MOVED if rel == old or rel.startswith(old + ".")), key=len, default=None)
    if best is None:
        return None
    return f"{PACKAGE}.{MOVED[best]}{rel[len(best) :]}"


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a throwaway module; exec_module puts the real one in its place

    def exec_module(self, module: ModuleType) -> None:
        warnings.warn(
            f"{module.__name__} moved to {self.new}; the old path stops working in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        # The import system returns whatever sys.modules holds under the name once the loader is done.
        sys.modules[module.__name__] = importlib.import_module(self.new)


class MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        new = new_path(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
