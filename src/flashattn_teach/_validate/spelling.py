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
                raise AttentionTypeError(
                    f"{function.__name__}() got an unexpected keyword argument '{wrong}': "
                    f"{function.__name__} spells it {right}= ({wrong}= is {whose})"
                )
            return function(*args, **kwargs)

        return call

    return wrap
