"""``flashattn-teach replay forward|backward|decode``: a replay as a table, JSON, HTML or PNG.

``forward`` replays one query block's tile updates (FA2 Alg. 1; ``--order key_major``: FA1 Alg. 1),
``backward`` both passes of the backward of the same inputs (FA2 Alg. 2: delta, dK/dV, dQ; ``dO`` is the
fourth ``randn``), ``decode`` one decode step against a KV cache (the split-KV ranges, then the merges; causal
unless ``--no-causal``). Each subcommand takes only the options it reads: any other is an error naming it.
The inputs: :mod:`.cli_common`. The mask contract's options (:mod:`flashattn_teach.masks`): ``--window L,R``
(-1 unbounded), ``--softcap X``, ``--alibi SLOPE`` (one, or one per batch element), ``--sinks X`` (the head's
attention sink); the tiled replays add ``--seqlens-k N``, ``--cu-seqlens``, and a mask: ``--pad-left K``
(Hugging Face's left padding, bool ``(B, 1, N)``) or ``--mask FILE.pt`` (any bool or additive mask saved with
``torch.save``, broadcastable to ``(B, N, N)`` or ``(B, 1, N, N)``).

The old spelling, ``replay [--backward | --decode] ...``, still runs, with a ``DeprecationWarning`` that names
the subcommand (:func:`normalize_argv`).
"""

from __future__ import annotations

import argparse
import functools
import math
import warnings
from collections.abc import Sequence
from pathlib import Path

from .._cli_types import (
    ArgumentParser,
    finite_float,
    finite_positive_float,
    nonnegative_int,
    output_path,
    positive_int,
    seed,
)
from .cli_common import DTYPES, FORMATS, counts, error, floats, make_inputs, sinks_error, window
from .cli_run import run_backward, run_decode, run_forward
from .kernel_trace import KERNELS
from .replay import ORDERS, SOURCES

