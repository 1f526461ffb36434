"""Ahead-of-time compilation report: every shipped kernel configuration, compiled for a named GPU.

No GPU is needed: ``triton.compile`` builds a cubin for a target such as ``GPUTarget("cuda", 90, 32)``
(Hopper) or ``("cuda", 80, 32)`` (Ampere), and ``cuobjdump`` from the triton wheel reads it back:

    registers   per thread (at most 255)
    spills      stack plus local memory per thread in bytes (where ptxas puts registers that do not
                fit; the SASS then holds STL/LDL); nonzero means registers ran out
    smem        shared memory per program (228 KB limit on sm_90, 164 KB on sm_80)
    mma         the tensor-core instruction in the SASS: HGMMA (warpgroup MMA, sm_90), HMMA (sm_80),
                or none (fp32 "ieee" dots run on CUDA cores)

Kernels are compiled as the JIT would specialise them for contiguous inputs: pointers and strides
16-byte aligned, the innermost stride 1, and the head dimension equal to its padded ``BLOCK_D``; with
``CAUSAL=True``, whose code has both the unmasked and the masked stage (the non-causal kernel's masked
stage only lacks the diagonal comparison).
Must run without ``TRITON_INTERPRET`` (the variable decides how kernels are built for the whole process).

    flashattn-teach kernels --arch sm90 [--dtype float16 bfloat16] [--head-dim 64 128]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .._cli_types import ArgumentParser, positive_int
from .configs import ARCHS, DTYPES, HEAD_DIMS, KERNELS, KernelConfig, dot_precision, shipped_configs

SMEM_LIMIT = {"sm90": 228 * 1024, "sm80": 164 * 1024}
MAX_REGISTERS = 255
_TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_DTYPE_BY_NAME = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# Argument kinds by name; every other argument is a block size or flag (constexpr).
_TENSORS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV"}
_FP32_TENSORS = {"LSE", "DELTA"}
_INTS = {"H_q", "H_kv", "N_q", "N_k", "GROUP", "OFFSET"}
_FLOATS = {"scale", "qk_scale"}


@dataclass(frozen=True)
class CompileReport:
    """What one compiled kernel uses."""

    kernel: str
    arch: str
    dtype: torch.dtype
    head_dim: int
    config: KernelConfig
    registers: int
    spill_bytes: int
    smem_bytes: int
    mma: str  # "HGMMA", "HMMA" or "none"
    seconds: float

    def problems(self) -> list[str]:
        """Why this kernel fails the compile checks; empty if it passes."""
        out = []
        if self.spill_bytes:
            out.append(
                "spills to local memory"
                if self.spill_bytes < 0
                else f"{self.spill_bytes} bytes spilled to local memory"
            )
        if self.registers > MAX_REGISTERS:
            out.append(f"{self.registers} registers > {MAX_REGISTERS}")
        if self.smem_bytes > SMEM_LIMIT[self.arch]:
            out.append(f"{self.smem_bytes} bytes of shared memory > {SMEM_LIMIT[self.arch]}")
        if (
            self.arch == "sm90"
            and self.dtype != torch.float32
            and self.kernel != "backward_preprocess"
            and self.mma != "HGMMA"
        ):
            out.append(f"matmuls use {self.mma}, not HGMMA")
        return out


def _kernel_fn(name: str):
    from .backward import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess
    from .forward import _attn_fwd

    return {
        "forward": _attn_fwd,
        "backward_preprocess": _attn_bwd_preprocess,
        "backward_dkdv": _attn_bwd_dkdv,
        "backward_dq": _attn_bwd_dq,
    }[name]


def _source(name: str, dtype: torch.dtype, head_dim: int, c: KernelConfig, causal: bool):
    """An ``ASTSource`` with the signature, constants and alignment hints the JIT would use."""
    import triton

    fn = _kernel_fn(name)
    precision = dot_precision(dtype)
    values: dict[str, object] = {
        "HEAD_DIM": head_dim,
        "HEAD_DIM_V": head_dim,
        "BLOCK_D": head_dim,
        "BLOCK_DV": head_dim,
        "BLOCK_M": c.BLOCK_M,
        "BLOCK_N": c.BLOCK_N,
        "CAUSAL": causal,
        "DOT_PRECISION": precision,
    }
    signature: dict[str, str] = {}
    constexprs: dict[str, object] = {}
    attrs: dict[tuple[int, ...], list[list[object]]] = {}
    for i, arg in enumerate(fn.arg_names):
        if arg in _TENSORS or arg in _FP32_TENSORS:
            signature[arg] = "*" + (_TRITON_DTYPE[dtype] if arg in _TENSORS else "fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg.startswith("stride_") and arg.endswith("d"):
            signature[arg], constexprs[arg] = "constexpr", 1  # contiguous head dimension
        elif arg.startswith("stride_"):
            signature[arg] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in _INTS:
            signature[arg] = "i32"
        elif arg in _FLOATS:
            signature[arg] = "fp32"
        else:
            signature[arg], constexprs[arg] = "constexpr", values[arg]
    return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def _resource(res_usage: str, name: str) -> int:
    """One figure of ``cuobjdump -res-usage`` (``REG:226 STACK:0 SHARED:0 LOCAL:0 ...``)."""
    found = re.search(rf"\b{name}:(\d+)", res_usage)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no {name} figure: {res_usage.strip()!r}")
    return int(found.group(1))


def compile_kernel(
    name: str, arch: str, dtype: torch.dtype, head_dim: int, c: KernelConfig, causal: bool = True
) -> CompileReport:
    """Compile one kernel for ``arch`` ("sm90" or "sm80") and read its resource use from the cubin."""
    import time

    import triton
    from triton.backends.compiler import GPUTarget

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("ahead-of-time compilation needs TRITON_INTERPRET unset (it is set in this process)")
    t0 = time.perf_counter()
    target = GPUTarget("cuda", int(arch[2:]), 32)
    compiled = triton.compile(
        _source(name, dtype, head_dim, c, causal),
        target=target,
        options={"num_warps": c.num_warps, "num_stages": c.num_stages},
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        res = subprocess.run([_cuobjdump(), "-res-usage", str(cubin)], capture_output=True, text=True, check=True)
        sass = subprocess.run([_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True)
    registers = _resource(res.stdout, "REG")
    local = _resource(res.stdout, "LOCAL") + _resource(res.stdout, "STACK")
    if local == 0 and re.search(r"\b(STL|LDL)\b", sass.stdout):
        local = -1  # local-memory traffic of unknown size
    static_smem = _resource(res.stdout, "SHARED")
    mma = "HGMMA" if "HGMMA" in sass.stdout else "HMMA" if "HMMA" in sass.stdout else "none"
    return CompileReport(
        kernel=name,
        arch=arch,
        dtype=dtype,
        head_dim=head_dim,
        config=c,
        registers=registers,
        spill_bytes=local,
        smem_bytes=max(static_smem, compiled.metadata.shared),
        mma=mma,
        seconds=time.perf_counter() - t0,
    )


def shipped_kernels(arch: str, dtypes=DTYPES, head_dims=HEAD_DIMS) -> list[tuple[str, torch.dtype, int, KernelConfig]]:
    """Every (kernel, dtype, padded head dim, configuration) shipped for ``arch``."""
    out = []
    for dt, d, config in shipped_configs(arch):
        if dt in dtypes and d in head_dims:
            backward = config.backward_dkdv is not None
            for name in KERNELS:
                c = config.kernel(name)
                if c is not None and (backward or name == "forward"):
                    out.append((name, dt, d, c))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flashattn-teach kernels``."""
    parser.add_argument("--arch", choices=ARCHS, default="sm90", help="GPU generation to compile for")
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


