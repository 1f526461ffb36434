"""Ahead-of-time compilation report: every shipped kernel configuration, compiled for a named GPU.

No GPU is needed: ``triton.compile`` builds a cubin for a target such as ``GPUTarget("cuda", 90, 32)``
(Hopper) or ``("cuda", 80, 32)`` (Ampere), and ``cuobjdump`` from the triton wheel reads it back:

    registers   per thread (at most 255)
    spills      stack plus local memory per thread in bytes (where ptxas puts registers that do not
                fit; the SASS then holds STL/LDL); nonzero means registers ran out
    smem        shared memory per program (a block may use 227 KB on sm_90, 163 KB on sm_80)
    mma         the tensor-core instruction in the SASS: HGMMA (warpgroup MMA, sm_90), HMMA (sm_80),
                or none (fp32 "ieee" dots run on CUDA cores)

Each kernel is compiled exactly as the JIT would specialise it for a sample call of the launcher
(:mod:`flashattn_teach.tools.kernels.specialize`: contiguous ``(B, H, N, D)`` inputs of the benchmark's sizes,
no grouped-query attention, so ``GROUP = 1`` and the unit strides become constants) with
``CAUSAL=True``, whose code has both the unmasked and the masked stage.

``--variants`` compiles the kernels of a call with every variant at once (a causal sliding window,
softcap, ALiBi and ``seqlens_k``; :func:`flashattn_teach.tools.kernels.specialize.sample_variants`) in the
configurations such calls get (``shipped_config(..., variants=True)``). ``--mask bool`` or ``--mask
additive`` compiles a causal call with a padding ``attn_mask`` (no other variant), in the variant rows.
``--varlen`` compiles a call on packed sequences (:func:`flashattn_teach.tools.kernels.specialize.sample_varlen`),
in the variant rows and through pointers, since TMA does not serve packed sequences. ``--dropout`` adds
dropout, alone or to any of these runs, and uses the dropout rows.

``--loops`` adds the loop profile of :mod:`flashattn_teach.tools.kernels.loops` (instructions per warp and
iteration of each kernel's steady-state loop, and a TFLOP/s estimate), compiled non-causal as in the
benchmark it is calibrated against; under a warp-specialised kernel's row, a line per partition
(producer, consumers: warps, registers set by ``setmaxnreg``, named and CTA-wide barriers in its loop)
and one with its model. A warp-specialised kernel's estimate is uncalibrated, and every row and line
that prints one says so. ``--score-mod`` adds :mod:`flashattn_teach.tools.kernels.score_mod`'s table: a softcap
written as a score_mod against the built-in softcap, loop by loop. ``--dump DIR`` writes each compiled
kernel's PTX and SASS.
Must run without ``TRITON_INTERPRET`` (the variable decides how kernels are built for the whole process).

    flashattn-teach kernels --arch sm90 [--dtype float16 bfloat16] [--head-dim 64 128] [--loops] [--dump DIR]
    flashattn-teach kernels --specializations --arch sm90 sm80 [--json FILE] [--check FILE]  (specializations.py)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from ..._cli_types import positive_int
from ...triton.configs import ARCHS, DTYPES, HEAD_DIMS, KERNELS, KernelConfig, shipped_configs
from ...triton.variants import PLAIN
from .compile import MAX_REGISTERS, SMEM_LIMIT, CompileReport, compile_kernel, require_triton
from .loops import CALIBRATED_ON, CALIBRATION, MODELS, UNCALIBRATED, LoopProfile
from .specializations import add_arguments as add_specialization_arguments
from .specialize import sample_variants, sample_varlen
from .waves import add_arguments as add_schedule_arguments
from .waves import print_schedule

_DTYPE_BY_NAME = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def shipped_kernels(
    arch: str, dtypes=DTYPES, head_dims=HEAD_DIMS, *, variants: bool = False, dropout: bool = False
) -> list[tuple[str, torch.dtype, int, KernelConfig]]:
    """Every (kernel, dtype, padded head dim, configuration) shipped for ``arch`` (for calls with variants,
    with dropout), each followed by its :func:`fallbacks`."""
    out = []
    for dt, d, config in shipped_configs(arch, variants=variants, dropout=dropout):
        if dt in dtypes and d in head_dims:
            backward = config.backward_dkdv is not None
            for name in KERNELS:
                c = config.kernel(name)
                if c is not None and (backward or name == "forward"):
                    out += [(name, dt, d, k) for k in (c, *fallbacks(c))]
    return out


def fallbacks(c: KernelConfig) -> list[KernelConfig]:
    """What runs where ``c`` cannot: for a warp-specialised configuration the one that runs where warp
    specialisation cannot (``unspecialised``, when it differs), then for a TMA one the one through pointers."""
    out = []
    unspecialised = getattr(c, "unspecialised", None)  # KernelConfig.ws, the warp-specialised forward
    if unspecialised is not None and unspecialised() != c:
        out.append(unspecialised())
    if c.tma and c.by_pointers() not in out:
        out.append(c.by_pointers())
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flashattn-teach kernels``."""
    parser.add_argument(
        "--arch",
        nargs="+",
        choices=ARCHS,
        default=["sm90"],
        help="GPU generation to compile for (several: only with --specializations)",
    )
    parser.add_argument(
        "--dtype", nargs="+", choices=sorted(_DTYPE_BY_NAME), default=None, help="input dtypes (default: all shipped)"
    )
    parser.add_argument(
        "--head-dim",
        nargs="+",
        type=positive_int,
        choices=HEAD_DIMS,
        default=None,
        help="padded head dimensions (default: all shipped)",
    )
    parser.add_argument("--kernel", nargs="+", choices=KERNELS, default=None, help="kernels (default: all)")
    parser.add_argument(
        "--variants",
        action="store_true",
        help="compile with a window, softcap, ALiBi and seqlens_k at once, in the configurations such calls get",
    )
    parser.add_argument(
        "--dropout",
        action="store_true",
        help="add dropout (alone, or to --variants, --mask or --varlen), in the rows it gets",
    )
    parser.add_argument(
        "--varlen", action="store_true", help="compile a call on packed sequences (cu_seqlens), in the rows it gets"
    )
    parser.add_argument(
        "--mask",
        choices=("bool", "additive"),
        default=None,
        help="compile a causal call with a padding attn_mask of this kind (bool, or additive in the input dtype)",
    )
    parser.add_argument(
        "--loops",
        action="store_true",
        help="profile each kernel's steady-state loop from its SASS and estimate TFLOP/s (docs/loop-profile.md)",
    )
    parser.add_argument(
        "--score-mod",
        action="store_true",
        help="compare the loops of a softcap written as a score_mod with the built-in softcap's (score_mod.py)",
    )
    parser.add_argument(
        "--split-head-dim",
        action="store_true",
        help="compare D = 192 (D_v = 128) run as 128 + 64 lanes with it padded to 256, loop by loop (split.py)",
    )
    parser.add_argument(
        "--dump", type=Path, default=None, metavar="DIR", help="write each compiled kernel's PTX and SASS into DIR"
    )
    add_schedule_arguments(parser)
    add_specialization_arguments(parser)