SCENARIOS = ("forward", "backward", "decode")
HELP = {
    "forward": "one query block's tile updates (FA2 Alg. 1, or FA1's with --order key_major)",
    "backward": "the backward's three phases, every tile (FA2 Alg. 2); dO is the 4th randn",
    "decode": "one decode step against a KV cache: its split-KV ranges, then the merges",
}
# Why a subcommand does not take an option another one does, where the name alone does not say.
WHY_NOT = {
    ("backward", "--query-block"): "the backward shows every query block of both passes",
    ("backward", "--order"): "the backward runs key blocks outer for dK/dV and query blocks outer for dQ",
    ("backward", "--extensions"): "the backward's JSON lists every tile already",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommands ``forward``, ``backward`` and ``decode``, each with its own options."""
    sub = parser.add_subparsers(dest="scenario", metavar="SCENARIO", required=True, parser_class=_Subcommand)
    for name in SCENARIOS:
        _add_options(sub.add_parser(name, help=HELP[name], description=HELP[name]), name)


def _add_options(p: argparse.ArgumentParser, scenario: str) -> None:
    p.add_argument("--seed", type=seed, default=0, help="torch.manual_seed before making the inputs (default 0)")
    p.add_argument("--batch", type=positive_int, default=1, help="B (default 1)")
    p.add_argument("--batch-index", type=nonnegative_int, default=0, help="which batch element to replay (default 0)")
    p.add_argument("--head-dim", type=positive_int, default=4, help="D (default 4)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float64", help="input dtype (default float64)")
    p.add_argument("--block-n", type=positive_int, default=2, help="BLOCK_N, key columns per tile (default 2)")
    p.add_argument("--scale", type=finite_float, default=None, help="softmax scale (default 1/sqrt(D))")
    p.add_argument("--window", type=window, default=None, metavar="L,R", help="sliding window; -1: unbounded")
    p.add_argument("--softcap", type=finite_positive_float, default=None, metavar="X", help="S -> X tanh(S / X)")
    p.add_argument("--alibi", type=floats, default=None, metavar="SLOPE[,...]", help="ALiBi slope(s), one per batch")
    p.add_argument("--sinks", type=floats, default=None, metavar="SINK", help="the replayed head's attention sink")
    p.add_argument("--format", choices=FORMATS, default="table", help="output format (default table)")
    p.add_argument("--out", type=output_path, default=None, help="output file (default stdout; required for png)")
    if scenario == "decode":
        _add_decode_options(p)
        return
    p.add_argument("--seq-len", type=positive_int, default=6, help="N, queries and keys (default 6)")
    p.add_argument("--block-m", type=positive_int, default=2, help="BLOCK_M, query rows per tile (default 2)")
    p.add_argument(
        "--causal", action=argparse.BooleanOptionalAction, default=False, help="causal masking (default off)"
    )
    p.add_argument("--causal-align", choices=("top_left", "bottom_right"), default=None, help="where the diagonal lies")
    p.add_argument("--seqlens-k", type=counts, default=None, metavar="N[,N...]", help="key lengths, one per batch")
    p.add_argument(
        "--cu-seqlens", type=counts, default=None, metavar="0,N1,...,N", help="packed sequences' boundaries (B = 1)"
    )
    masks = p.add_mutually_exclusive_group()
    masks.add_argument("--pad-left", type=counts, default=None, metavar="K[,K...]", help="hide the first K keys")
    masks.add_argument("--mask", type=Path, default=None, metavar="FILE.pt", help="attn_mask saved with torch.save")
    p.add_argument(
        "--step",
        type=positive_int,
        default=None,
        help="--format png only: draw only this step (1-based; backward: the dK/dV pass's steps, then the dQ "
        "pass's). The backward's png without --step writes every step beside --out, OUT_stepNN.png",
    )
    if scenario == "forward":
        p.add_argument("--query-block", type=nonnegative_int, default=0, help="i, the replayed query block")
        p.add_argument("--order", choices=ORDERS, default="query_major", help="FA2's loop order, or FA1's key_major")
        p.add_argument(
            "--source",
            choices=SOURCES,
            default="reference",
            help="triton: the tutorial kernel's own numbers (core/kernel.py's trace build) beside the reference's",
        )
        p.add_argument("--kernel", choices=KERNELS, default="core", help="--source triton: core, or production")
        p.add_argument("--extensions", action="store_true", help="--format json: add skipped tiles and equations")
    if scenario == "backward":
        p.add_argument(
            "--source",
            choices=SOURCES,
            default="reference",
            help="triton: the production dK/dV and dQ kernels' own numbers (their trace build) beside the reference's",
        )
        p.add_argument(
            "--deterministic", action="store_true", help="--source triton: the two-kernel backward, not dQ by atomics"
        )


def _add_decode_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal masking (default on)")
    p.add_argument("--cache-len", type=nonnegative_int, default=5, help="entries cached before the step (default 5)")
    p.add_argument("--new-kv", type=nonnegative_int, default=2, help="N_new_kv, keys the step writes (default 2)")
    p.add_argument("--new-queries", type=positive_int, default=1, help="N_new, the step's queries (default 1)")
    p.add_argument("--num-splits", type=positive_int, default=3, help="split-KV key ranges (default 3)")
    p.add_argument("--cache-size", type=positive_int, default=None, help="N_max (default cache-len + new-kv + 2)")
    p.add_argument("--merge-order", type=counts, default=None, metavar="S,S,...", help="the splits' merge order")
    p.add_argument("--source", choices=SOURCES, default="reference", help="triton: the decode kernel's own numbers")


@functools.cache
def options_of(scenario: str) -> frozenset[str]:
    """The option strings ``replay scenario`` takes."""
    p = argparse.ArgumentParser()
    _add_options(p, scenario)
    return frozenset(s for action in p._actions for s in action.option_strings)


def refusal(scenario: str, extras: Sequence[str]) -> str:
    """Why ``replay scenario`` refuses the first of ``extras``, the arguments it did not take, naming it."""
    flag = next((a.split("=")[0] for a in extras if a.startswith("-")), None)
    if flag is None:
        return f"unrecognized arguments: {' '.join(extras)}"
    if flag in ("--backward", "--decode"):
        return f"argument {flag}: the old spelling of `replay {flag[2:]}`, a subcommand of its own, not an option"
    owners = [name for name in SCENARIOS if flag in options_of(name)]
    if not owners:
        return f"unrecognized arguments: {' '.join(extras)}"
    why = WHY_NOT.get((scenario, flag))
    return f"argument {flag}: not an option of `replay {scenario}` (only of `replay {' and '.join(owners)}`)" + (
        f": {why}" if why else ""
    )


class _Subcommand(ArgumentParser):
    """A subcommand's parser: an option it does not take is its error, naming the option and its subcommand."""

    # argparse calls a subcommand's parse_known_args(arg_strings, None) and leaves what it did not take to the
    # parent, whose message would not say which subcommand takes the option
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(refusal(self.prog.rsplit(" ", 1)[-1], extras))
        return parsed, extras


def normalize_argv(argv: list[str]) -> list[str]:
    """``argv`` in the subcommand spelling. The old one (no subcommand; ``--backward`` or ``--decode`` for the
    other two) is rewritten with a ``DeprecationWarning`` naming the new command: it runs what it ran."""
    if argv and (argv[0] in SCENARIOS or argv[0] in ("-h", "--help")):
        return argv
    picked = [a for a in argv if a in ("--backward", "--decode")]
    scenario = picked[0][2:] if picked else "forward"
    rest = list(argv)
    if picked:
        rest.remove(picked[0])  # a second selector stays, for the subcommand to refuse by name
    old = " ".join(["flashattn-teach replay", *([picked[0]] if picked else [])])
    with warnings.catch_warnings():
        warnings.simplefilter("always", DeprecationWarning)  # a command line's user is the one to see it
        # "flashattn-teach replay:0: DeprecationWarning: ...", with no line of this file under it
        message = f"`{old} ...` is deprecated: use `flashattn-teach replay {scenario} ...`"
        warnings.warn_explicit(message, DeprecationWarning, filename="flashattn-teach replay", lineno=0)
    return [scenario, *rest]


def run(args: argparse.Namespace) -> int:
    """Run ``replay forward|backward|decode``; returns the exit status."""
    if args.scenario == "decode":
        return run_decode(args)
    if args.format == "png" and args.out is None:
        return error("argument --format: png needs --out FILE", args.scenario)
    if args.step is not None and args.format != "png":
        return error(f"argument --step: draws one step of --format png, not --format {args.format}", args.scenario)
    if args.scenario == "forward" and args.extensions and args.format != "json":
        return error(f"argument --extensions: adds to --format json, not --format {args.format}", args.scenario)
    problem = tiled_option_error(args)
    if problem is not None:
        return error(problem, args.scenario)
    try:
        q, k, v, dO = make_inputs(args)
    except RuntimeError as problem:  # torch cannot allocate (B, N, D) this large
        shape = (args.batch, args.seq_len, args.head_dim)
        return error(f"cannot make q, k, v of shape {shape}: {str(problem).splitlines()[0]}", args.scenario)
    if args.scenario == "forward":
        return run_forward(args, q, k, v, dO)
    return run_backward(args, q, k, v, dO)


def tiled_option_error(args: argparse.Namespace) -> str | None:
    """What is wrong with a forward or backward replay's options that are each valid but do not fit together,
    naming the option."""
    from .html import MAX_DRAWN_CELLS
    from .schedule import blocks

    T_r = blocks(args.seq_len, args.block_m)
    query_block = getattr(args, "query_block", 0)
    if query_block >= T_r:
        return (
            f"argument --query-block: must be in [0, {T_r}) for --seq-len {args.seq_len} and "
            f"--block-m {args.block_m}, got {query_block}"
        )
    if args.batch_index >= args.batch:
        return f"argument --batch-index: must be in [0, {args.batch}) for --batch {args.batch}, got {args.batch_index}"
    for option, values in (("--seqlens-k", args.seqlens_k), ("--pad-left", args.pad_left)):
        # A key length, or a count of padded keys, from 0 (every key padded: the row sees none) to N.
        if values is not None and max(values) > args.seq_len:
            given = ",".join(map(str, values))
            return f"argument {option}: must be in [0, {args.seq_len}] for --seq-len {args.seq_len}, got {given}"
    for option, value in (("--seqlens-k", args.seqlens_k), ("--pad-left", args.pad_left), ("--mask", args.mask)):
        if args.cu_seqlens is not None and value is not None:  # replay() refuses them: name the option here
            return f"argument {option}: not used with --cu-seqlens (each packed sequence's keys are its own)"
    problem = sinks_error(args.sinks)
    if problem is not None:
        return problem
    uses_diagonal = args.causal or args.window is not None or args.alibi is not None  # masks.py: i + off
    if args.causal_align is not None and not uses_diagonal:
        return (
            f"argument --causal-align: aligns the diagonal of --causal, --window and --alibi, needs one of them "
            f"(got --causal-align {args.causal_align})"
        )
    if args.format in ("html", "png") and args.seq_len**2 > MAX_DRAWN_CELLS:
        return (
            f"argument --format: {args.format} draws every one of the N x N = {args.seq_len**2} score cells, at "
            f"most {MAX_DRAWN_CELLS}: use --seq-len {math.isqrt(MAX_DRAWN_CELLS)} or less, or --format table or json"
        )
    return None
