"""A function whose keywords are one ``TypedDict``: its signature, its defaults and its unknown-keyword error.

The library writes the keywords its calls share once, as ``TypedDict`` s (:mod:`flashattn_teach._options`),
each key ``Annotated`` with its :class:`Default`::

    class StepKeywords(TypedDict, total=False):
        causal: Annotated[bool, Default(False)]

A public function then takes them as ``**options: Unpack[...]`` (PEP 692: mypy and IDEs check each keyword's
name and type at the call) and :func:`takes_keywords` gives it at run time what a written-out signature gave:
``inspect.signature``/``help()`` list every keyword with its type and default, an unknown keyword raises
``TypeError`` naming it (with the nearest spelling), and the body receives every keyword, defaults filled,
so it reads ``options["causal"]`` and passes ``options`` on whole.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, cast, get_args, get_origin

from typing_extensions import NotRequired, Required, get_type_hints, is_typeddict

from ..errors import AttentionTypeError
from .spelling import misspelt

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")


@dataclass(frozen=True)
class Default:
    """The default of a ``TypedDict`` key, written beside its type: ``Annotated[bool, Default(False)]``."""

    value: object


def keyword_table(options: type) -> dict[str, inspect.Parameter]:
    """``{name: keyword-only Parameter}`` of a ``TypedDict`` of ``Annotated[type, Default(value)]`` keys, in
    definition order (bases first); a key without a ``Default`` has none (``Required[...]``)."""
    assert is_typeddict(options), options
    table = {}
    for name, hint in get_type_hints(options, include_extras=True).items():
        annotation, default = hint, cast(object, inspect.Parameter.empty)
        while get_origin(annotation) in (Required, NotRequired):  # kept inside include_extras' hints
            annotation = get_args(annotation)[0]
        if get_origin(annotation) is Annotated:
            defaults = [m.value for m in annotation.__metadata__ if isinstance(m, Default)]
            annotation, default = get_args(annotation)[0], defaults[0] if defaults else default
        shown = _as_written(options.__annotations__.get(name), annotation)
        table[name] = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=shown)
    return table


def _as_written(raw: object, evaluated: object) -> object:
    """A key's type as its source spells it (``'ScoreMod | None'``, as a written-out signature under
    ``from __future__ import annotations`` shows it), without ``Annotated[...]`` and ``Required[...]``."""
    text = getattr(raw, "__forward_arg__", raw)
    if not isinstance(text, str):
        return evaluated
    for wrapper in ("Required[", "NotRequired["):
        if text.startswith(wrapper):
            text = text[len(wrapper) : -1]
    if text.startswith("Annotated[") and ", Default(" in text:
        text = text[len("Annotated[") : text.rindex(", Default(")]
    return text


def takes_keywords(**defaults: object) -> Callable[[F], F]:
    """Give a function ``f(..., **options: Unpack[SomeKeywords])`` the signature of its keywords.

    ``defaults`` replace the ``TypedDict`` 's own for this function (``flash_attention`` allows grouped-query
    heads by default: ``enable_gqa=True``). The wrapper raises for an unknown or a missing required keyword
    as Python would for a written-out signature, then calls ``f`` with every keyword, defaults filled."""

    def wrap(function: F) -> F:
        return cast(F, _wrapped(function, defaults, whole=False))

    return wrap


def collects_keywords(
    *, hints: dict[str, tuple[str, str]] | None = None, **defaults: object
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """:func:`takes_keywords` for a function whose typed signatures are its ``@overload`` s (each with
    ``**options: Unpack[SomeKeywords]``) and whose body takes them whole, ``f(..., *, options: SomeKeywords)``:
    the wrapper collects the keywords into that one dict, defaults filled, instead of passing each by name
    (Python matches a keyword passed through ``**`` against every named parameter: about a microsecond for
    twenty keywords, on every call). ``hints``: ``{wrong: (right, whose)}``, a keyword spelt as another API
    spells it, answered with :func:`~flashattn_teach._validate.spelling.misspelt`'s error before any other
    refusal (as :func:`~flashattn_teach._validate.spelling.spelling_hint` would, without its layer on every call)."""

    def wrap(function: Callable[..., R]) -> Callable[..., R]:
        return cast(Callable[..., R], _wrapped(function, defaults, whole=True, spellings=hints or {}))

    return wrap


def _wrapped(
    function: Callable[..., Any],
    defaults: dict[str, object],
    *,
    whole: bool,
    spellings: dict[str, tuple[str, str]] | None = None,
) -> Callable[..., Any]:
    signature = inspect.signature(function)
    hints = get_type_hints(function, include_extras=True)
    if whole:
        own = [p for p in signature.parameters.values() if p.name != "options"]
        assert is_typeddict(hints.get("options")), f"{function.__name__} takes its keywords as options: SomeKeywords"
        table = keyword_table(hints["options"])
    else:
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        var = [p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        assert len(var) == 1, f"{function.__name__} takes its keywords as **options: Unpack[SomeKeywords]"
        table = keyword_table(get_args(hints[var[0]])[0])
    assert set(defaults) <= set(table), f"{function.__name__}: no keyword {set(defaults) - set(table)}"
    table = {name: p.replace(default=defaults.get(name, p.default)) for name, p in table.items()}
    positional = [p for p in own if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    keyword_only = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]
    parameters = [*positional, *table.values(), *keyword_only]
    filled = {name: p.default for name, p in table.items() if p.default is not inspect.Parameter.empty}
    required = frozenset(table) - frozenset(filled)
    shared = frozenset(table)
    named = frozenset(p.name for p in own if p.kind is not inspect.Parameter.POSITIONAL_ONLY)
    name = function.__name__
    spellings = spellings or {}
    assert not set(spellings) & (shared | named), f"{name}: a hint for a keyword it takes: {set(spellings)}"

    def refused(kwargs: dict[str, Any]) -> TypeError:
        for wrong, (right, whose) in spellings.items():
            if wrong in kwargs:
                return misspelt(name, wrong, right, whose=whose)
        unknown = [k for k in kwargs if k not in shared and k not in named]
        if unknown:
            return unexpected_keyword(name, unknown[0], shared | named)
        missing = ", ".join(repr(k) for k in sorted(required - set(kwargs)))
        return TypeError(f"{name}() missing required keyword-only argument: {missing}")

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not required <= kwargs.keys() or not kwargs.keys() <= shared | named:
            raise refused(kwargs)
        given = filled.copy()
        given.update(kwargs)
        return function(*args, **given)

    @functools.wraps(function)
    def collect(*args: Any, **kwargs: Any) -> Any:
        given, own_given = filled.copy(), {}
        for key, value in kwargs.items():
            if key in shared:
                given[key] = value
            elif key in named:
                own_given[key] = value
            else:
                raise refused(kwargs)
        if required and not required <= given.keys():
            raise refused(kwargs)
        return function(*args, options=given, **own_given)

    wrapper = collect if whole else call
    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    return wrapper


def unexpected_keyword(function: str, keyword: str, accepted: frozenset[str]) -> AttentionTypeError:
    """Python's words for an unknown keyword, and the accepted one nearest in spelling, if any is near."""
    near = difflib.get_close_matches(keyword, sorted(accepted), n=1)
    hint = f" (did you mean {near[0]}=?)" if near else ""
    return AttentionTypeError(f"{function}() got an unexpected keyword argument '{keyword}'{hint}")