def _dump(report: CompileReport, directory: Path, suffix: str = "") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    stem = report.file_stem() + suffix
    (directory / f"{stem}.ptx").write_text(report.ptx)
    (directory / f"{stem}.sass").write_text(report.sass)


_LOOP_HEADER = (
    f"{'kernel':<14} {'dtype':<9} {'D':>4} {'tile':<20} {'instr':>5} {'ex2':>4} {'ffma':>4} {'fmul':>4} "
    f"{'fadd':>4} {'ldg':>3} {'cp.as':>5} {'tma':>3} {'lds':>3} {'ldsm':>4} {'bar':>3} {'nbar':>4} {'sync':>4} "
    f"{'wgmma':>5} "
    f"{'int':>4} {'ldl/stl':>7} {'regs':>4} {'smem':>6} {'tensor':>6} {'issue':>6} {'mufu':>6} {'TF/s':>5}  mma"
)


def _loop_row(r: CompileReport, p: LoopProfile) -> str:
    c = p.counts
    mma = " ".join(f"{n}x{shape}" for shape, n in sorted(p.mma.items()))
    return (
        f"{r.kernel.removeprefix('backward_'):<14} {str(r.dtype).removeprefix('torch.'):<9} {r.head_dim:>4} "
        f"{r.config!s:<20} {p.instructions:>5} {c['mufu_ex2']:>4} {c['ffma']:>4} {c['fmul']:>4} {c['fadd']:>4} "
        f"{c['ldg']:>3} {c['ldgsts']:>5} {c['tma']:>3} {c['lds']:>3} {c['ldsm']:>4} {c['bar'] - c['bar_named']:>3} "
        f"{c['bar_named']:>4} {c['sync']:>4} {c['wgmma_wait']:>5} {c['int']:>4} {c['local']:>7} {r.registers:>4} "
        f"{r.smem_bytes:>6} {p.tensor_cycles:>6.0f} {p.issue_cycles:>6.0f} {p.mufu_cycles:>6.0f} "
        f"{p.estimate_tflops():>5.0f}  {mma}" + ("" if p.calibrated else f"  (TF/s {p.basis.split(',')[0]})")
    )


