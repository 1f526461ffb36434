"""Tiles for head dims whose rows the JIT cannot prove 16-element aligned (``D % 16 != 0``: 40, 100, ...).

Triton specialises an integer argument on whether it is a multiple of 16. A contiguous ``(B, H, N, D)``
tensor's row stride is ``D``, so at D = 40 or 100 the kernels cannot know that a row starts on a 16-byte
boundary: every pointer-path load of a padded tile (D = 40 of 64 lanes, 100 of 128) is issued element by
element, each element with its own 64-bit address. At the D = 64 and 128 rows' tiles those addresses
spilled 64 to 520 bytes in the steady-state loop (triton 3.6 and 3.9: benchmarks/results/specializations/).

Each entry below replaces one kernel's tile of the plain row (``configs.shipped_config``) for such a head
dim, keyed by ``(arch, "16-bit" or "fp32", padded head dim)``; values are ``(BLOCK_M, BLOCK_N, num_warps,
num_stages)``. Each is the tile tried with the fewest instructions per (query, key) pair in the loop and no
local-memory traffic there, with triton 3.6 and 3.9; its cost against the spilling tile, from the
specialisation table's loop counts (triton 3.6; warp instructions per iteration x warps / tile area):

    sm_90 16-bit 64  dQ     128x128 -> 128x64          0.489 -> 0.410 (-16%)
    sm_90 16-bit 128 dK/dV  32x128  -> 16x128           1.229 -> 1.363 (+11%; 80 B spill outside the loop)
    sm_90 16-bit 128 dQ     128x64  -> 128x32           0.838 -> 0.742 (-11%; 48 B outside the loop)
    sm_90 fp32   64  dQ     64x32 s2 -> 64x32 s1        2.111 -> 1.990 (-6%)
    sm_80 16-bit 64  fwd    128x128 -> 128x64           0.654 -> 0.580 (-11%)
    sm_80 16-bit 64  dK/dV  32x128  -> 16x128           1.133 -> 1.172 (+3%)
    sm_80 16-bit 128 fwd    128x64  -> 128x32           1.210 -> 1.145 (-5%)
    sm_80 16-bit 128 dQ     64x64   -> 64x32            1.928 -> 2.016 (+5%; 120 B outside the loop)
                            (triton 3.9: -> 32x32,   3.016 with 3.9, 3.062 with 3.6: +59%; 64x32 spills 192 B
                            in 3.9's loop, and so do 32x64 and 64x32 with 4 warps or one stage)

Calls with variants or dropout keep their own (already thinner) rows; the 16, 32 and 256 rows have no
entry (no GPU test or suite call launches such a head dim).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

Tile = tuple[int, int, int, int]  # BLOCK_M, BLOCK_N, num_warps, num_stages (through pointers)

UNALIGNED_TILES: dict[tuple[str, str, int], dict[str, Tile]] = {
    ("sm90", "16-bit", 64): {"backward_dq": (128, 64, 8, 3)},
    ("sm90", "16-bit", 128): {"backward_dkdv": (16, 128, 8, 2), "backward_dq": (128, 32, 8, 3)},
    ("sm90", "fp32", 64): {"backward_dq": (64, 32, 4, 1)},
    ("sm80", "16-bit", 64): {"forward": (128, 64, 8, 3), "backward_dkdv": (16, 128, 8, 2)},
    ("sm80", "16-bit", 128): {"forward": (128, 32, 8, 3), "backward_dq": (64, 32, 8, 2)},
}
# With triton 3.9 and newer (whose sm_80 dQ spills 192 B in the loop at 64 x 32), over the entries above
UNALIGNED_TILES_39: dict[tuple[str, str, int], dict[str, Tile]] = {
    ("sm80", "16-bit", 128): {"backward_dq": (32, 32, 8, 2)},
}


# A bool or additive attn_mask is read the same way, a byte (or element) at a time with its own address: the
# sm_90 16-bit forward (the variant rows' fallback, as warp specialisation cannot take a mask) spilled 680 and
# 696 B in the loop at hd128 (128x64 w8) and hd64 (128x32 w4) with triton 3.6. A mask call's forward tile,
# keyed as above (TMA kept): 128x32 w8 s3, 2.790 -> 2.152 instructions a pair at hd128 (-23%; 32 B outside the
# loop with 3.6, none with 3.9), 2.227 -> 2.086 at hd64 (-6%). The other variants keep the wider tile (the
# window's loop costs +57% a pair at 128x32).
MASK_FORWARD_TILES: dict[tuple[str, str, int], Tile] = {
    ("sm90", "16-bit", 64): (128, 32, 8, 3),
    ("sm90", "16-bit", 128): (128, 32, 8, 3),
}


def mask_forward(key: tuple[str, str, int], forward: Any) -> Any:
    """The forward a call with an attn_mask runs: :data:`MASK_FORWARD_TILES`' tile for ``key`` as ``forward``'s
    unspecialised one (its ``fallback`` where it is warp-specialised, which a mask never is), else ``forward``."""
    tile = MASK_FORWARD_TILES.get(key)
    if tile is None:
        return forward
    m, n, w, s = tile
    plain = replace(forward.unspecialised(), BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s, fallback=None)
    return replace(forward, fallback=plain) if forward.ws else plain


def unaligned(head_dim: int, head_dim_v: int) -> bool:
    """Whether a contiguous tensor's row stride (the head dim) is not a multiple of 16 elements."""
    return head_dim % 16 != 0 or head_dim_v % 16 != 0


def narrow_row(key: tuple[str, str, int], forward: Any, dkdv: Any, dq: Any, v39: bool) -> tuple[Any, Any, Any]:
    """A plain row's ``(forward, backward_dkdv, backward_dq)`` with :data:`UNALIGNED_TILES`' entries for ``key``
    (and, with triton >= 3.9, ``v39``, :data:`UNALIGNED_TILES_39`'s)."""
    tiles = {**UNALIGNED_TILES.get(key, {}), **(UNALIGNED_TILES_39.get(key, {}) if v39 else {})}
    return (
        narrow(forward, tiles.get("forward")),
        narrow(dkdv, tiles.get("backward_dkdv")),
        narrow(dq, tiles.get("backward_dq")),
    )


def narrow(c: Any, tile: Tile | None) -> Any:
    """A ``configs.KernelConfig`` (or None) with its pointer tile (its ``fallback`` where it has one)
    replaced by ``tile``; ``c`` itself where ``tile`` is None."""
    if c is None or tile is None:
        return c
    m, n, w, s = tile
    if c.fallback is not None:
        return replace(c, fallback=replace(c.fallback, BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s))
    return replace(c, BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
