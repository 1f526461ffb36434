"""Block sizes, warps and pipeline stages: one small named table per (head dim, dtype, GPU generation).

A configuration is chosen by the *padded* head dimension ``BLOCK_D`` (the next power of two >= 16, so
D = 40 uses the 64 row, D = 80 and 96 the 128 row; :mod:`.lanes`: D = 129 to 192 with D_v <= 128 runs as
two lane groups, 128 + 64, on a 192 row of its own), by the element size of the inputs, and by the GPU
generation ("sm90" Hopper, "sm80" Ampere and older); D % 16 != 0 takes thinner tiles (:mod:`.unaligned`). The
GPU tests' and suite's specialisations compile with triton 3.6 and 3.9 (``kernels --specializations``).

Kernels and the tiles each one owns:

    forward        program = query block i (BLOCK_M rows), loops over key blocks j (BLOCK_N keys)
    backward_dkdv  program = key block j (BLOCK_N keys), loops over query blocks i (BLOCK_M rows)
    backward_dq    program = query block i (BLOCK_M rows), loops over key blocks j (BLOCK_N keys)
    backward_fused program = key block j, as backward_dkdv, also adding dQ_i by atomics (opt-in: .provenance)
    preprocess     program = BLOCK_M rows of delta = rowsum(dO * O); BLOCK_N is unused
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .._validate.inputs import AttentionShapes
from ..errors import AttentionTypeError, AttentionValueError
from .lanes import SPLIT_DIM, table_dim
from .lanes import block_d as block_d  # re-exported: callers look for it here
from .lanes import lane_groups as lane_groups
from .unaligned import mask_forward, narrow_row, unaligned

KERNELS = ("forward", "backward_preprocess", "backward_dkdv", "backward_dq", "backward_fused")
ARCHS = ("sm90", "sm80")
HEAD_DIMS = (16, 32, 64, 128, 256)  # the padded head dimensions BLOCK_D that have table rows
MIN_HEAD_DIM = 1
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton_version() -> tuple[int, int]:
    """(major, minor) of the installed triton, read from its metadata (importing triton here would slow
    every command that never compiles a kernel); (0, 0) without it."""
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return (0, 0)
    major, minor = [*re.findall(r"\d+", version), "0", "0"][:2]
    return int(major), int(minor)


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one kernel. ``tma``: the tiles that stream through the kernel's loop (key/value
    blocks in the forward and dQ kernels, query and dO blocks in dK/dV) arrive through tensor descriptors
    (Hopper's tensor memory accelerator) when the inputs' strides allow it (16-byte aligned, see
    :mod:`.tma`); ``fallback``: the configuration to run instead when they do not (None: this one, through
    pointers), for tiles that fit in registers only without the pointer path's address arithmetic.
    ``split``: the dK/dV kernel runs as two programs per key block, one accumulating dK and one dV, each
    recomputing the probabilities (for head dims whose two fp32 accumulators do not fit in registers
    together); other kernels ignore it.

    ``ws`` (forward only): the key loop is warp-specialised by triton's pass on sm_90: ``num_warps = 4``
    become a producer warpgroup issuing the TMA copies and two consumer warpgroups of 64 query rows each
    (:mod:`.tma`'s ``forward_tile`` says when it runs); ``fallback`` is then the configuration that runs
    where it cannot (None: this tile, not specialised), itself with or without a TMA fallback. Triton
    compiles a ``ws`` tile of fewer than 64 query rows (32 x 16, as the interpreter tests use) without
    specialising it: 4 warps, the same loop."""

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    tma: bool = False
    split: bool = False
    fallback: KernelConfig | None = None
    ws: bool = False

    def __post_init__(self) -> None:
        if self.ws:
            if not self.tma or self.num_warps != 4 or self.split or (self.fallback and self.fallback.ws):
                raise AttentionValueError(
                    f"ws=True (a warp-specialised forward) needs tma=True, num_warps=4 (the pass makes 12 of them), "
                    f"no split and a fallback that is not warp-specialised, got tma={self.tma}, "
                    f"num_warps={self.num_warps}, split={self.split}, fallback={self.fallback!r}"
                )
        elif self.fallback is not None and (not self.tma or self.fallback.tma or self.fallback.fallback):
            raise AttentionValueError(
                f"fallback is the tile for when TMA cannot run: it needs tma=True here and a pointer tile "
                f"without a fallback of its own, got tma={self.tma} and fallback={self.fallback!r}"
            )

    def by_pointers(self) -> KernelConfig:
        """The configuration that runs when this one cannot read by TMA: ``fallback``, or this tile through
        pointers (for a ``ws`` one, that of :meth:`unspecialised`)."""
        if self.ws:
            return self.unspecialised().by_pointers()
        return self.fallback or replace(self, tma=False)

    def unspecialised(self) -> KernelConfig:
        """The configuration that runs when this ``ws`` one cannot be warp-specialised: ``fallback``, or
        this tile without ``ws``; a configuration without ``ws`` is its own."""
        if not self.ws:
            return self
        return self.fallback or replace(self, ws=False)

    def __str__(self) -> str:
        flags = " tma" * self.tma + " split" * self.split + " ws" * self.ws
        return f"{self.BLOCK_M}x{self.BLOCK_N} w{self.num_warps} s{self.num_stages}{flags}"


