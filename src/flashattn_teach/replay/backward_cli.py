"""``flashattn-teach replay --backward``: the backward replay of the same inputs, as a table, JSON, HTML or PNG.

The inputs are the replay's (``torch.manual_seed(seed)``, then ``randn`` for q, k, v) and ``dO`` is the
fourth ``randn(B, N, D)`` of the same stream, so ``--seed`` fixes all four. Every mask option of the replay
applies. ``--format html`` writes the replay page opened on its "Backward" view (the forward view of
``--query-block`` beside it). Refused by name (:mod:`.cli_modes`): ``--decode`` (a decode step has no
backward here), ``--order`` (the backward has its own loop order: key blocks outer for dK/dV, query blocks
outer for dQ), ``--extensions`` and ``--step`` (forward outputs), ``--query-block`` but with ``--format
html`` (the other formats show every query block). ``--format png`` draws every step of both passes
(:mod:`.backward_png`).
"""

from __future__ import annotations

import argparse

import torch

from .backward_manifest import MAX_BACKWARD_TILES, shown_by_default
from .backward_replay import BackwardReplay, backward_of
from .cli_common import DTYPES, open_output
from .replay import Replay
from .schedule import blocks

BACKWARD_FORMATS = ("table", "json", "html", "png")
# Every output lists every tile of both passes with its matrices and equations: a backward replay is for small
# grids (T_r x T_c tiles).


def add_backward_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the backward (--backward)")
    group.add_argument(
        "--backward",
        action="store_true",
        help="replay the backward (FA2 Alg. 2: delta, the dK/dV pass, the dQ pass); dO is the 4th randn",
    )


def backward_mode_error(args: argparse.Namespace) -> str | None:
    """``--backward`` with ``--decode``, named (checked before either mode runs)."""
    if args.backward and args.decode:
        return "argument --backward: not used with --decode (a decode step has no backward replay)"
    return None


def backward_tiles_error(args: argparse.Namespace) -> str | None:
    """A ``--backward`` grid too large to list, naming the options (after the defaults are filled in; the
    options ``--backward`` does not read are refused before, :mod:`.cli_modes`)."""
    if not args.backward:
        return None
    if args.format not in BACKWARD_FORMATS:
        return f"argument --format: --backward writes {', '.join(BACKWARD_FORMATS)}, got {args.format}"
    tiles = blocks(args.seq_len, args.block_m) * blocks(args.seq_len, args.block_n)
    if tiles > MAX_BACKWARD_TILES:
        return (
            f"argument --backward: lists every tile of both passes, and T_r x T_c = {tiles} is more than "
            f"{MAX_BACKWARD_TILES}: use larger --block-m/--block-n or a shorter --seq-len"
        )
    return None


def make_dO(args: argparse.Namespace) -> torch.Tensor:
    """``dO (B, N, D)``: the ``randn`` after q, k, v of :func:`~.cli.make_inputs` (call it right after)."""
    return torch.randn((args.batch, args.seq_len, args.head_dim), dtype=DTYPES[args.dtype])


def page_backward(r: Replay, dO: torch.Tensor) -> BackwardReplay | bool:
    """The ``backward=`` of the forward replay's page: the backward with the CLI's ``dO`` when the page shows
    one by default (:func:`~.backward_manifest.shown_by_default`), else False."""
    return backward_of(r, dO=dO) if shown_by_default(r) else False


def render_backward(r: Replay, dO: torch.Tensor, args: argparse.Namespace) -> None:
    """The backward replay of ``r``'s inputs and options with ``dO``, in ``--format``."""
    br: BackwardReplay = backward_of(r, dO=dO)
    if args.format == "png":  # --out is required for png (checked with the forward's options)
        from .backward_png import render_backward_png

        render_backward_png(br, args.out)
        return
    with open_output(args.out) as out:
        if args.format == "table":
            from .backward_table import render_backward_table

            render_backward_table(br, out)
        elif args.format == "json":
            from .backward_manifest import write_backward_json

            write_backward_json(br, out)
            out.write("\n")
        else:
            from .html import render_html

            out.write(render_html(r, open_view="backward", backward=br))
