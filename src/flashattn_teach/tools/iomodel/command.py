"""``flashattn-teach iomodel``: the HBM traffic table, the roofline, the L2 level and (``--ring W``) the ring."""

from __future__ import annotations

import argparse
import math
import sys

from ..._cli_types import finite_positive_float, positive_int
from .hbm import (
    Problem,
    attention_flops,
    key_major_backward_io,
    key_major_forward_io,
    paper_block_sizes,
    query_major_forward_io,
    split_backward_io,
    standard_backward_io,
    standard_forward_io,
    theorem2_scale,
)
from .l2 import H100_L2_BYTES, H100_SMS, L2Cache, query_major_forward_l2, split_backward_l2
from .ring import ACHIEVED, H200_BF16_TFLOPS, NVLINK4_GBS, RingHardware, kv_heads_of, ring_step, shard_len

H200_HBM_TBS = 4.8  # H200 SXM datasheet, HBM3e (H100 SXM: 3.35)
PROG = "flashattn-teach iomodel"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError("unreachable")


def _fmt_seconds(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.2f} {unit}"
    return f"{s / 1e-9:.2f} ns"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-len", "-N", type=positive_int, default=8192, help="sequence length N (default 8192)")
    parser.add_argument("--head-dim", "-d", type=positive_int, default=128, help="head dimension d (default 128)")
    parser.add_argument("--batch", "-B", type=positive_int, default=1, help="batch size B (default 1)")
    parser.add_argument("--heads", "-H", type=positive_int, default=1, help="number of heads H (default 1)")
    parser.add_argument(
        "--elem-bytes", type=positive_int, default=2, help="bytes per element of Q, K, V, O (default 2)"
    )
    parser.add_argument(
        "--sram-kib",
        type=finite_positive_float,
        default=228.0,
        help="on-chip memory M per thread block in KiB, which a tile's Q_i, O_i, K_j, V_j must fit "
        "(default 228: H100/H200 shared memory)",
    )
    parser.add_argument("--block-m", type=positive_int, default=128, help="BLOCK_M of the query-major/split schedules")
    parser.add_argument("--block-n", type=positive_int, default=64, help="BLOCK_N of the query-major/split schedules")
    parser.add_argument("--causal", action="store_true", help="causal masking (skip tiles above the diagonal)")
    roof = parser.add_argument_group("roofline")
    roof.add_argument(
        "--peak-tflops",
        type=finite_positive_float,
        default=H200_BF16_TFLOPS,
        help=f"peak FLOP/s in TFLOP/s (default {H200_BF16_TFLOPS:g}: H100/H200 SXM dense bf16)",
    )
    roof.add_argument(
        "--hbm-tbs",
        type=finite_positive_float,
        default=H200_HBM_TBS,
        help=f"HBM bandwidth in TB/s (default {H200_HBM_TBS:g}: H200 SXM; H100 SXM has 3.35)",
    )
    l2 = parser.add_argument_group("L2 cache")
    l2.add_argument(
        "--l2-mib",
        type=finite_positive_float,
        default=H100_L2_BYTES / 2**20,
        help=f"L2 size in MiB (default {H100_L2_BYTES // 2**20}: H100/H200)",
    )
    l2.add_argument(
        "--programs",
        type=positive_int,
        default=H100_SMS,
        help=f"programs resident at once (default {H100_SMS}: one per SM of an H100/H200 SXM)",
    )
    ring = parser.add_argument_group("ring (context parallelism)")
    ring.add_argument("--ring", type=positive_int, metavar="W", help="also model a ring over W >= 2 devices")
    ring.add_argument(
        "--kv-heads", type=positive_int, help="with --ring: key/value heads H_kv of its shards (GQA; default H)"
    )
    # None until given, so that one given without --ring is refused rather than ignored.
    ring.add_argument(
        "--link-gbs",
        type=finite_positive_float,
        help=f"with --ring: link bandwidth per direction in GB/s (default {NVLINK4_GBS:g}: NVLink 4, 900 GB/s "
        "bidirectional per H100/H200; 50 for one 400 Gb/s InfiniBand NIC per GPU)",
    )
    ring.add_argument(
        "--efficiency",
        type=finite_positive_float,
        help=f"with --ring: fraction of --peak-tflops a block's attention achieves, in (0, 1] (default {ACHIEVED:g})",
    )