@dataclass(frozen=True)
class AttentionConfig:
    """The configurations of the kernels of one attention call (forward and backward). ``backward_fused``:
    the one-kernel backward's tile (the dK/dV kernel adding dQ by atomics), the backward where it is set;
    None where no tile compiles cleanly (or, by default on a GPU, where it is not switched on:
    :mod:`.provenance`), and then the two-kernel backward (``backward_dkdv`` and ``backward_dq``, also the
    ``deterministic`` one). ``longest_first``: under causal the programs start all heads' longest blocks
    first (:mod:`.kernels.grid`'s ``LONGEST``), else each head's blocks longest first (``PER_HEAD``)."""

    forward: KernelConfig
    backward_dkdv: KernelConfig | None
    backward_dq: KernelConfig | None
    backward_preprocess: KernelConfig = KernelConfig(32, 0, 4, 1)
    backward_fused: KernelConfig | None = None
    longest_first: bool = True

    @classmethod
    def uniform(cls, block_m: int, block_n: int, num_warps: int = 4, num_stages: int = 1) -> AttentionConfig:
        """The same tile for every kernel; used by the interpreter tests."""
        c = KernelConfig(block_m, block_n, num_warps, num_stages)
        pre = KernelConfig(block_m, 0, 4, 1)
        return cls(forward=c, backward_dkdv=c, backward_dq=c, backward_preprocess=pre, backward_fused=c)

    def __post_init__(self) -> None:
        if self.backward_fused is not None and self.backward_fused.split:
            raise AttentionValueError(
                f"backward_fused={self.backward_fused}: the one-kernel backward holds dK_j and dV_j in one program "
                "and cannot be split; pass a tile without split=True, or backward_fused=None"
            )

    def kernel(self, name: str) -> KernelConfig | None:
        """The configuration of one of :data:`KERNELS`, by name."""
        if name not in KERNELS:
            raise AttentionValueError(f"name must be one of {', '.join(KERNELS)}, got {name!r}")
        config: KernelConfig | None = getattr(self, name)
        return config


# The interpreter tests' configuration: small (a short CPU run), BLOCK_M != BLOCK_N (no code assumes them equal).
TEST_CONFIG = AttentionConfig.uniform(32, 16)

# (forward, backward_dkdv, backward_dq) of one padded head dim
_Row = tuple[KernelConfig, KernelConfig | None, KernelConfig | None]

K = KernelConfig


def _ws(block_m: int, block_n: int, num_stages: int, fallback: KernelConfig) -> KernelConfig:
    """A warp-specialised forward tile (4 warps, by TMA) with the configuration to run where it cannot."""
    return KernelConfig(block_m, block_n, 4, num_stages, tma=True, ws=True, fallback=fallback)


