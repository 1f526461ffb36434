"""The libraries a ``flashattn-teach`` command may need beyond the core install, and the extra that brings each.

``pip install .`` gives torch, numpy and rich; matplotlib (``--format png``) comes with ``[viz]``, triton (the
kernels' ahead-of-time compile; no GPU needed) with ``[triton]``. A command calls :func:`require` before its
work starts, so a missing library costs nothing and says what to install; :func:`flashattn_teach.cli.main`
prints the :class:`MissingLibrary` it raises as one line on stderr, exit status 1, and treats a
``ModuleNotFoundError`` for one of :data:`EXTRAS` that no ``require`` caught the same way.
"""

from __future__ import annotations

import importlib

# each optional library -> the extra of pyproject.toml that installs it
EXTRAS = {"matplotlib": "viz", "rich": "viz", "triton": "triton", "transformers": "transformers"}


class MissingLibrary(Exception):
    """An optional library a command needs is not installed; the message names it and the extra."""


def install_hint(library: str) -> str:
    """What to type for ``library``: its extra, from a package index or from a checkout."""
    extra = EXTRAS[library]
    return f'pip install "flashattn-teach[{extra}]" (in a checkout: pip install ".[{extra}]")'


def missing(library: str, what: str, error: ImportError | None = None) -> MissingLibrary:
    """The error for ``what`` (``--format png``) needing ``library``, which did not import (``error``)."""
    if error is None or error.name == library:
        why = "which is not installed"
    else:  # installed, but something it imports is not
        why = f"which does not import ({error})"
    return MissingLibrary(f"{what} needs {library}, {why}: {install_hint(library)}")


def import_error(library: str) -> ImportError | None:
    """What importing ``library`` raises, or None where it imports (as the command would import it anyway)."""
    try:
        importlib.import_module(library)
    except ImportError as error:
        return error
    return None


def require(library: str, what: str) -> None:
    """Raise :class:`MissingLibrary` naming ``what`` and the extra to install unless ``library`` imports."""
    if library not in EXTRAS:
        raise ValueError(f"library: {library!r} is not an optional library of flashattn-teach ({sorted(EXTRAS)})")
    error = import_error(library)
    if error is not None:
        raise missing(library, what, error)
