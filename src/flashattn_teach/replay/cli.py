"""``flashattn-teach replay``: replay one query block's tile updates as a table, JSON, HTML or PNG.

``--decode`` replays one decode step against a KV cache instead (split-KV ranges, then the merges;
:mod:`.decode_cli`). ``--backward`` replays the backward of the same inputs (:mod:`.backward_cli`). Each
mode lists the options it reads per ``--format`` (:mod:`.cli_modes`); any other option given is refused
by name, never ignored.

Inputs are made as the recorded teaching example made them: ``torch.manual_seed(seed)``, then three
``torch.randn(batch, seq_len, head_dim, dtype=dtype)`` calls, in the order q, k, v. With ``--batch``
above 1, batch element ``--batch-index`` (default 0) is replayed.

The mask contract's options (see :mod:`flashattn_teach.masks`) are all here: ``--window L,R`` (flash-attn's
window, -1 unbounded), ``--softcap X``, ``--alibi SLOPE`` (one slope, or one per batch element),
``--seqlens-k N`` (one key length, or one per batch element), and a mask: ``--pad-left K`` (one count, or
one per batch element) builds the left-padding mask a Hugging Face tokenizer's ``attention_mask`` gives,
bool ``(B, 1, N)``, False on each element's first ``K`` keys (``N`` and ``K`` in ``[0, --seq-len]``);
``--mask FILE.pt`` reads any bool or additive mask saved with ``torch.save``, broadcastable to ``(B, N, N)``
(or Hugging Face's ``(B, 1, N, N)``). ``--sinks X`` gives the replayed head an attention sink of logit ``X``.
"""

from __future__ import annotations

import argparse
import functools
import math
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch

from .._cli_types import (
    finite_float,
    finite_positive_float,
    nonnegative_int,
    output_path,
    positive_int,
    seed,
)
from .backward_cli import (
    add_backward_arguments,
    backward_mode_error,
    backward_tiles_error,
    make_dO,
    page_backward,
    render_backward,
)
from .cli_common import (
    DTYPES,
    FORMATS,
    counts,
    error,
    floats,
    open_output,
    per_batch,
    reported,
    require_format,
    sinks_error,
    window,
)
from .cli_modes import SELECTORS, refused_option
from .decode_cli import add_decode_arguments, run_decode
from .html import MAX_DRAWN_CELLS
from .manifest import MAX_EXTENSION_TILES, extension_tiles
from .replay import ORDERS, Replay, replay
from .schedule import blocks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the ``replay`` subcommand; every one but the mode selectors stays None until given
    (``run`` fills in the defaults), so that one given to a mode that does not read it is refused even at
    its default value."""
    _add_options(parser)
    parser.set_defaults(**dict.fromkeys(option_dests()))


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=seed, default=0, help="torch.manual_seed before making q, k, v (default 0)")
    parser.add_argument("--batch", type=positive_int, default=1, help="B in (B, N, D) (default 1)")
    parser.add_argument(
        "--batch-index", type=nonnegative_int, default=0, help="which batch element to replay (default 0)"
    )
    parser.add_argument("--seq-len", type=positive_int, default=6, help="N, queries and keys (default 6)")
    parser.add_argument("--head-dim", type=positive_int, default=4, help="D (default 4)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float64", help="input dtype (default float64)")
    parser.add_argument("--block-m", type=positive_int, default=2, help="BLOCK_M, query rows per tile (default 2)")
    parser.add_argument("--block-n", type=positive_int, default=2, help="BLOCK_N, key columns per tile (default 2)")
    parser.add_argument(
        "--query-block", type=nonnegative_int, default=0, help="i, the query block to replay (default 0)"
    )
    parser.add_argument(
        "--causal",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="causal masking; tiles above the diagonal are skipped (default: off, on with --decode)",
    )
    parser.add_argument(
        "--causal-align",
        choices=("top_left", "bottom_right"),
        default=None,
        help="with --causal, --window or --alibi: where their diagonal lies (default top_left)",
    )
    parser.add_argument("--scale", type=finite_float, default=None, help="softmax scale (default 1/sqrt(D))")
    parser.add_argument(
        "--order",
        choices=ORDERS,
        default="query_major",
        help="query_major (FlashAttention-2) or key_major (FlashAttention Alg. 1)",
    )
    parser.add_argument(
        "--window", type=window, default=None, metavar="L,R", help="sliding window (left, right); -1: unbounded"
    )
    parser.add_argument(
        "--softcap", type=finite_positive_float, default=None, metavar="X", help="scores -> X tanh(score / X)"
    )
    parser.add_argument(
        "--alibi", type=floats, default=None, metavar="SLOPE[,SLOPE...]", help="ALiBi slope, one or one per batch"
    )
    parser.add_argument(
        "--seqlens-k", type=counts, default=None, metavar="N[,N...]", help="key lengths, one or one per batch"
    )
    parser.add_argument(
        "--cu-seqlens",
        type=counts,
        default=None,
        metavar="0,N1,...,N",
        help="packed sequences: their boundaries on the sequence axis (batch 1)",
    )
    parser.add_argument(
        "--sinks",
        type=floats,
        default=None,
        metavar="SINK",
        help="attention sink of the one replayed head (GPT-OSS's logit); with --decode merged in after the splits",
    )
    masks = parser.add_mutually_exclusive_group()
    masks.add_argument(
        "--pad-left", type=counts, default=None, metavar="K[,K...]", help="HF left padding: hide the first K keys"
    )
    masks.add_argument("--mask", type=Path, default=None, metavar="FILE.pt", help="attn_mask saved with torch.save")
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format (default table)")
    parser.add_argument(
        "--extensions",
        action="store_true",
        help="--format json only: add the skipped tiles and the schedule to the seed format",
    )
    parser.add_argument(
        "--step",
        type=positive_int,
        default=None,
        help="--format png only: draw only this tile update (1-based); with --backward, only this step (1-based, "
        "the dK/dV pass's steps first, then the dQ pass's)",
    )
    parser.add_argument(
        "--out",
        type=output_path,
        default=None,
        help="output file (default stdout; required for png). --backward --format png without --step writes one "
        "picture per step beside it, OUT_stepNN.png, and the preprocess and the result to OUT",
    )
    add_decode_arguments(parser)
    add_backward_arguments(parser)


@functools.cache
def _defaults() -> dict[str, object]:
    parser = argparse.ArgumentParser()
    _add_options(parser)
    return vars(parser.parse_args([]))


def option_dests() -> list[str]:
    """The destinations of the subcommand's options, the mode selectors ``--decode`` and ``--backward``
    left out, in the parser's order."""
    return [dest for dest in _defaults() if dest not in SELECTORS]


