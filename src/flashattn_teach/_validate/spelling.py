"""A hint for a keyword spelt as in the other API: ``is_causal`` (torch's SDPA) and ``causal`` (flash-attn's)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from ..errors import AttentionTypeError

P = ParamSpec("P")
R = TypeVar("R")


def spelling_hint(wrong: str, right: str, *, whose: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A function that answers the keyword ``wrong=`` (``whose`` spelling) with a TypeError naming its own
    spelling ``right=``, where Python's would only say "unexpected keyword argument"."""

    def wrap(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            if wrong in kwargs:
                raise misspelt(function.__name__, wrong, right, whose=whose)
            return function(*args, **kwargs)

        return call

    return wrap


def misspelt(function: str, wrong: str, right: str, *, whose: str) -> AttentionTypeError:
    """The error for ``function(wrong=...)``: Python's words, then the function's own spelling ``right=``
    (:func:`spelling_hint`; :func:`flashattn_teach._validate.keywords.collects_keywords` takes the same as
    ``hints``, asked only once a keyword is refused)."""
    return AttentionTypeError(
        f"{function}() got an unexpected keyword argument '{wrong}': "
        f"{function} spells it {right}= ({wrong}= is {whose})"
    )
