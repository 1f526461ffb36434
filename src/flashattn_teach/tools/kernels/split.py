"""``flashattn-teach kernels --split-head-dim``: what running D = 192 as two lane groups (128 + 64) saves
against padding it to 256, for DeepSeek's MLA prefill shape (D = 192, D_v = 128), from the compiled loops.

Three builds of each kernel (forward, dK/dV, dQ): the shipped 192 / 128 row split (:mod:`..lanes`), the same
tile with the head dim padded to 256 (:func:`.specialize.one_lane_group`), and the padded build of the 256
row, which such a call got before the split. Per key-block (dK/dV: query-block) iteration of the
non-causal steady-state loop: instructions per warp, tensor-core instructions per warp and the program's
tensor-core FMAs, the modelled cycles (:mod:`.loops`) and the model's TFLOP/s counted in *useful* FLOPs,
those of the 192 / 128 products alone (a padded build's products over the 64 zero lanes are not counted):

    forward  2 BLOCK_M BLOCK_N (D + D_v)         S = Q K^T, P V
    dK/dV    2 BLOCK_M BLOCK_N (2 D + 2 D_v)     S^T, dV += P^T dO, dP^T, dK += dS^T Q
    dQ       2 BLOCK_M BLOCK_N (2 D + D_v)       S, dP, dQ += dS K

A ``split`` dK/dV tile (the 256 row's) runs a dK program (profiled: S^T, dP^T, dK, so 2 D + D_v) and a dV
program besides, which recomputes S^T; its figure is the dK program's.
"""

from __future__ import annotations

import torch

from ...triton.configs import KERNELS, shipped_config
from ...triton.lanes import SPLIT_HEAD_DIMS, block_d
from .compile import compile_kernel

_D, _D_V = SPLIT_HEAD_DIMS
_USEFUL_LANES = {"forward": _D + _D_V, "backward_dkdv": 2 * _D + 2 * _D_V, "backward_dq": 2 * _D + _D_V}
_HEADER = (
    f"{'kernel':<14} {'build':<22} {'tile':<20} {'regs':>4} {'spill':>5} {'smem':>6} {'instr':>5} {'mma':>4} "
    f"{'tc FMAs':>9} {'cycles':>6} {'useful TF/s':>11}"
)


def print_split_profile(arch: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Print the comparison table for ``arch`` (see the module docstring)."""
    split_row = shipped_config(_D, dtype, arch, head_dim_v=_D_V)
    old_row = shipped_config(block_d(_D), dtype, arch)
    print(f"\n# D = {_D}, D_v = {_D_V}, {str(dtype).removeprefix('torch.')}, {arch}, non-causal: split lanes vs padded")
    print(_HEADER)
    for name in ("forward", "backward_dkdv", "backward_dq"):
        assert name in KERNELS
        builds = (
            ("split 128+64 (192 row)", split_row.kernel(name), False),
            ("padded 256, same tile", split_row.kernel(name), True),
            ("padded 256 (256 row)", old_row.kernel(name), True),
        )
        for label, c, padded in builds:
            if c is None:
                continue
            r = compile_kernel(name, arch, dtype, _D, c, causal=False, head_dim_v=_D_V, padded=padded)
            p = r.loop_profile()
            if p is None:
                continue
            lanes = 2 * _D + _D_V if name == "backward_dkdv" and c.split else _USEFUL_LANES[name]
            useful = p.estimate_tflops(2 * c.BLOCK_M * c.BLOCK_N * lanes)
            print(
                f"{name.removeprefix('backward_'):<14} {label:<22} {c!s:<20} {r.registers:>4} {r.spill_bytes:>5} "
                f"{r.smem_bytes:>6} {p.instructions:>5} {sum(p.mma.values()):>4} {p.mma_fmas:>9} {p.cycles:>6.0f} "
                f"{useful:>11.0f}",
                flush=True,
            )
