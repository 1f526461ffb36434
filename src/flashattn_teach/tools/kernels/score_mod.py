"""What a ``score_mod`` costs in the kernels' loops: a softcap written as a score_mod,
``30 * tanh(score / 30)`` (translated by :mod:`flashattn_teach.triton.usermod`), against the built-in
``softcap=30``, in instructions per warp and iteration of each kernel's steady-state loop
(:mod:`.loops`). Issue 24's target: at most 10% more.

Both are compiled for the same sample call (:mod:`.specialize`, non-causal, no other variant) in the
configurations calls with variants get, the forward unspecialised (the launcher does not warp-specialise a
call with user functions, :func:`flashattn_teach.triton.tma.ws_reason`); the built-in's
warp-specialised forward, where it ships, is a row of its own.

    flashattn-teach kernels --arch sm90 --dtype bfloat16 --head-dim 128 --score-mod
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...triton.configs import KERNELS, KernelConfig, shipped_config
from ...triton.variants import KernelVariants
from .specialize import sample_variants

SOFTCAP = 30.0


def softcap_score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx, kv_idx) -> torch.Tensor:
    """The built-in softcap as a user would write it for FlexAttention."""
    return SOFTCAP * torch.tanh(score / SOFTCAP)


def softcap_variants() -> tuple[KernelVariants, KernelVariants]:
    """``(built-in softcap, the same as a translated score_mod)`` for a sample call."""
    from ...triton.usermod import compile_score_mod

    plain = sample_variants(window=False, softcap=False, alibi=False)
    return replace(plain, softcap=SOFTCAP), replace(plain, score_mod=compile_score_mod(softcap_score_mod))


@dataclass(frozen=True)
class LoopComparison:
    """Instructions per warp and iteration of one kernel's loop, built-in softcap against score_mod."""

    kernel: str
    dtype: torch.dtype
    head_dim: int
    config: KernelConfig
    builtin: int
    score_mod: int

    @property
    def extra(self) -> float:
        """The score_mod's instructions over the built-in's, minus one (0.05: 5% more)."""
        return self.score_mod / self.builtin - 1.0

    def row(self) -> str:
        return (
            f"{self.kernel.removeprefix('backward_'):<10} {str(self.dtype).removeprefix('torch.'):<9} "
            f"{self.head_dim:>4} {self.config!s:<20} {self.builtin:>8} {self.score_mod:>9} {self.extra:>+7.1%}"
        )


HEADER = f"{'kernel':<10} {'dtype':<9} {'D':>4} {'tile':<20} {'built-in':>8} {'score_mod':>9} {'extra':>7}"


def compare(arch: str, dtype: torch.dtype, head_dim: int) -> list[LoopComparison]:
    """One :class:`LoopComparison` per kernel with a loop (the forward unspecialised) that ships for
    ``(arch, dtype, head_dim)`` with variants. Compiles; no GPU needed, no ``TRITON_INTERPRET``."""
    from .compile import compile_kernel

    builtin, user = softcap_variants()
    config = shipped_config(head_dim, dtype, arch, variants=True)
    out = []
    for name in KERNELS:
        c = config.kernel(name)
        if c is None or name == "backward_preprocess":
            continue
        if name == "forward":
            c = c.unspecialised()
        counts = []
        for variants in (builtin, user):
            profile = compile_kernel(name, arch, dtype, head_dim, c, causal=False, variants=variants).loop_profile()
            counts.append(0 if profile is None else profile.instructions)
        if all(counts):
            out.append(LoopComparison(name, dtype, head_dim, c, counts[0], counts[1]))
    return out


def print_comparison(arch: str, dtypes: list[torch.dtype], head_dims: list[int]) -> None:
    """The ``--score-mod`` table."""
    print(f"\n# softcap {SOFTCAP:g} as a score_mod against the built-in, {arch}, non-causal: instructions per warp")
    print("# and iteration of the steady-state loop (docs/loop-profile.md); target: at most 10% more")
    print(HEADER)
    for dtype in dtypes:
        for d in head_dims:
            for comparison in compare(arch, dtype, d):
                print(comparison.row(), flush=True)