def _with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with each option not given set to its default."""
    missing = {dest: _defaults()[dest] for dest in option_dests() if getattr(args, dest) is None}
    return argparse.Namespace(**{**vars(args), **missing})


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


def make_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``manual_seed(seed)``, then ``randn(B, N, D)`` three times: q, k, v (the recorded example's recipe)."""
    torch.manual_seed(args.seed)
    shape, dtype = (args.batch, args.seq_len, args.head_dim), DTYPES[args.dtype]
    q = torch.randn(shape, dtype=dtype)
    k = torch.randn(shape, dtype=dtype)
    v = torch.randn(shape, dtype=dtype)
    return q, k, v


def _option_error(args: argparse.Namespace) -> str | None:
    """What is wrong with options that are each valid but do not fit together, naming the option."""
    T_r = blocks(args.seq_len, args.block_m)
    if args.query_block >= T_r:
        return (
            f"argument --query-block: must be in [0, {T_r}) for --seq-len {args.seq_len} and "
            f"--block-m {args.block_m}, got {args.query_block}"
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
    if args.format == "png" and args.out is None:
        return "argument --format: png needs --out FILE"
    if args.format in ("html", "png") and args.seq_len**2 > MAX_DRAWN_CELLS:
        return (
            f"argument --format: {args.format} draws every one of the N x N = {args.seq_len**2} score cells, at "
            f"most {MAX_DRAWN_CELLS}: use --seq-len {math.isqrt(MAX_DRAWN_CELLS)} or less, or --format table or json"
        )
    return None


def _output_error(r: Replay, args: argparse.Namespace) -> str | None:
    """What the chosen output cannot show of ``r``, naming the option (``--backward``'s steps: its own check)."""
    if args.format == "json" and args.extensions and extension_tiles(r) > MAX_EXTENSION_TILES:
        return (
            f"argument --extensions: would list up to {extension_tiles(r)} tiles, more than {MAX_EXTENSION_TILES}: "
            "use larger --block-m/--block-n or leave --extensions out"
        )
    if args.format == "png" and args.step is not None and not args.backward and args.step > len(r.steps):
        return f"argument --step: must be in [1, {len(r.steps)}] for this replay, got {args.step}"
    return None


def run(args: argparse.Namespace) -> int:
    """Run the ``replay`` subcommand; returns the exit status."""
    problem = backward_mode_error(args) or refused_option(args, option_dests())
    if problem is not None:
        return error(problem)
    args = _with_defaults(args)
    if args.decode:
        return run_decode(args)
    problem = _option_error(args) or backward_tiles_error(args)
    if problem is not None:
        return error(problem)
    require_format(args.format)
    try:
        q, k, v = make_inputs(args)
        # the 4th randn of the stream: for --backward, and for the page's Backward tab
        dO = make_dO(args) if args.backward or args.format == "html" else None
    except RuntimeError as problem:  # torch cannot allocate (B, N, D) this large
        shape = (args.batch, args.seq_len, args.head_dim)
        return error(f"cannot make q, k, v of shape {shape}: {str(problem).splitlines()[0]}")
    return reported(functools.partial(_replay_and_render, q, k, v, dO, args), args.out)


def _replay_and_render(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dO: torch.Tensor | None, args: argparse.Namespace
) -> str | None:
    """The replay of ``q, k, v`` with the command's options, written in ``--format``; else what the output
    cannot show of it."""
    masks = make_mask_options(args)
    r = replay(
        q,
        k,
        v,
        block_m=args.block_m,
        block_n=args.block_n,
        query_block=args.query_block,
        causal=bool(args.causal),
        causal_align=args.causal_align or "top_left",
        scale=args.scale,
        order=args.order,
        batch_index=args.batch_index,
        window=masks.window,
        softcap=masks.softcap,
        alibi_slopes=masks.alibi_slopes,
        seqlens_k=masks.seqlens_k,
        attn_mask=masks.attn_mask,
        cu_seqlens=masks.cu_seqlens,
        sinks=None if args.sinks is None else args.sinks[0],
    )
    problem = _output_error(r, args)
    if problem is not None:
        return problem
    if args.backward:
        assert dO is not None
        return render_backward(r, dO, args)
    else:
        _render(r, args, dO)
    return None


def _render(r: Replay, args: argparse.Namespace, dO: torch.Tensor | None) -> None:
    if args.format == "png":
        from .png import render_png

        render_png(r, args.out, step=args.step)
        return
    with open_output(args.out) as out:
        if args.format == "table":
            from .table import render_table

            render_table(r, out)
        elif args.format == "json":
            from .manifest import write_json

            write_json(r, out, extensions=args.extensions)
            out.write("\n")
        else:
            from .html import render_html

            assert dO is not None
            out.write(render_html(r, backward=page_backward(r, dO)))
