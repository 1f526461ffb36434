"""Ahead-of-time compilation report of the FP8 (e4m3) forward (:mod:`flashattn_teach.triton.fp8`) on sm_90:
no GPU needed.

Each case is the sample call of :func:`.specialize.sample_shapes` (B = 2, H = 16, N = 8192) in e4m3 with
descales, run through the real launcher (:func:`flashattn_teach.triton.launch.forward`) under
:func:`.specialize.capture`, at the tile :func:`flashattn_teach.triton.fp8.fp8_forward_config` ships:
causal, and with a window, softcap and ALiBi at once (``--variants``). Printed per case: registers,
spilled bytes, shared memory, the tensor-core instruction of the loop (``QGMMA...E4M3.E4M3``: the warpgroup
MMA on e4m3 operands, for both products), the loop profile's estimate (:mod:`.loops`;
uncalibrated: no FP8 kernel has been timed, the factor is the bf16 kernels') and a check (no spills,
at most 255 registers, shared memory within the 227 KB a block may use, both products on QGMMA E4M3).

    flashattn-teach kernels-fp8 [--head-dim 64 128 256] [--variants]

Must run without ``TRITON_INTERPRET`` (the variable decides how kernels are built for the whole process).
"""

from __future__ import annotations

import argparse
import os
import re

import torch

from ..._validate.fp8 import FP8_DTYPE, Fp8Descale
from ...triton.fp8 import fp8_forward_config, fp8_head_dims
from .compile import MAX_REGISTERS, SMEM_LIMIT, require_triton
from .loops import profile_sass
from .sass import disassemble
from .specialize import CompileRequest, requests_for, sample_shapes, sample_variants

_ROW = "{:<4} {:<9} {:<16} {:>5} {:>7} {:>7}  {:<34} {:>16}"
_QGMMA_E4M3 = re.compile(r"\bQGMMA\.(\d+x\d+x\d+)\.F32\.E4M3\.E4M3\b")


def request(head_dim: int, *, variants: bool) -> CompileRequest:
    """The compile request of the sample FP8 call (module docs) at ``head_dim``."""
    from ...triton.launch import forward

    s, q, k, v = sample_shapes(FP8_DTYPE, head_dim)
    ones = torch.ones(q.shape[0], s.H_kv)
    descale = Fp8Descale(ones, ones, ones)
    kv = sample_variants(seqlens=False) if variants else sample_variants(window=False, softcap=False, alibi=False)
    config = fp8_forward_config(head_dim, variants=variants)
    (fwd,) = requests_for(
        lambda: forward(
            q, k, v, s, causal=True, causal_align="bottom_right", config=config, variants=kv, descale=descale
        ),
        "sm90",
    )
    return fwd


def report(r: CompileRequest) -> dict[str, object]:
    """Registers, spilled bytes, shared memory, the loop's e4m3 MMA shapes and estimate, and the check."""
    compiled = r.compile()
    text, res = disassemble(compiled.asm["cubin"])
    figure = {name: int(re.search(rf"\b{name}:(\d+)", res).group(1)) for name in ("REG", "STACK", "LOCAL", "SHARED")}  # type: ignore[union-attr]
    spills = figure["STACK"] + figure["LOCAL"]
    if spills == 0 and re.search(r"\b(STL|LDL)\b", text):
        spills = -1  # local-memory traffic of unknown size
    smem = max(figure["SHARED"], compiled.metadata.shared)
    shapes = sorted(set(_QGMMA_E4M3.findall(text)))
    profile = profile_sass(text, compiled.metadata.num_warps, "sm90", kernel="forward_fp8")
    problems = []
    if spills:
        problems.append("spills to local memory")
    if figure["REG"] > MAX_REGISTERS:
        problems.append(f"{figure['REG']} registers > {MAX_REGISTERS}")
    if smem > SMEM_LIMIT["sm90"]:
        problems.append(f"{smem} bytes of shared memory > {SMEM_LIMIT['sm90']}")
    if not shapes or re.search(r"\bHGMMA\b", text):
        problems.append("the products are not both QGMMA on e4m3")
    return {
        "registers": figure["REG"],
        "spills": spills,
        "smem": smem,
        "mma": " ".join(f"QGMMA.{m}" for m in shapes) or "none",
        "tflops": f"{profile.estimate_tflops():.0f}" if profile is not None else "-",
        "check": "; ".join(problems) or "ok",
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head-dim", nargs="+", type=int, choices=fp8_head_dims(), default=list(fp8_head_dims()))
    parser.add_argument("--variants", action="store_true", help="also with a window, softcap and ALiBi at once")


def run(args: argparse.Namespace) -> int:
    require_triton()
    os.environ.pop("TRITON_INTERPRET", None)  # compiling ahead of time needs it unset in this process
    print(f"# sm90 FP8 forward: registers <= {MAX_REGISTERS}, no spills, shared memory <= {SMEM_LIMIT['sm90']} B")
    columns = ("D", "variants", "tile", "regs", "spills", "smem", "e4m3 MMA in the SASS", "TF/s uncalibrated")
    print(_ROW.format(*columns) + "  check")
    failed = 0
    for d in args.head_dim:
        for with_variants in (False, True) if args.variants else (False,):
            r = report(request(d, variants=with_variants))
            failed += r["check"] != "ok"
            name = "wsa" if with_variants else "causal"
            tile = str(fp8_forward_config(d, variants=with_variants).forward)
            print(
                _ROW.format(d, name, tile, r["registers"], r["spills"], r["smem"], r["mma"], r["tflops"])
                + f"  {r['check']}"
            )
    return 1 if failed else 0