# One row per padded head dim; None where a kernel does not ship because no tile fits in registers
# without spilling (the dK/dV program holds two fp32 accumulators of BLOCK_N x BLOCK_D, plus the
# BLOCK_N x BLOCK_M scores and dP^T of a step). fp16 and bf16 share a table: their kernels differ only in
# the MMA's input type. The dK/dV tile is a multiple of the warpgroup MMA's 64 rows. At hd128 its 64 x 128
# tile fits only with Q_i and dO_i read by TMA and four stages, as triton 3.9 builds it (through pointers it
# spills 72 to 152 bytes, so its fallback is 32 x 128; with three stages the causal build spills 16). The
# forward's TMA tiles at hd64 to hd256 spill 8 to 80 bytes through pointers: they fall back to smaller ones. Triton 3.6
# spills it in every build tried: 16 to 56 bytes with four stages, and with two or three stages also local
# loads and stores in the unmasked loop; so with 3.6 the tile stays 32 x 128. The hd64 and hd128 forward
# rows are the fastest timed on an H200 with triton 3.6 (benchmarks/results/gpu/2026-11-30-h200-issue9/
# probe.log); the backward rows are the loop profile's best that compile cleanly (docs/loop-profile.md), not
# yet timed. At hd256 the dK/dV rows are ``split``: dK and dV by separate programs, since their two
# accumulators do not fit in registers together.
#
# The forward rows are warp-specialised (``ws``: 4 warps become 12) with the previous row as their fallback,
# for calls the pass takes (:func:`.tma.ws_reason`), where switched on (off by default: .provenance). Their
# tiles are the largest that compile without spills with triton 3.6 and 3.9 in shared memory within the
# 232,448 bytes a block may use: 128 x 128 with three stages up to hd64 (131,648 bytes at hd64), with two
# at hd128 (180,608; three ask for 246,336), 128 x 64 with two at hd256 (229,760). Not yet run on a GPU.
#
# The 192 rows (D = 192, D_v <= 128, as two lane groups: :mod:`.lanes`) are the loop profile's best that
# compile without spills, causal and not, with triton 3.6 and 3.9 (``flashattn-teach kernels
# --split-head-dim``); not timed. Their K_j and Q_i come through pointers except in the warp-specialised
# forward. The split frees registers where padding to 256 spills: the 16 x 128 dK/dV and 128 x 64 dQ tiles
# spill 128 and 8 bytes padded. No one-kernel backward tile compiled cleanly (16 x 128 to 32 x 128: 80 to
# 576 bytes), so the backward is the two-kernel one.
_SM90_16BIT: dict[int, _Row] = {
    16: (_ws(128, 128, 3, K(128, 64, 4, 3, tma=True)), K(32, 128, 4, 3), K(128, 64, 4, 3)),
    32: (_ws(128, 128, 3, K(128, 64, 4, 3, tma=True)), K(32, 128, 8, 3), K(128, 64, 4, 3)),
    64: (
        _ws(128, 128, 3, K(128, 64, 4, 3, tma=True, fallback=K(128, 64, 8, 3))),
        K(64, 128, 8, 3),
        K(128, 128, 8, 3, tma=True),
    ),
    128: (
        _ws(128, 128, 2, K(128, 128, 8, 3, tma=True, fallback=K(128, 32, 8, 3))),  # 128 x 64: 376 B (D = 100)
        K(64, 128, 8, 4, tma=True, fallback=K(32, 128, 8, 2)) if _triton_version() >= (3, 9) else K(32, 128, 8, 2),
        K(128, 64, 8, 3, tma=True),
    ),
    SPLIT_DIM: (_ws(128, 64, 2, K(128, 64, 8, 3)), K(16, 128, 8, 2), K(128, 64, 8, 2)),
    256: (
        _ws(128, 64, 2, K(128, 64, 8, 2, tma=True, fallback=K(64, 64, 8, 2))),
        K(16, 64, 8, 2, split=True),
        K(128, 32, 8, 2),
    ),
}
# Ampere's MMA spreads accumulators over fewer threads' registers than Hopper's warpgroup MMA: smaller tiles.
_SM80_16BIT: dict[int, _Row] = {
    16: (K(128, 64, 4, 3), K(32, 128, 4, 3), K(128, 64, 4, 3)),
    32: (K(128, 64, 4, 3), K(32, 128, 8, 3), K(128, 32, 4, 3)),
    64: (K(128, 128, 8, 3), K(32, 128, 8, 2), K(128, 32, 8, 3)),
    128: (K(128, 64, 8, 3), K(32, 64, 8, 2), K(64, 64, 8, 2)),
    SPLIT_DIM: (K(64, 64, 4, 2), K(32, 32, 4, 2), K(32, 64, 8, 2)),
    256: (K(64, 64, 8, 2), K(32, 64, 8, 2, split=True), K(64, 32, 8, 2)),
}
# fp32 inputs run "tf32x3" dots, whose split operands need about twice the registers. Above hd64 only thin
# tiles fit: at hd128 these rows are the ones found to compile without spills with triton 3.6 and 3.9 on
# both generations (most of 64 x 32, 32 x 16 with 4 warps and the like spill 32 to 600 bytes).
_SM90_FP32: dict[int, _Row] = {
    16: (K(64, 64, 4, 2), K(32, 64, 4, 2), K(64, 32, 4, 2)),
    32: (K(64, 64, 4, 2), K(32, 64, 4, 2), K(64, 32, 4, 2)),
    64: (K(64, 32, 4, 2), K(32, 16, 4, 2), K(64, 32, 4, 2)),
    128: (K(32, 32, 8, 2), K(32, 16, 8, 2), K(16, 32, 4, 2)),
}
_SM80_FP32: dict[int, _Row] = {
    16: (K(64, 32, 4, 2), K(32, 64, 4, 2), K(64, 32, 4, 2)),
    32: (K(64, 32, 4, 2), K(16, 64, 4, 2), K(64, 16, 4, 2)),
    64: (K(64, 16, 4, 2), K(16, 16, 4, 2), K(32, 32, 4, 2)),
    128: (K(32, 32, 8, 2), K(32, 16, 8, 2), K(16, 32, 4, 2)),
}
# Calls with variants (window, softcap, ALiBi, seqlens_k, or an attn_mask) keep more per score live in the
# loop (index tensors, the tanh, the bias): where a plain tile spills with all of them at once or with a
# padding mask (``flashattn-teach kernels --variants``, ``--mask bool``, ``--mask additive``), a thinner
# one that does not, with triton 3.6 and 3.9. Keyed by (arch, "16-bit" or "fp32", padded head dim);
# those without a row use the plain row (192 / 128: the 256 row, whose sm_80 dQ spills 88 bytes there). At
# hd256 on sm_90 no dK/dV tile tried compiles without spilling with an additive mask and triton 3.9 (this
# one: 8 to 16 bytes; with 3.6 none).
# The sm_90 16-bit forward rows are warp-specialised as the plain ones are, with tiles clean with window,
# softcap, ALiBi and seqlens_k at once (at hd128 and hd256 thinner than the plain rows': 128 x 128 spills
# 16 bytes at hd128 with triton 3.9, 128 x 64 24 bytes at hd256 with 3.6); an attn_mask falls back.
_VARIANT_ROWS: dict[tuple[str, str, int], _Row] = {
    ("sm90", "16-bit", 16): (_ws(128, 128, 3, K(128, 64, 8, 3, tma=True)), K(32, 128, 4, 3), K(128, 64, 8, 3)),
    ("sm90", "16-bit", 32): (_ws(128, 128, 3, K(128, 64, 4, 3, tma=True)), K(32, 128, 8, 3), K(128, 64, 8, 3)),
    ("sm90", "16-bit", 64): (_ws(128, 128, 3, K(128, 32, 4, 3, tma=True)), K(32, 128, 8, 3), K(128, 64, 8, 3)),
    ("sm90", "16-bit", 128): (
        _ws(128, 64, 3, K(128, 64, 8, 3, tma=True, fallback=K(128, 32, 8, 3))),
        K(32, 64, 8, 2),
        K(128, 32, 8, 3),
    ),
    ("sm90", "16-bit", 256): (
        _ws(128, 32, 2, K(128, 32, 8, 2, tma=True, fallback=K(64, 32, 8, 2))),
        K(16, 64, 8, 2, split=True),
        K(128, 32, 8, 2),
    ),
    ("sm90", "fp32", 16): (K(64, 32, 4, 2), K(32, 64, 4, 2), K(64, 32, 4, 2)),
    ("sm90", "fp32", 32): (K(64, 32, 4, 2), K(16, 64, 4, 2), K(64, 32, 4, 2)),
    ("sm90", "fp32", 64): (K(64, 32, 4, 2), K(32, 16, 4, 2), K(64, 16, 4, 2)),
    ("sm90", "fp32", 128): (K(16, 32, 4, 2), K(16, 16, 8, 2), K(16, 32, 4, 1)),
    ("sm80", "16-bit", 64): (K(64, 64, 4, 3), K(32, 32, 8, 2), K(128, 32, 8, 3)),
    ("sm80", "16-bit", 128): (K(64, 32, 8, 2), K(32, 32, 8, 2), K(64, 64, 8, 3)),
    ("sm80", "16-bit", 256): (K(64, 64, 8, 2), K(32, 32, 8, 2, split=True), K(64, 32, 8, 2)),
    ("sm80", "16-bit", SPLIT_DIM): (K(64, 64, 8, 2), K(32, 32, 8, 2, split=True), K(32, 64, 8, 2)),
    ("sm80", "fp32", 16): (K(64, 32, 4, 2), K(32, 64, 4, 2), K(64, 16, 4, 2)),
    ("sm80", "fp32", 32): (K(64, 32, 4, 2), K(16, 32, 4, 2), K(32, 16, 4, 2)),
    ("sm80", "fp32", 128): (K(32, 32, 8, 2), K(16, 16, 8, 1), K(16, 32, 4, 2)),
}
# Dropout draws a Philox4x32-10 number per score (ten rounds of 32-bit multiplies) in the forward, dK/dV
# and dQ loops: thinner tiles again, compiled with dropout alone, with every variant, with a padding mask
# and on packed sequences. Exceptions, in every tile tried: the sm_90 hd256 dK/dV spills 96 bytes with
# triton 3.9 (and 16 to 160 with a mask or packed sequences, with 3.6 too); the sm_90 fp32 hd128 dQ
# spills 16 bytes on packed sequences with 3.9 (the tiles clean there spill with a mask).
_DROPOUT_ROWS: dict[tuple[str, str, int], _Row] = {
    ("sm90", "16-bit", 16): (K(128, 32, 8, 3, tma=True), K(32, 128, 8, 3), K(128, 32, 8, 3)),
    ("sm90", "16-bit", 32): (K(128, 32, 8, 3, tma=True), K(32, 128, 8, 2), K(128, 32, 8, 3)),
    ("sm90", "16-bit", 64): (K(128, 32, 8, 3, tma=True), K(32, 64, 8, 2), K(128, 32, 8, 3)),
    ("sm90", "16-bit", 128): (K(128, 32, 8, 3, tma=True), K(16, 64, 8, 2), K(64, 32, 8, 3)),
    ("sm90", "16-bit", 256): (K(64, 16, 8, 2, tma=True), K(16, 64, 8, 2, split=True), K(128, 16, 8, 3)),
    ("sm90", "fp32", 16): (K(64, 32, 4, 2), K(32, 64, 4, 2), K(64, 32, 4, 2)),
    ("sm90", "fp32", 32): (K(64, 32, 4, 2), K(16, 64, 4, 2), K(64, 32, 4, 2)),
    ("sm90", "fp32", 64): (K(64, 32, 4, 2), K(32, 16, 4, 2), K(32, 32, 8, 2)),
    ("sm90", "fp32", 128): (K(16, 32, 4, 2), K(16, 16, 8, 1), K(16, 16, 4, 2)),
    ("sm80", "16-bit", 16): (K(128, 32, 8, 3), K(32, 128, 8, 3), K(128, 32, 8, 3)),
    ("sm80", "16-bit", 32): (K(64, 16, 4, 3), K(32, 128, 8, 2), K(128, 32, 8, 3)),
    ("sm80", "16-bit", 64): (K(64, 32, 8, 3), K(32, 32, 8, 2), K(64, 32, 8, 3)),
    ("sm80", "16-bit", 128): (K(64, 32, 8, 2), K(32, 32, 8, 2), K(32, 64, 8, 2)),
    ("sm80", "16-bit", 256): (K(64, 16, 8, 1), K(32, 32, 8, 2, split=True), K(32, 32, 8, 2)),
    ("sm80", "fp32", 16): (K(64, 16, 4, 2), K(16, 64, 4, 2), K(64, 16, 4, 2)),
    ("sm80", "fp32", 32): (K(64, 32, 4, 2), K(16, 32, 4, 2), K(16, 32, 4, 2)),
    ("sm80", "fp32", 64): (K(64, 16, 4, 2), K(16, 16, 4, 2), K(16, 32, 4, 2)),
    ("sm80", "fp32", 128): (K(16, 32, 8, 2), K(16, 16, 8, 1), K(16, 16, 4, 2)),
}
# The one-kernel backward (``backward_fused``: the dK/dV program also adds dQ by fp32 atomics; opt-in until a GPU
# passes it, .provenance) for calls without variants, dropout or packed sequences, with N_q >= its BLOCK_M
# (:func:`fused_backward`). Its loop holds the dK/dV tiles and the dQ partial (BLOCK_M x BLOCK_D fp32). Stages and
# TMA follow the compiler (hd128: 3.9 spills 16 B causal at two stages, 3.6 16 to 48 at one; hd64: 3.6 spills 32
# to 64 B in the loop by TMA, 8 to 40 B outside it through pointers). None (the two-kernel backward): hd256 (every
# tile tried spills 80 to 184 B), fp32 above hd32 (16-key tiles: D / 16 atomics per (query, key) pair), variants.
# Spills that remain are outside loops (benchmarks/results/specializations/; D % 16 != 0: .unaligned).
_V39 = _triton_version() >= (3, 9)
_FUSED_ROWS: dict[tuple[str, str, int], KernelConfig] = {
    ("sm90", "16-bit", 16): K(64, 128, 8, 3),
    ("sm90", "16-bit", 32): K(64, 128, 8, 3),
    ("sm90", "16-bit", 64): K(64, 128, 8, 2, tma=True, fallback=K(64, 128, 8, 2)) if _V39 else K(64, 128, 8, 2),
    ("sm90", "16-bit", 128): K(32, 128, 8, 1) if _V39 else K(32, 128, 8, 2),
    ("sm90", "fp32", 16): K(32, 64, 4, 2),
    ("sm90", "fp32", 32): K(16, 64, 4, 2),
    ("sm80", "16-bit", 16): K(32, 128, 4, 3),
    ("sm80", "16-bit", 32): K(32, 128, 8, 3),
    ("sm80", "16-bit", 64): K(32, 128, 8, 2),
    ("sm80", "16-bit", 128): K(32, 64, 8, 2),
    ("sm80", "fp32", 16): K(32, 64, 4, 2),
    ("sm80", "fp32", 32): K(16, 64, 4, 2),
}
del K

