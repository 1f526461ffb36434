"""The three subcommands of ``flashattn-teach replay`` run: each replays its scenario and writes ``--format``.

``backward --format png`` draws one picture per step (:mod:`.png.backward`): ``--step n`` that step to
``--out``; without it every step of both passes to ``OUT_stepNN.png`` and the preprocess and the result to
``--out``, and it prints the files it wrote. ``backward --format html`` writes the replay page opened on its
"Backward" view, beside the forward of query block 0.
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch import Tensor

from .backward_replay import BackwardReplay, backward_of
from .cli_common import (
    cache_size,
    error,
    make_decode_inputs,
    make_mask_options,
    open_output,
    per_batch,
    reported,
    require_format,
    sinks_error,
)
from .decode_replay import DecodeReplay, replay_decode
from .manifest import MAX_BACKWARD_TILES, MAX_EXTENSION_TILES, extension_tiles, shown_by_default
from .replay import Replay, replay
from .schedule import blocks


def forward_of(args: argparse.Namespace, q: Tensor, k: Tensor, v: Tensor) -> Replay:
    """The forward replay of ``q, k, v`` with the command's options (the backward's: of query block 0)."""
    masks = make_mask_options(args)
    return replay(
        q,
        k,
        v,
        block_m=args.block_m,
        block_n=args.block_n,
        query_block=getattr(args, "query_block", 0),
        causal=args.causal,
        causal_align=args.causal_align or "top_left",
        scale=args.scale,
        order=getattr(args, "order", "query_major"),
        source=args.source if args.scenario == "forward" else "reference",  # the backward's page: the reference's
        kernel=getattr(args, "kernel", "core"),
        batch_index=args.batch_index,
        window=masks.window,
        softcap=masks.softcap,
        alibi_slopes=masks.alibi_slopes,
        seqlens_k=masks.seqlens_k,
        attn_mask=masks.attn_mask,
        cu_seqlens=masks.cu_seqlens,
        sinks=None if args.sinks is None else args.sinks[0],
    )


def run_forward(args: argparse.Namespace, q: Tensor, k: Tensor, v: Tensor, dO: Tensor) -> int:
    """``replay forward``: its exit status."""
    require_format(args.format)
    return reported(functools.partial(_forward, args, q, k, v, dO), args.out, args.scenario)


def _forward(args: argparse.Namespace, q: Tensor, k: Tensor, v: Tensor, dO: Tensor) -> str | None:
    r = forward_of(args, q, k, v)
    if args.format == "json" and args.extensions and extension_tiles(r) > MAX_EXTENSION_TILES:
        return (
            f"argument --extensions: would list up to {extension_tiles(r)} tiles, more than {MAX_EXTENSION_TILES}: "
            "use larger --block-m/--block-n or leave --extensions out"
        )
    if args.format == "png" and args.step is not None and args.step > len(r.steps):
        return f"argument --step: must be in [1, {len(r.steps)}] for this replay, got {args.step}"
    # the page's Backward tab, with the command's dO, when the page shows one by default
    render(r, args, backward=backward_of(r, dO=dO) if shown_by_default(r) else False)
    return None


def render(
    r: Replay | BackwardReplay | DecodeReplay,
    args: argparse.Namespace,
    backward: BackwardReplay | bool = False,
    page: Replay | None = None,
) -> None:
    """``r`` in ``--format`` to ``--out``: one renderer per format serves the three scenarios. ``backward``: the
    forward page's Backward tab; a backward replay's page is the forward replay ``page``'s, opened on it."""
    if args.format == "png":
        from .png import render_png

        render_png(r, args.out, step=getattr(args, "step", None))
        return
    with open_output(args.out) as out:
        if args.format == "table":
            from .table import render_table

            render_table(r, out)
        elif args.format == "json":
            from .manifest import write_json

            write_json(r, out, extensions=getattr(args, "extensions", False))
            out.write("\n")
        elif isinstance(r, BackwardReplay):
            from .html import render_html

            assert page is not None
            out.write(render_html(page, open_view="backward", backward=r))
        else:
            from .html import render_html

            out.write(render_html(r) if isinstance(r, DecodeReplay) else render_html(r, backward=backward))


def run_backward(args: argparse.Namespace, q: Tensor, k: Tensor, v: Tensor, dO: Tensor) -> int:
    """``replay backward``: its exit status."""
    tiles = blocks(args.seq_len, args.block_m) * blocks(args.seq_len, args.block_n)
    if tiles > MAX_BACKWARD_TILES:
        return error(
            f"argument --seq-len: the backward lists every tile of both passes, and T_r x T_c = {tiles} is more "
            f"than {MAX_BACKWARD_TILES}: use larger --block-m/--block-n or a shorter --seq-len",
            args.scenario,
        )
    require_format(args.format)
    return reported(functools.partial(_backward, args, q, k, v, dO), args.out, args.scenario)


def _backward(args: argparse.Namespace, q: Tensor, k: Tensor, v: Tensor, dO: Tensor) -> str | None:
    r = forward_of(args, q, k, v)
    br: BackwardReplay = backward_of(r, dO=dO, source=args.source, deterministic=args.deterministic)
    if args.format == "png":  # --out is required for png (checked with the other options)
        from .png.backward import MAX_PNG_STEPS, step_paths, steps_of

        total = len(steps_of(br))
        if args.step is not None and args.step > total:
            return f"argument --step: must be in [1, {total}] for this backward, got {args.step}"
        if args.step is None and total > MAX_PNG_STEPS:
            return (
                f"argument --format: the backward's --format png draws one picture per step, at most "
                f"{MAX_PNG_STEPS}, and this backward has {total} steps: pass --step for one of them, or use "
                "--format table or json"
            )
    render(br, args, page=r)  # the page of a backward: the forward's of query block 0, opened on its Backward tab
    if args.format == "png" and args.step is None:
        files = step_paths(args.out, len(steps_of(br)))
        print(f"wrote {args.out} (the preprocess and the result), {files[0].name} to {files[-1].name} (the steps)")
    return None


def decode_option_error(args: argparse.Namespace) -> str | None:
    """What is wrong with ``replay decode``'s options taken together, naming the option."""
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
    if args.format == "png" and args.out is None:
        return "argument --format: png needs --out FILE"
    return None


def run_decode(args: argparse.Namespace) -> int:
    """``replay decode``: its exit status."""
    problem = decode_option_error(args)
    if problem is not None:
        return error(problem, args.scenario)
    require_format(args.format)
    return reported(functools.partial(_decode, args), args.out, args.scenario)


def _decode(args: argparse.Namespace) -> None:
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
        causal=args.causal,  # the command's default is on (the call's is off)
        scale=args.scale,
        window=args.window,
        softcap=args.softcap,
        alibi_slopes=None if slopes is None else torch.tensor(slopes, dtype=torch.float64).reshape(-1, 1),
        merge_order=args.merge_order,
        sinks=None if args.sinks is None else torch.tensor(args.sinks, dtype=torch.float64),
        source=args.source,
    )
    render(r, args)