def pass_estimates(profiled: list[tuple[CompileReport, LoopProfile]]) -> list[str]:
    """TFLOP/s of the forward and of the backward (dK/dV plus dQ loops; and the one-kernel backward's loop
    where it ships) per dtype and head dim, in the benchmark's FLOPs: ``4 N_q N_k D`` forward and 2.5 times
    that backward (FA2's convention). Each line says what it rests on: ``calibrated on ...``, or
    ``uncalibrated`` with the no-overlap figure beside it where a warp-specialised kernel takes part."""
    by_key = {(r.kernel, r.dtype, r.head_dim): (r, p) for r, p in profiled}
    lines = []
    for dtype, d in dict.fromkeys((r.dtype, r.head_dim) for r, _ in profiled):
        for name, kernels, flops, note in (
            ("forward", ("forward",), 4 * d, ""),
            ("backward", ("backward_dkdv", "backward_dq"), 10 * d, ", two kernels"),
            ("backward", ("backward_fused",), 10 * d, ", one kernel (dQ by atomics, their cost assumed)"),
        ):
            parts = [by_key[(k, dtype, d)] for k in kernels if (k, dtype, d) in by_key]
            if len(parts) < len(kernels):
                continue
            # SM cycles per (query, key) pair: each kernel's iteration covers BLOCK_M x BLOCK_N pairs
            # (a kernel's calibrated cycles are its cycles / its calibration factor)
            pairs = [r.config.BLOCK_M * r.config.BLOCK_N for r, _ in parts]
            cycles = sum(p.cycles / p.calibration / n for (_, p), n in zip(parts, pairs, strict=True))
            model = parts[0][1].model
            head = f"# {name:<8} {str(dtype).removeprefix('torch.'):<9} D={d:<4} {model.tflops(flops, cycles):5.0f}"
            if all(p.calibrated for _, p in parts) or not any(p.specialized for _, p in parts):
                lines.append(f"{head} TFLOP/s estimated, {parts[0][1].basis}{note}")
                continue
            serial = sum(p.serial_cycles / p.calibration / n for (_, p), n in zip(parts, pairs, strict=True))
            lines.append(
                f"{head} TFLOP/s estimated, {UNCALIBRATED}{note} (no overlap of its consumers: "
                f"{model.tflops(flops, serial):.0f})"
            )
    return lines


