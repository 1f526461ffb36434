"""What every ``flashattn-teach`` subcommand shares on its command line: a parser whose errors are one line,
and the ``type=`` functions that check each value as it is parsed, so a bad value is named by its option.

argparse turns the ``ArgumentTypeError`` raised here into ``argument --seq-len: must be a positive
integer, got '0'``.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Any, NoReturn

# torch.manual_seed accepts [-2**63, 2**64 - 1] and raises RuntimeError outside it.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but an error is the one line ``prog: error: message`` on stderr and exit status 2,
    without the usage block (``--help`` still prints it), and a value that starts with a negative number is
    a value: ``--window -1,0``, ``--alibi -0.5,-1``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse before 3.13 takes only a lone number (-1, -0.5) for a value and "-1,0" for an option; no
        # option here starts with a digit, so do as 3.13 does: "-" and then a digit begins a value.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """A size: an integer >= 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An index: an integer >= 0."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def seed(text: str) -> int:
    """A seed ``torch.manual_seed`` accepts."""
    value = _integer(text)
    if not SEED_MIN <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in [-2**63, 2**64 - 1], got {text!r}")
    return value


def finite_float(text: str) -> float:
    """A real number: not nan, not inf."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def finite_positive_float(text: str) -> float:
    """A finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def output_path(text: str) -> Path:
    """A file to write: its folder must exist, and it must not be a folder itself."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(path.parent)!r} does not exist (for {text!r})")
    return path
