"""``flashattn-teach replay``: replay one query block's tile updates as a table, JSON, HTML or PNG.

Inputs are made as the recorded teaching example made them: ``torch.manual_seed(seed)``, then three
``torch.randn(batch, seq_len, head_dim, dtype=dtype)`` calls, in the order q, k, v. With ``--batch``
above 1, batch element ``--batch-index`` (default 0) is replayed.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import torch

from .._cli_types import ArgumentParser, finite_float, nonnegative_int, output_path, positive_int, seed
from .html import MAX_DRAWN_CELLS
from .manifest import MAX_EXTENSION_TILES, extension_tiles
from .replay import ORDERS, Replay, replay
from .schedule import blocks

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FORMATS = ("table", "json", "html", "png")
PROG = "flashattn-teach replay"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the ``replay`` subcommand."""
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
    parser.add_argument("--causal", action="store_true", help="causal masking; tiles above the diagonal are skipped")
    parser.add_argument("--causal-align", choices=("top_left", "bottom_right"), default="top_left")
    parser.add_argument("--scale", type=finite_float, default=None, help="softmax scale (default 1/sqrt(D))")
    parser.add_argument(
        "--order",
        choices=ORDERS,
        default="query_major",
        help="query_major (FlashAttention-2) or key_major (FlashAttention Alg. 1)",
    )
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format (default table)")
    parser.add_argument(
        "--extensions", action="store_true", help="json: add the skipped tiles and the schedule to the seed format"
    )
    parser.add_argument("--step", type=positive_int, default=None, help="png: draw only this tile update (1-based)")
    parser.add_argument("--out", type=output_path, default=None, help="output file (default stdout; required for png)")


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
    if args.format == "png" and args.out is None:
        return "argument --format: png needs --out FILE"
    if args.format in ("html", "png") and args.seq_len**2 > MAX_DRAWN_CELLS:
        return (
            f"argument --format: {args.format} draws every one of the N x N = {args.seq_len**2} score cells, at "
            f"most {MAX_DRAWN_CELLS}: use --seq-len {math.isqrt(MAX_DRAWN_CELLS)} or less, or --format table or json"
        )
    return None


def _output_error(r: Replay, args: argparse.Namespace) -> str | None:
    """What the chosen output cannot show of ``r``, naming the option."""
    if args.format == "json" and args.extensions and extension_tiles(r) > MAX_EXTENSION_TILES:
        return (
            f"argument --extensions: would list up to {extension_tiles(r)} tiles, more than {MAX_EXTENSION_TILES}: "
            "use larger --block-m/--block-n or leave --extensions out"
        )
    if args.format == "png" and args.step is not None and args.step > len(r.steps):
        return f"argument --step: must be in [1, {len(r.steps)}] for this replay, got {args.step}"
    return None


def run(args: argparse.Namespace) -> int:
    """Run the ``replay`` subcommand; returns the exit status."""
    problem = _option_error(args)
    if problem is not None:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    try:
        q, k, v = make_inputs(args)
    except RuntimeError as error:  # torch cannot allocate (B, N, D) this large
        shape = (args.batch, args.seq_len, args.head_dim)
        print(f"{PROG}: error: cannot make q, k, v of shape {shape}: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    try:
        r = replay(
            q,
            k,
            v,
            block_m=args.block_m,
            block_n=args.block_n,
            query_block=args.query_block,
            causal=args.causal,
            causal_align=args.causal_align,
            scale=args.scale,
            order=args.order,
            batch_index=args.batch_index,
        )
        problem = _output_error(r, args)
        if problem is not None:
            print(f"{PROG}: error: {problem}", file=sys.stderr)
            return 2
        _render(r, args)
    except (TypeError, ValueError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        if isinstance(error, BrokenPipeError):  # a closed pipe is the caller's to handle
            raise
        print(f"{PROG}: error: cannot write {args.out}: {error.strerror}", file=sys.stderr)
        return 2
    return 0


def _render(r: Replay, args: argparse.Namespace) -> None:
    if args.format == "png":
        from .png import render_png

        render_png(r, args.out, step=args.step)
        return
    with _open(args.out) as out:
        if args.format == "table":
            from .table import render_table

            render_table(r, out)
        elif args.format == "json":
            from .manifest import write_json

            write_json(r, out, extensions=args.extensions)
            out.write("\n")
        else:
            from .html import render_html

            out.write(render_html(r))


@contextmanager
def _open(path: Path | None) -> Iterator[IO[str]]:
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


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
