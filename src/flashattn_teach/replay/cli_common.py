"""What ``flashattn-teach replay`` and its ``--decode`` mode share: option types, dtypes, the output file."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TypeVar

import torch

from .._cli_types import finite_float, nonnegative_int
from .._optional import require

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FORMATS = ("table", "json", "html", "png")
DRAWN_BY = {"table": "rich", "png": "matplotlib"}  # the library each format needs beyond torch (json, html: none)
PROG = "flashattn-teach replay"
T = TypeVar("T")


def _list(text: str, item: Callable[[str], T]) -> list[T]:
    return [item(x) for x in text.split(",")]


def _window_side(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= -1, got {text!r}") from None
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be an integer >= -1, got {text!r}")
    return value


def window(text: str) -> tuple[int, int]:
    """``L,R``: two integers >= -1."""
    sides = _list(text, _window_side)
    if len(sides) != 2:
        raise argparse.ArgumentTypeError(f"must be two integers L,R, got {text!r}")
    return sides[0], sides[1]


def floats(text: str) -> list[float]:
    """``X`` or ``X,Y,...``: finite numbers."""
    return _list(text, finite_float)


def counts(text: str) -> list[int]:
    """``N`` or ``N,M,...``: integers >= 0."""
    return _list(text, nonnegative_int)


def per_batch(option: str, values: list[T] | None, B: int) -> list[T] | None:
    """One value for every batch element, or one each; else an error naming the option."""
    if values is None or len(values) == B:
        return values
    if len(values) == 1:
        return values * B
    raise ValueError(f"argument {option}: give one value or {B} (one per batch element), got {len(values)}")


def sinks_error(sinks: list[float] | None) -> str | None:
    """``--sinks``: the inputs the command makes have one head, so one sink; more is refused by name."""
    if sinks is None or len(sinks) == 1:
        return None
    given = ",".join(f"{x:g}" for x in sinks)
    return f"argument --sinks: the replay runs one head, so it takes one sink, got {given}"


def error(message: str) -> int:
    """``message`` printed as ``flashattn-teach replay: error: ...`` on stderr; returns the exit status, 2."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def require_format(fmt: str) -> None:
    """Before any work: raise :class:`flashattn_teach._optional.MissingLibrary` (one line naming the extra, from
    the top-level command) if the library that draws ``--format fmt`` is not installed."""
    library = DRAWN_BY.get(fmt)
    if library is not None:
        require(library, f"--format {fmt}")


def reported(work: Callable[[], str | None], out: Path | None) -> int:
    """Run ``work``; 0, or 2 with the error printed: the problem it returns, a bad argument, which the replay's
    checks name (``TypeError``, ``ValueError``), or an output file ``out`` that cannot be written. A closed
    pipe is the caller's to handle."""
    try:
        problem = work()
    except (TypeError, ValueError) as problem:
        return error(str(problem))
    except OSError as problem:
        if isinstance(problem, BrokenPipeError):
            raise
        return error(f"cannot write {out}: {problem.strerror}")
    return 0 if problem is None else error(problem)


@contextmanager
def open_output(path: Path | None) -> Iterator[IO[str]]:
    """``path`` opened for writing, or stdout; a file is removed again if writing it fails half-way."""
    if path is None:
        yield sys.stdout
        return
    try:
        with path.open("w", encoding="utf-8") as f:
            yield f
    except BaseException:
        path.unlink(missing_ok=True)
        raise
