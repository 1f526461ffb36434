"""``flashattn-teach replay --decode``: replay one decode step (split-KV, then the merges) as a table, JSON, PNG
or a self-contained page (``--format html``: :mod:`.decode_html`).

Inputs are made in the recorded example's manner: ``torch.manual_seed(seed)``, then ``torch.randn`` for
``q (B, 1, N_new, D)``, ``k_cache, v_cache (B, 1, N_max, D)`` and the new ``k, v (B, 1, N_new_kv, D)``, in
that order (one head; the cache slots past ``--cache-len`` hold random values that the step overwrites or
never reads). With ``--batch`` above 1, batch element ``--batch-index`` is replayed. Causal masking is on
unless ``--no-causal`` (the command's default, passed to the replay by name: ``flash_attention_with_kvcache``
and ``replay_decode`` default to off); ``--window``, ``--softcap``, ``--alibi`` and
``--scale`` are those of the replay; ``--sinks X`` gives the head a sink, merged in after the splits.
"""

from __future__ import annotations

import argparse
import functools

import torch

from .._cli_types import nonnegative_int, positive_int
from .cli_common import DTYPES, counts, error, open_output, per_batch, reported, require_format, sinks_error
from .decode_replay import DecodeReplay, replay_decode

DECODE_FORMATS = ("table", "json", "png", "html")
EXTRA_SLOTS = 2  # unused cache slots drawn after the step's keys, by default


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``--decode``; the seed, batch, head dim, dtype, BLOCK_N, masks and output are shared."""
    group = parser.add_argument_group("a decode step (--decode)")
    group.add_argument("--decode", action="store_true", help="replay one decode step against a KV cache")
    group.add_argument(
        "--cache-len", type=nonnegative_int, default=5, help="entries cached before the step (default 5)"
    )
    group.add_argument("--new-kv", type=nonnegative_int, default=2, help="N_new_kv, keys the step writes (default 2)")
    group.add_argument("--new-queries", type=positive_int, default=1, help="N_new, the step's queries (default 1)")
    group.add_argument("--num-splits", type=positive_int, default=3, help="split-KV key ranges (default 3)")
    group.add_argument(
        "--cache-size", type=positive_int, default=None, help=f"N_max (default cache-len + new-kv + {EXTRA_SLOTS})"
    )
    group.add_argument(
        "--merge-order", type=counts, default=None, metavar="S,S,...", help="the order the splits are merged in"
    )


def cache_size(args: argparse.Namespace) -> int:
    """``N_max``: ``--cache-size``, or room for the step's keys and a few unused slots."""
    return args.cache_size if args.cache_size is not None else args.cache_len + args.new_kv + EXTRA_SLOTS


def make_decode_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """``manual_seed(seed)``, then ``randn`` five times: q, k_cache, v_cache, k, v (one head)."""
    torch.manual_seed(args.seed)
    B, D, dtype = args.batch, args.head_dim, DTYPES[args.dtype]
    shapes = [(B, 1, args.new_queries, D), *[(B, 1, cache_size(args), D)] * 2, *[(B, 1, args.new_kv, D)] * 2]
    return tuple(torch.randn(shape, dtype=dtype) for shape in shapes)


def decode_option_error(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--decode``'s options taken together, naming the option."""
    L = args.cache_len + args.new_kv
    if cache_size(args) < L:
        return f"argument --cache-size: must hold --cache-len + --new-kv = {L} keys, got {args.cache_size}"
    if args.batch_index >= args.batch:
        return f"argument --batch-index: must be in [0, {args.batch}) for --batch {args.batch}, got {args.batch_index}"
    if args.merge_order is not None and sorted(args.merge_order) != list(range(args.num_splits)):
        return f"argument --merge-order: must list every split 0..{args.num_splits - 1} once, got {args.merge_order}"
    problem = sinks_error(args.sinks)
    if problem is not None:
        return problem
    if args.format not in DECODE_FORMATS:
        return f"argument --format: --decode writes {', '.join(DECODE_FORMATS)}, got {args.format}"
    if args.format == "png" and args.out is None:
        return "argument --format: png needs --out FILE"
    return None


def run_decode(args: argparse.Namespace) -> int:
    """Run ``replay --decode``; returns the exit status."""
    problem = decode_option_error(args)
    if problem is not None:
        return error(problem)
    require_format(args.format)
    return reported(functools.partial(_replay_and_render, args), args.out)


def _replay_and_render(args: argparse.Namespace) -> None:
    """The decode replay of the command's inputs and options, written in ``--format``."""
    q, k_cache, v_cache, k, v = make_decode_inputs(args)
    slopes = per_batch("--alibi", args.alibi, args.batch)
    r = replay_decode(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=args.cache_len,
        block_n=args.block_n,
        num_splits=args.num_splits,
        batch_index=args.batch_index,
        causal=args.causal is not False,  # on unless --no-causal (the call's default is off)
        scale=args.scale,
        window=args.window,
        softcap=args.softcap,
        alibi_slopes=None if slopes is None else torch.tensor(slopes, dtype=torch.float64).reshape(-1, 1),
        merge_order=args.merge_order,
        sinks=None if args.sinks is None else torch.tensor(args.sinks, dtype=torch.float64),
    )
    _render(r, args)


def _render(r: DecodeReplay, args: argparse.Namespace) -> None:
    if args.format == "png":
        from .decode_png import render_decode_png

        render_decode_png(r, args.out)
        return
    with open_output(args.out) as out:
        if args.format == "table":
            from .decode_table import render_decode_table

            render_decode_table(r, out)
        elif args.format == "html":
            from .decode_html import render_decode_html

            out.write(render_decode_html(r))
        else:
            from .decode_manifest import write_decode_json

            write_decode_json(r, out)
            out.write("\n")