RING_ONLY = ("kv_heads", "link_gbs", "efficiency")  # the options that describe the ring, by destination


def _error(option: str, message: str) -> int:
    print(f"{PROG}: error: argument {option}: {message}", file=sys.stderr)
    return 2


def _bytes_option(value: float, unit: int, text: str) -> int:
    """``value * unit`` bytes as an int, or a ValueError when a float cannot hold it."""
    if not math.isfinite(value * unit):
        raise ValueError(f"{text} is more bytes than a float holds")
    return int(value * unit)


def _tile_bytes(block_m: int, block_n: int, p: Problem) -> int:
    """On-chip bytes of a tile's four d-wide blocks: ``Q_i, O_i`` (``block_m x d``), ``K_j, V_j`` (``block_n x d``).

    These are what FA1 Alg. 1 line 1 sizes against ``M`` (``Bc = M / 4d``: a quarter of ``M`` each when
    ``Br = Bc``); the scores ``S_ij`` and the row statistics come on top, in the paper as here."""
    return 2 * (block_m + block_n) * p.head_dim * p.elem_bytes


def _kib(n: int) -> str:
    """``n`` bytes in KiB, exactly (``n / 1024`` is a binary fraction), so the value given back is ``n`` again."""
    return repr(n / 1024).removesuffix(".0")


def _key_major_tile(sram: int, p: Problem, sram_kib: float) -> tuple[int, int]:
    """FA1 Alg. 1 line 1's ``(Br, Bc)``; where its ``ceil(M / 4d)`` makes the tile larger than ``M``, the
    largest of the same shape that fits, ``Bc = floor(M / 4d)``; a ValueError when not even 1 x 1 fits."""
    smallest = _tile_bytes(1, 1, p)
    if sram < smallest:
        raise ValueError(
            f"{sram_kib:g} KiB holds no tile at --head-dim {p.head_dim} and --elem-bytes {p.elem_bytes}: "
            f"the smallest, 1 x 1, holds Q_i, K_j, V_j, O_i, 4 x {p.head_dim} x {p.elem_bytes} = {smallest} bytes; "
            f"use --sram-kib {_kib(smallest)} or more"
        )
    br, bc = paper_block_sizes(sram, p.head_dim, p.elem_bytes)
    if _tile_bytes(br, bc, p) > sram:
        bc = sram // p.elem_bytes // (4 * p.head_dim)  # >= 1 as M >= 4d; 2d (Br + Bc) <= 4d Bc <= M
        br = min(bc, p.head_dim)
    return br, bc


def _tile_error(p: Problem, args: argparse.Namespace, sram: int) -> str | None:
    """The query-major and split rows' tile, ``--block-m x --block-n``, when it does not fit ``M``."""
    need = _tile_bytes(args.block_m, args.block_n, p)
    if need <= sram:
        return None
    return (
        f"{args.sram_kib:g} KiB does not hold the FA2 rows' tile, --block-m {args.block_m} x --block-n "
        f"{args.block_n}: Q_i, O_i, K_j, V_j are 2 x ({args.block_m} + {args.block_n}) x {p.head_dim} x "
        f"{p.elem_bytes} = {need} bytes; use --sram-kib {_kib(need)} or more, or a smaller --block-m/--block-n"
    )


def run(args: argparse.Namespace) -> int:
    p = Problem(args.batch, args.heads, args.seq_len, args.head_dim, args.elem_bytes, args.causal)
    try:
        sram = _bytes_option(args.sram_kib, 1024, f"{args.sram_kib:g} KiB")
        br, bc = _key_major_tile(sram, p, args.sram_kib)
    except ValueError as e:
        return _error("--sram-kib", str(e))
    problem = _tile_error(p, args, sram)
    if problem is not None:
        return _error("--sram-kib", problem)
    try:
        cache = L2Cache(_bytes_option(args.l2_mib, 2**20, f"{args.l2_mib:g} MiB"), args.programs)
    except ValueError as e:
        return _error("--l2-mib", str(e))
    given = [dest for dest in RING_ONLY if getattr(args, dest) is not None]
    if args.ring is None and given:
        option, value = "--" + given[0].replace("_", "-"), getattr(args, given[0])
        return _error(option, f"describes the ring, needs --ring W (got {option} {value:g})")
    efficiency = ACHIEVED if args.efficiency is None else args.efficiency
    if efficiency > 1:
        return _error("--efficiency", f"must be in (0, 1], got {efficiency:g}")
    hw = RingHardware(NVLINK4_GBS if args.link_gbs is None else args.link_gbs, args.peak_tflops, efficiency)
    if args.ring is not None:
        try:
            shard_len(p, args.ring)
        except ValueError as e:
            return _error("--ring", str(e))
    try:
        kv_heads = kv_heads_of(p, args.kv_heads)
    except ValueError as e:
        return _error("--kv-heads", str(e))

    ridge = args.peak_tflops / args.hbm_tbs  # (FLOP/s) / (bytes/s), both in units of 1e12
    _traffic_table(p, args, sram, br, bc, ridge)
    _l2_section(p, args, cache, ridge)
    if args.ring is not None:
        _ring_section(p, args.ring, hw, kv_heads)
    return 0