_TABLES: dict[tuple[str, torch.dtype], dict[int, _Row]] = {
    ("sm90", torch.float16): _SM90_16BIT,
    ("sm90", torch.bfloat16): _SM90_16BIT,
    ("sm80", torch.float16): _SM80_16BIT,
    ("sm80", torch.bfloat16): _SM80_16BIT,
    ("sm90", torch.float32): _SM90_FP32,
    ("sm80", torch.float32): _SM80_FP32,
}


def _table(arch: str, dtype: torch.dtype) -> dict[int, _Row]:
    if arch not in ARCHS:
        raise AttentionValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    if dtype not in DTYPES:
        raise AttentionTypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    return _TABLES[(arch, dtype)]


def max_head_dim(dtype: torch.dtype, backward: bool) -> int:
    """Largest head dimension with a shipped forward (or forward and backward) configuration."""
    rows = _table("sm90", dtype)
    return max(d for d, row in rows.items() if row[0] is not None and (not backward or None not in row))


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the kernels' ``tl.dot``: fp32 inputs use "tf32x3" (three TF32 tensor-core
    products whose sum carries fp32's accuracy, cf. Ootomo & Yokota 2022); 16-bit inputs ignore it."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def arch_of(device: torch.device) -> str:
    """GPU generation of a CUDA device: "sm90" for compute capability 9.x and newer, else "sm80"."""
    major, _ = torch.cuda.get_device_capability(device)
    return "sm90" if major >= 9 else "sm80"