def run(args: argparse.Namespace) -> int:
    """Compile and print one row per kernel and configuration; exit status 1 if any check fails."""
    if args.specializations:
        from .specializations import run as run_specializations

        return run_specializations(args)
    if len(args.arch) > 1:
        print("flashattn-teach kernels: error: several --arch need --specializations", file=sys.stderr)
        return 2
    args.arch = args.arch[0]
    if args.schedule or args.programs_per_sm is not None or args.seq_len is not None:
        return print_schedule(args, compile_kernel)
    require_triton()
    dtypes = [_DTYPE_BY_NAME[n] for n in args.dtype] if args.dtype else DTYPES
    head_dims = args.head_dim or HEAD_DIMS
    kernels = args.kernel or KERNELS
    if args.varlen and (args.variants or args.mask is not None):
        print("flashattn-teach kernels: error: --varlen combines with --dropout only", file=sys.stderr)
        return 2
    selected = [
        (name, dt, d, c)
        for name, dt, d, c in shipped_kernels(
            args.arch,
            dtypes,
            head_dims,
            variants=args.variants or args.mask is not None or args.varlen,
            dropout=args.dropout,
        )
        if name in kernels and not (args.varlen and c.tma)  # packed sequences run the pointer rows
    ]
    variants = PLAIN
    if args.variants:
        variants = sample_variants(seqlens=True, dropout=args.dropout)
    elif args.varlen:
        variants = sample_varlen(dropout=args.dropout)
    elif args.dropout:
        variants = sample_variants(window=False, softcap=False, alibi=False, dropout=True)
    if not selected:
        dtype_names = " ".join(args.dtype or ["any"])
        print(
            f"flashattn-teach kernels: error: no shipped {args.arch} kernel has --dtype {dtype_names}, "
            f"--head-dim {' '.join(map(str, head_dims))} and --kernel {' '.join(kernels)}",
            file=sys.stderr,
        )
        return 2
    if args.dump is not None and args.dump.exists() and not args.dump.is_dir():
        print(f"flashattn-teach kernels: error: --dump {args.dump} exists and is not a directory", file=sys.stderr)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)  # compiling ahead of time needs it unset in this process
    header = (
        f"{'kernel':<20} {'dtype':<9} {'D':>4} {'BLOCK_M':>7} {'BLOCK_N':>7} {'warps':>5} {'stages':>6} "
        f"{'regs':>5} {'spills':>6} {'smem':>8} {'mma':>6}  check"
    )
    with_variants = " (window, softcap, ALiBi and seqlens_k)" if args.variants else ""
    with_variants += " (packed sequences)" if args.varlen else ""
    with_variants += " with dropout" if args.dropout else ""
    with_variants += f" (causal, a {args.mask} padding mask)" if args.mask else ""
    print(
        f"# {args.arch}{with_variants}: registers <= {MAX_REGISTERS}, no spills, shared memory <= "
        f"{SMEM_LIMIT[args.arch]} B"
    )
    print(header)
    failed = 0
    for name, dt, d, c in selected:
        if args.mask is not None:  # the mask in the input dtype, or bool
            mask_dtype = torch.bool if args.mask == "bool" else dt
            variants = sample_variants(window=False, softcap=False, alibi=False, dropout=args.dropout, mask=mask_dtype)
        r = compile_kernel(name, args.arch, dt, d, c, variants=variants)
        if args.dump is not None:
            _dump(r, args.dump)
        problems = r.problems()
        failed += bool(problems)
        print(
            f"{name:<20} {str(dt).removeprefix('torch.'):<9} {d:>4} {c.BLOCK_M:>7} {c.BLOCK_N:>7} "
            f"{c.num_warps:>5} {c.num_stages:>6} {r.registers:>5} {r.spill_bytes:>6} {r.smem_bytes:>8} "
            f"{r.mma:>6}  {'; '.join(problems) or 'ok'}",
            flush=True,
        )
    if args.loops:
        print_loop_profiles(args, selected)
    if args.split_head_dim:
        from .split import print_split_profile

        print_split_profile(args.arch)
    if args.score_mod:
        from .score_mod import print_comparison

        print_comparison(
            args.arch, sorted({dt for _, dt, _, _ in selected}, key=str), sorted({d for _, _, d, _ in selected})
        )
    return 1 if failed else 0


def print_loop_profiles(args: argparse.Namespace, selected: list[tuple[str, torch.dtype, int, KernelConfig]]) -> None:
    """The ``--loops`` table: one row per kernel with a matmul loop, then the forward/backward estimates."""
    model = MODELS[args.arch]
    print()
    print(
        f"# loop profile, {args.arch}, non-causal: steady-state loop, counts per warp per iteration; "
        f"cycles per program-iteration on one SM ({model.name}: {model.sms} SMs at {model.clock_ghz} GHz); "
        f"TF/s = {CALIBRATION} x tensor-core FLOPs / (tensor + max(issue, mufu) + atomic), "
        + (f"calibrated on the {CALIBRATED_ON}" if model.measured else f"UNCALIBRATED (no {model.name} measured)")
        + "; warp-specialised kernels (a line per partition below the row): the same factor x "
        "FLOPs / max(tensor, issue, mufu, each consumer's tensor + softmax), UNCALIBRATED (the factor is "
        "borrowed); HMMA counted per warp, HGMMA per warpgroup; atomics' cost assumed; docs/loop-profile.md"
    )
    print(_LOOP_HEADER)
    profiled = []
    behind = {(name, dt, d, k) for name, dt, d, c in selected for k in fallbacks(c)}
    for name, dt, d, c in selected:
        if (name, dt, d, c) in behind:
            continue  # the loop profile is of the tiles that run where TMA (and warp specialisation) can
        r = compile_kernel(name, args.arch, dt, d, c, causal=False)
        if args.dump is not None:
            _dump(r, args.dump, suffix="_noncausal")
        profile = r.loop_profile()
        if profile is not None:
            profiled.append((r, profile))
            print(_loop_row(r, profile), flush=True)
            for line in profile.partition_lines():
                print(line)
            modelled = profile.num_warps if profile.specialized else c.num_warps
            if modelled != r.launched_warps:  # a specialisation the SASS reader missed, or misread
                print(f"  note: the kernel launches {r.launched_warps} warps, the profile models {modelled}")
    for line in pass_estimates(profiled):
        print(line)