def _bound(intensity: float, ridge: float) -> str:
    return "compute" if intensity >= ridge else "memory"


def _traffic_table(p: Problem, args: argparse.Namespace, sram: int, br: int, bc: int, ridge: float) -> None:
    bm, bn = args.block_m, args.block_n
    fwd, bwd = attention_flops(p, "forward"), attention_flops(p, "backward")
    print(
        f"IO model: B={p.batch} H={p.heads} N={p.seq_len} d={p.head_dim} causal={p.causal}, "
        f"{p.elem_bytes}-byte elements, M = {args.sram_kib:g} KiB on chip ({sram // p.elem_bytes} elements)"
    )
    paper_br, paper_bc = paper_block_sizes(sram, p.head_dim, p.elem_bytes)
    if (paper_br, paper_bc) != (br, bc):
        print(
            f"FA1 Alg. 1 line 1's Bc = ceil(M/4d) gives a {paper_br}x{paper_bc} tile of "
            f"{_tile_bytes(paper_br, paper_bc, p)} bytes, more than M: the key-major rows round M/4d down, {br}x{bc}"
        )
    print(
        f"FLOPs (4*B*H*N^2*d, halved if causal; backward x2.5): forward {fwd / 1e9:.2f} GFLOP, "
        f"backward {bwd / 1e9:.2f} GFLOP"
    )
    print(
        f"Roofline: ridge point {args.peak_tflops:g} TFLOP/s / {args.hbm_tbs:g} TB/s = {ridge:.0f} FLOP/B; "
        "below it a schedule is bound by memory traffic"
    )
    rows = [
        ("forward", "standard (FA1 Alg. 0)", "-", standard_forward_io(p), fwd),
        ("forward", "key-major (FA1 Alg. 1)", f"{br}x{bc}", key_major_forward_io(p, br, bc), fwd),
        ("forward", "query-major (FA2)", f"{bm}x{bn}", query_major_forward_io(p, bm, bn), fwd),
        ("backward", "standard (FA1 Alg. 3)", "-", standard_backward_io(p), bwd),
        ("backward", "key-major (FA1 Alg. 4)", f"{br}x{bc}", key_major_backward_io(p, br, bc), bwd),
        ("backward", "split dK/dV + dQ (FA2)", f"{bm}x{bn}", split_backward_io(p, bm, bn), bwd),
    ]
    header = (
        f"{'pass':<9}{'schedule':<25}{'Br x Bc':>9}{'HBM read':>13}{'HBM write':>13}{'total':>13}"
        f"{'vs std':>9}{'FLOP/B':>9}  bound"
    )
    print()
    print(f"HBM traffic, every load from HBM (no cache):\n{header}\n{'-' * len(header)}")
    for pass_, name, blocks, t, flops in rows:
        std = rows[0][3] if pass_ == "forward" else rows[3][3]
        print(
            f"{pass_:<9}{name:<25}{blocks:>9}{_fmt_bytes(t.read_bytes):>13}{_fmt_bytes(t.write_bytes):>13}"
            f"{_fmt_bytes(t.total_bytes):>13}{t.total_bytes / std.total_bytes:>8.3f}x"
            f"{flops / t.total_bytes:>9.1f}  {_bound(flops / t.total_bytes, ridge)}"
        )
    print()
    print(
        f"Theorem 2 scale B*H*N^2*d^2/M: {_fmt_bytes(theorem2_scale(p, sram))}; "
        f"standard's N^2 term alone: {_fmt_bytes(p.batch * p.heads * p.seq_len**2 * p.elem_bytes)}"
    )