def shipped_config(
    head_dim: int,
    dtype: torch.dtype,
    arch: str,
    *,
    variants: bool = False,
    dropout: bool = False,
    head_dim_v: int | None = None,
    attn_mask: bool = False,
) -> AttentionConfig:
    """The table's row for a head dim, dtype and GPU generation (backward None where it does not ship:
    :func:`max_head_dim`); ``variants``, ``dropout``, ``attn_mask``: the call has a window, softcap, ALiBi,
    seqlens_k or mask, dropout, an attn_mask. ``head_dim_v``: the values' where it differs (:func:`table_dim`)."""
    rows = _table(arch, dtype)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    for name, dim in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if not MIN_HEAD_DIM <= dim <= max(rows):
            raise AttentionValueError(
                f"{name} must be between {MIN_HEAD_DIM} and {max(rows)} for {dtype} on {arch}, got {dim}"
            )
    d = table_dim(head_dim, head_dim_v)
    fwd, dkdv, dq = rows[d]
    table = _DROPOUT_ROWS if dropout else _VARIANT_ROWS if variants else {}
    key = (arch, "fp32" if dtype == torch.float32 else "16-bit", d)
    if d == SPLIT_DIM and table and key not in table:
        # no variant or dropout row of its own: the 256 row's, whose tiles hold more lanes than 192 + 128
        key = (arch, key[1], block_d(SPLIT_DIM))
    if key in table:
        fwd, dkdv, dq = table[key]
    elif unaligned(head_dim, head_dim_v):  # rows the JIT cannot prove aligned: thinner pointer tiles (.unaligned)
        fwd, dkdv, dq = narrow_row(key, fwd, dkdv, dq, _V39)
    fwd = mask_forward(key, fwd) if attn_mask and variants and not dropout else fwd  # byte loads: .unaligned
    fused = None if variants or dropout else _FUSED_ROWS.get(key)
    return AttentionConfig(forward=fwd, backward_dkdv=dkdv, backward_dq=dq, backward_fused=fused)


