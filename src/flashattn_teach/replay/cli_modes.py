"""What each mode of ``flashattn-teach replay`` reads, by option and output format: everything else is refused.

Three modes: the forward replay of one query block (the default), ``--backward`` (both passes of the
backward, every tile) and ``--decode`` (one decode step's split-KV ranges and merges). Each lists the
options it reads, per ``--format``; an option given that the mode and format do not read is refused by
name (exit 2), whatever its value, never ignored. A list of what is read, not of what is refused, so an
option added later is refused everywhere until a mode says it reads it.
"""

from __future__ import annotations

import argparse
import enum

from .cli_common import FORMATS


class Mode(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    DECODE = "decode"


def mode_of(args: argparse.Namespace) -> Mode:
    """The mode ``args`` selects (``--decode`` with ``--backward`` is refused before this is asked)."""
    return Mode.DECODE if args.decode else Mode.BACKWARD if args.backward else Mode.FORWARD


# The mode selectors themselves, and the options every mode reads in every format (by destination).
SELECTORS = ("decode", "backward")
EVERY_MODE = (
    "seed",
    "batch",
    "batch_index",
    "head_dim",
    "dtype",
    "block_n",
    "causal",
    "scale",
    "window",
    "softcap",
    "alibi",
    "sinks",
    "format",
    "out",
)
# the inputs (B, N, D) and the mask contract's options of the tiled replays, forward and backward
TILED = ("seq_len", "block_m", "causal_align", "seqlens_k", "cu_seqlens", "pad_left", "mask")
DECODE_ONLY = ("cache_len", "new_kv", "new_queries", "num_splits", "cache_size", "merge_order")

_FORWARD = (*EVERY_MODE, *TILED, "query_block", "order")
# --backward's page (html) shows the forward of --query-block beside the backward; the other formats show
# every query block of both passes
_BACKWARD = (*EVERY_MODE, *TILED)
_DECODE = (*EVERY_MODE, *DECODE_ONLY)

READS: dict[Mode, dict[str, frozenset[str]]] = {
    Mode.FORWARD: {
        "table": frozenset(_FORWARD),
        "json": frozenset((*_FORWARD, "extensions")),
        "html": frozenset(_FORWARD),
        "png": frozenset((*_FORWARD, "step")),
    },
    Mode.BACKWARD: {
        "table": frozenset(_BACKWARD),
        "json": frozenset(_BACKWARD),
        "html": frozenset((*_BACKWARD, "query_block")),
        "png": frozenset(_BACKWARD),
    },
    Mode.DECODE: {fmt: frozenset(_DECODE) for fmt in FORMATS},
}


def option_name(dest: str) -> str:
    """``--query-block`` of ``query_block``."""
    return "--" + dest.replace("_", "-")


def _why_not(dest: str, mode: Mode, fmt: str, value: object) -> str:
    """Why ``mode`` with ``--format fmt`` does not read ``dest``, for the refusal."""
    if mode is Mode.DECODE:
        return "not used with --decode"
    if dest in DECODE_ONLY:
        return "needs --decode"
    if mode is Mode.BACKWARD:
        if dest == "order":
            return (
                "not used with --backward (the backward runs key blocks outer for dK/dV and query blocks outer "
                f"for dQ), got --order {value}"
            )
        if dest == "extensions":
            return "adds to the forward's --format json, not used with --backward"
        if dest == "step":
            return "draws one forward tile update; --backward --format png draws every step"
        if dest == "query_block":
            return (
                f"not used with --backward --format {fmt}, which shows every query block of both passes "
                "(--format html shows the forward of --query-block beside the backward)"
            )
    if dest == "step":
        return f"draws one tile update of --format png, not --format {fmt}"
    if dest == "extensions":
        return f"adds to --format json, not --format {fmt}"
    return f"not used with the {mode.value} replay's --format {fmt}"


def refused_option(args: argparse.Namespace, dests: list[str]) -> str | None:
    """The first of the options ``dests`` given in ``args`` (not None: every option's default is None until
    the mode's defaults are filled in) that its mode and format do not read, named with the reason."""
    mode = mode_of(args)
    fmt = args.format or "table"
    reads = READS[mode][fmt]
    for dest in dests:
        value = getattr(args, dest)
        if dest in SELECTORS or value is None or dest in reads:
            continue
        return f"argument {option_name(dest)}: {_why_not(dest, mode, fmt, value)}"
    return None