def _l2_section(p: Problem, args: argparse.Namespace, cache: L2Cache, ridge: float) -> None:
    bm, bn = args.block_m, args.block_n
    figures = [
        ("forward", "query-major (FA2)", query_major_forward_l2(p, bm, bn, cache), attention_flops(p, "forward")),
        ("backward", "split dK/dV + dQ (FA2)", split_backward_l2(p, bm, bn, cache), attention_flops(p, "backward")),
    ]
    print()
    print(
        f"L2 reuse: {_fmt_bytes(cache.size_bytes)} of L2, {cache.programs} programs resident at once. Grids run "
        "block-fastest\n(as flashattn_teach.triton's), so the programs running at once are the blocks of a few "
        "(batch, head) pairs:"
    )
    header = (
        f"{'pass':<16}{'re-reads per head':<19}{'blocks/head':>12}{'heads at once':>15}{'working set':>26}  fits L2"
    )
    print(f"{header}\n{'-' * len(header)}")
    for _, _, fig, _ in figures:
        for r in fig.passes:
            working = f"{r.heads_resident} x {_fmt_bytes(r.head_bytes)} = {_fmt_bytes(r.resident_bytes)}"
            print(
                f"{r.pass_name:<16}{', '.join(r.reread):<19}{r.blocks_per_head:>12}{r.heads_resident:>15}"
                f"{working:>26}  {'yes' if r.fits else 'no'}"
            )
    header = (
        f"{'pass':<9}{'schedule':<25}{'HBM no L2':>12}{'FLOP/B':>9}  {'bound':<9}"
        f"{'HBM with L2':>12}{'FLOP/B':>9}  bound"
    )
    print(f"\n{header}\n{'-' * len(header)}")
    for pass_, name, fig, flops in figures:
        without, with_l2 = flops / fig.without_l2.total_bytes, flops / fig.with_l2.total_bytes
        print(
            f"{pass_:<9}{name:<25}{_fmt_bytes(fig.without_l2.total_bytes):>12}{without:>9.1f}  "
            f"{_bound(without, ridge):<9}{_fmt_bytes(fig.with_l2.total_bytes):>12}{with_l2:>9.1f}  "
            f"{_bound(with_l2, ridge)}"
        )
    print(
        "With L2 applies where every pass fits: the heads resident at once keep all they re-read in L2, so\n"
        "each tile leaves HBM once per (batch, head); where a pass does not fit, the model keeps its no-L2 count,\n"
        "an upper bound (programs in lockstep still share the tiles in flight)."
    )


def _ring_section(p: Problem, world: int, hw: RingHardware, kv_heads: int) -> None:
    steps = [ring_step(p, world, hw, pass_, kv_heads) for pass_ in ("forward", "backward")]
    layout = "causal, zigzag layout: every step does half a block" if p.causal else "non-causal: full blocks"
    print()
    print(
        f"Ring over W = {world} devices: N/W = {steps[0].n_local} tokens each, H_kv = {kv_heads} ({layout});\n"
        f"link {hw.link_gbs:g} GB/s per direction, a device runs {hw.peak_tflops:g} x {hw.efficiency:g} = "
        f"{hw.throughput / 1e12:g} TFLOP/s"
    )
    header = (
        f"{'pass':<9}{'sent/step':>12}{'comm':>11}{'FLOPs/step':>14}{'compute':>11}  {'hides':<6}"
        f"{'N/W*':>7}{'N* = W N/W*':>13}"
    )
    print(f"{header}\n{'-' * len(header)}")
    for s in steps:
        smallest = math.ceil(s.crossover_n_local)
        print(
            f"{s.pass_:<9}{_fmt_bytes(s.bytes):>12}{_fmt_seconds(s.comm_s):>11}{s.flops / 1e9:>9.2f} GFLOP"
            f"{_fmt_seconds(s.compute_s):>11}  {'yes' if s.hides else 'no':<6}{smallest:>7}{world * smallest:>13}"
        )
    print(
        "The transfer of the next shard hides behind a block's attention when N/W >= N/W* = t e H_kv F / (4 c H BW):\n"
        "t = 2 shards (K, V) forward, 4 backward (with dK, dV); c = 1 forward, 2.5 backward, x 1/2 causal;\n"
        "F = achieved FLOP/s, BW = link bytes/s. B and d cancel; per-message latency is left out."
    )