def shipped_configs(
    arch: str, *, variants: bool = False, dropout: bool = False
) -> list[tuple[torch.dtype, int, AttentionConfig]]:
    """Every (dtype, padded head dim, configuration) that ships for ``arch`` (for calls with variants, with
    dropout)."""
    return [
        (dt, d, shipped_config(d, dt, arch, variants=variants, dropout=dropout))
        for dt in DTYPES
        for d in HEAD_DIMS
        if d in _table(arch, dt)
    ]


def check_backward_config(config: AttentionConfig, q: Tensor, s: AttentionShapes) -> tuple[KernelConfig, KernelConfig]:
    """``config``'s dK/dV and dQ kernel configurations; raises if the backward has none."""
    if config.backward_dkdv is None or config.backward_dq is None:
        raise AttentionValueError(
            f"config has no backward kernels (backward_dkdv={config.backward_dkdv}, "
            f"backward_dq={config.backward_dq}) for query {tuple(q.shape)} of {q.dtype} with D={s.D}, D_v={s.D_v}; "
            f"the shipped backward covers head dimensions up to {max_head_dim(q.dtype, backward=True)}: pass a "
            "config whose backward_dkdv and backward_dq are set, or do not ask for gradients"
        )
    return config.backward_dkdv, config.backward_dq


def fused_backward(config: AttentionConfig, deterministic: bool, N_q: int) -> bool:
    """Whether the backward runs as one kernel (dQ by fp32 atomic adds): not ``deterministic``, a
    ``backward_fused`` tile, and ``N_q`` queries filling one (fewer: every program would add into one partial
    query tile, and triton 3.6's ptxas crashes on the hd64 tile at N_q = 1 with GQA: the two kernels run)."""
    return not deterministic and config.backward_fused is not None and N_q >= config.backward_fused.BLOCK_M
