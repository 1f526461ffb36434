"""``flashattn-teach replay``: replay one query block's tile updates as a table, JSON, HTML or PNG.

Inputs are made as the recorded teaching example made them: ``torch.manual_seed(seed)``, then three
``torch.randn(batch, seq_len, head_dim, dtype=dtype)`` calls, in the order q, k, v. With ``--batch``
above 1, batch element ``--batch-index`` (default 0) is replayed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .replay import ORDERS, Replay, replay

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FORMATS = ("table", "json", "html", "png")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the ``replay`` subcommand."""
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed before making q, k, v (default 0)")
    parser.add_argument("--batch", type=int, default=1, help="B in (B, N, D) (default 1)")
    parser.add_argument("--batch-index", type=int, default=0, help="which batch element to replay (default 0)")
    parser.add_argument("--seq-len", type=int, default=6, help="N, queries and keys (default 6)")
    parser.add_argument("--head-dim", type=int, default=4, help="D (default 4)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float64", help="input dtype (default float64)")
    parser.add_argument("--block-m", type=int, default=2, help="BLOCK_M, query rows per tile (default 2)")
    parser.add_argument("--block-n", type=int, default=2, help="BLOCK_N, key columns per tile (default 2)")
    parser.add_argument("--query-block", type=int, default=0, help="i, the query block to replay (default 0)")
    parser.add_argument("--causal", action="store_true", help="causal masking; tiles above the diagonal are skipped")
    parser.add_argument("--causal-align", choices=("top_left", "bottom_right"), default="top_left")
    parser.add_argument("--scale", type=float, default=None, help="softmax scale (default 1/sqrt(D))")
    parser.add_argument(
        "--order",
        choices=ORDERS,
        default="query-major",
        help="query-major (FlashAttention-2) or key-major (FlashAttention Alg. 1)",
    )
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format (default table)")
    parser.add_argument(
        "--extensions", action="store_true", help="json: add the skipped tiles and the schedule to the seed format"
    )
    parser.add_argument("--step", type=int, default=None, help="png: draw only this tile update (1-based)")
    parser.add_argument("--out", type=Path, default=None, help="output file (default stdout; required for png)")


def make_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``manual_seed(seed)``, then ``randn(B, N, D)`` three times: q, k, v (the recorded example's recipe)."""
    torch.manual_seed(args.seed)
    shape, dtype = (args.batch, args.seq_len, args.head_dim), DTYPES[args.dtype]
    q = torch.randn(shape, dtype=dtype)
    k = torch.randn(shape, dtype=dtype)
    v = torch.randn(shape, dtype=dtype)
    return q, k, v


def run(args: argparse.Namespace) -> int:
    """Run the ``replay`` subcommand; returns the exit status."""
    if args.format == "png" and args.out is None:
        print("flashattn-teach replay: --format png needs --out FILE", file=sys.stderr)
        return 2
    q, k, v = make_inputs(args)
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
        if args.format == "png":
            from .png import render_png

            render_png(r, args.out, step=args.step)
        elif args.format == "table":
            from .table import render_table

            if args.out is None:
                render_table(r)
            else:
                with args.out.open("w", encoding="utf-8") as f:
                    render_table(r, f)
        else:
            _write(args.out, r.to_json(extensions=args.extensions) + "\n" if args.format == "json" else _html(r))
    except (TypeError, ValueError) as error:
        print(f"flashattn-teach replay: {error}", file=sys.stderr)
        return 2
    return 0


def _html(r: Replay) -> str:
    from .html import render_html

    return render_html(r)


def _write(out: Path | None, text: str) -> None:
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashattn-teach replay", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
