"""What the subcommands of ``flashattn-teach replay`` share: option types, dtypes, the inputs, the output file.

Inputs are made as the recorded teaching example made them: ``torch.manual_seed(seed)``, then
``torch.randn(batch, seq_len, head_dim, dtype=dtype)`` for q, k, v (and ``dO``, the fourth: the backward's,
and the page's Backward tab); a decode step draws q, k_cache, v_cache, k, v from the same recipe.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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


def error(message: str, scenario: str) -> int:
    """``message`` printed as ``flashattn-teach replay SCENARIO: error: ...`` on stderr, as argparse prints a
    subcommand's errors; returns the exit status, 2."""
    print(f"{PROG} {scenario}: error: {message}", file=sys.stderr)
    return 2


def require_format(fmt: str) -> None:
    """Before any work: raise :class:`flashattn_teach._optional.MissingLibrary` (one line naming the extra, from
    the top-level command) if the library that draws ``--format fmt`` is not installed."""
    library = DRAWN_BY.get(fmt)
    if library is not None:
        require(library, f"--format {fmt}")


def reported(work: Callable[[], str | None], out: Path | None, scenario: str) -> int:
    """Run ``work``; 0, or 2 with the error printed: the problem it returns, a bad argument, which the replay's
    checks name (``TypeError``, ``ValueError``), or an output file ``out`` that cannot be written. A closed
    pipe is the caller's to handle."""
    try:
        problem = work()
    except (TypeError, ValueError) as problem:
        return error(str(problem), scenario)
    except OSError as problem:
        if isinstance(problem, BrokenPipeError):
            raise
        return error(f"cannot write {out}: {problem.strerror}", scenario)
    return 0 if problem is None else error(problem, scenario)


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


EXTRA_SLOTS = 2  # a decode step's unused cache slots drawn after its keys, by default


def make_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``manual_seed(seed)``, then ``randn(B, N, D)`` four times: q, k, v (the recorded example's recipe) and
    ``dO``, the backward's (and the forward page's Backward tab's)."""
    torch.manual_seed(args.seed)
    shape, dtype = (args.batch, args.seq_len, args.head_dim), DTYPES[args.dtype]
    q, k, v, dO = (torch.randn(shape, dtype=dtype) for _ in range(4))
    return q, k, v, dO


def cache_size(args: argparse.Namespace) -> int:
    """``N_max``: ``--cache-size``, or room for the step's keys and a few unused slots."""
    return args.cache_size if args.cache_size is not None else args.cache_len + args.new_kv + EXTRA_SLOTS


def make_decode_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """``manual_seed(seed)``, then ``randn`` five times: q, k_cache, v_cache, k, v (one head)."""
    torch.manual_seed(args.seed)
    B, D, dtype = args.batch, args.head_dim, DTYPES[args.dtype]
    shapes = [(B, 1, args.new_queries, D), *[(B, 1, cache_size(args), D)] * 2, *[(B, 1, args.new_kv, D)] * 2]
    return tuple(torch.randn(shape, dtype=dtype) for shape in shapes)


@dataclass(frozen=True)
class MaskOptions:
    """The mask contract's arguments of :func:`~flashattn_teach.replay.replay.replay`, made from the options."""

    window: tuple[int, int] | None
    softcap: float | None
    alibi_slopes: torch.Tensor | None
    seqlens_k: torch.Tensor | None
    attn_mask: torch.Tensor | None
    cu_seqlens: torch.Tensor | None


def _load_mask(path: Path) -> torch.Tensor:
    try:
        mask = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError) as error:
        raise ValueError(f"argument --mask: cannot read {path}: {str(error).splitlines()[0]}") from None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"argument --mask: {path} holds a {type(mask).__name__}, not a tensor")
    return mask


def make_mask_options(args: argparse.Namespace) -> MaskOptions:
    """``--window``, ``--softcap``, ``--alibi``, ``--seqlens-k`` and ``--pad-left`` or ``--mask`` as tensors."""
    B, N = args.batch, args.seq_len
    slopes = per_batch("--alibi", args.alibi, B)
    lengths = per_batch("--seqlens-k", args.seqlens_k, B)
    pads = per_batch("--pad-left", args.pad_left, B)
    attn_mask = None
    if pads is not None:
        # Hugging Face's attention_mask (B, N) is 0 on the padding, which a left-padding tokenizer puts first.
        attn_mask = torch.arange(N)[None, :] >= torch.tensor(pads)[:, None]  # (B, N_k)
        attn_mask = attn_mask[:, None, :]  # (B, 1, N_k): every query row of element b
    elif args.mask is not None:
        attn_mask = _load_mask(args.mask)
    return MaskOptions(
        window=args.window,
        softcap=args.softcap,
        alibi_slopes=None if slopes is None else torch.tensor(slopes, dtype=torch.float64),
        seqlens_k=None if lengths is None else torch.tensor(lengths),
        attn_mask=attn_mask,
        cu_seqlens=None if args.cu_seqlens is None else torch.tensor(args.cu_seqlens),
    )
