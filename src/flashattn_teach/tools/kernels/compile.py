"""One kernel compiled ahead of time for a GPU that need not be here: :func:`compile_kernel` and what it
reports (:class:`CompileReport`: registers, spills, shared memory, tensor-core instructions, the SASS for
the loop profile of :mod:`.loops`), for ``flashattn-teach kernels`` (:mod:`.report`) and its other tables.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field

import torch

from ...triton.configs import KernelConfig, shipped_config
from ...triton.variants import PLAIN, KernelVariants
from .loops import LoopProfile, profile_sass
from .sass import disassemble
from .specialize import CompileRequest, kernel_request, one_lane_group, with_kernel_config

# the shared memory a block may opt in to (CUDA C++ Programming Guide, compute capabilities: 227 KB on 9.0,
# 163 KB on 8.0); the SM's 228 and 164 KB hold 1 KB more the system reserves per block
SMEM_LIMIT = {"sm90": 227 * 1024, "sm80": 163 * 1024}
MAX_REGISTERS = 255
_SHORT_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


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
    launched_warps: int = field(compare=False)  # the compiled kernel's (more than asked when warp-specialised)
    request: CompileRequest = field(repr=False, compare=False)
    ptx: str = field(repr=False, compare=False)
    sass: str = field(repr=False, compare=False)

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

    def file_stem(self) -> str:
        """``forward_bf16_d128_128x128_w8_s2``: kernel, dtype, head dim and tile (``_ws`` when warp-specialised),
        for dumped files."""
        c = self.config
        return (
            f"{self.kernel}_{_SHORT_DTYPE[self.dtype]}_d{self.head_dim}_{c.BLOCK_M}x{c.BLOCK_N}"
            f"_w{c.num_warps}_s{c.num_stages}" + "_ws" * getattr(c, "ws", False)
        )

    def loop_profile(self) -> LoopProfile | None:
        """The profile of this kernel's steady-state loop; None for a kernel without a matmul loop."""
        return profile_sass(self.sass, self.config.num_warps, self.arch, kernel=self.kernel)


def _resource(res_usage: str, name: str) -> int:
    """One figure of ``cuobjdump -res-usage`` (``REG:226 STACK:0 SHARED:0 LOCAL:0 ...``)."""
    found = re.search(rf"\b{name}:(\d+)", res_usage)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no {name} figure: {res_usage.strip()!r}")
    return int(found.group(1))


def compile_kernel(
    name: str,
    arch: str,
    dtype: torch.dtype,
    head_dim: int,
    c: KernelConfig,
    causal: bool = True,
    group: int = 1,
    variants: KernelVariants = PLAIN,
    head_dim_v: int | None = None,
    padded: bool = False,
) -> CompileReport:
    """Compile one kernel for ``arch`` ("sm90" or "sm80") as the JIT would for a sample call with launch
    parameters ``c`` (see :func:`flashattn_teach.tools.kernels.specialize.attention_requests`), and read its
    resource use from the cubin. ``head_dim_v``: the values' head dim (default ``head_dim``); ``padded``:
    build the head dim as one padded lane group even where it is split (:func:`.specialize.one_lane_group`)."""
    t0 = time.perf_counter()
    base = shipped_config(
        head_dim, dtype, arch, variants=variants.used, dropout=variants.has_dropout, head_dim_v=head_dim_v
    )
    config = with_kernel_config(base, name, c)
    with one_lane_group() if padded else contextlib.nullcontext():
        request = kernel_request(
            name, config, dtype, head_dim, arch, causal=causal, group=group, variants=variants, head_dim_v=head_dim_v
        )
    compiled = request.compile()
    text, res = disassemble(compiled.asm["cubin"])
    registers = _resource(res, "REG")
    local = _resource(res, "LOCAL") + _resource(res, "STACK")
    if local == 0 and re.search(r"\b(STL|LDL)\b", text):
        local = -1  # local-memory traffic of unknown size
    static_smem = _resource(res, "SHARED")
    mma = "HGMMA" if "HGMMA" in text else "HMMA" if "HMMA" in text else "none"
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
        launched_warps=compiled.metadata.num_warps,
        request=request,
        ptx=compiled.asm["ptx"],
        sass=text,
    )