def run(args: argparse.Namespace) -> int:
    """Compile and print one row per kernel and configuration; exit status 1 if any check fails."""
    dtypes = [_DTYPE_BY_NAME[n] for n in args.dtype] if args.dtype else DTYPES
    head_dims = args.head_dim or HEAD_DIMS
    kernels = args.kernel or KERNELS
    selected = [(name, dt, d, c) for name, dt, d, c in shipped_kernels(args.arch, dtypes, head_dims) if name in kernels]
    if not selected:
        dtype_names = " ".join(args.dtype or ["any"])
        print(
            f"flashattn-teach kernels: error: no shipped {args.arch} kernel has --dtype {dtype_names}, "
            f"--head-dim {' '.join(map(str, head_dims))} and --kernel {' '.join(kernels)}",
            file=sys.stderr,
        )
        return 2
    os.environ.pop("TRITON_INTERPRET", None)  # compiling ahead of time needs it unset in this process
    header = (
        f"{'kernel':<20} {'dtype':<9} {'D':>4} {'BLOCK_M':>7} {'BLOCK_N':>7} {'warps':>5} {'stages':>6} "
        f"{'regs':>5} {'spills':>6} {'smem':>8} {'mma':>6}  check"
    )
    print(f"# {args.arch}: registers <= {MAX_REGISTERS}, no spills, shared memory <= {SMEM_LIMIT[args.arch]} B")
    print(header)
    failed = 0
    for name, dt, d, c in selected:
        r = compile_kernel(name, args.arch, dt, d, c)
        problems = r.problems()
        failed += bool(problems)
        print(
            f"{name:<20} {str(dt).removeprefix('torch.'):<9} {d:>4} {c.BLOCK_M:>7} {c.BLOCK_N:>7} "
            f"{c.num_warps:>5} {c.num_stages:>6} {r.registers:>5} {r.spill_bytes:>6} {r.smem_bytes:>8} "
            f"{r.mma:>6}  {'; '.join(problems) or 'ok'}",
            flush=True,
        )
    return 1 if failed else 0


def main() -> int:
    parser = ArgumentParser(prog="flashattn-teach kernels", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
