"""The user's functions inside the kernels: FlexAttention's ``score_mod`` and ``mask_mod``, compiled to
``@triton.jit`` functions by :mod:`flashattn_teach.triton.usermod` and passed to the kernels as
``tl.constexpr`` arguments (``SCORE_MOD``, ``SCORE_GRAD``, ``MASK_MOD``; None when unset, and the kernel
then compiles to the code it had without them), and the tile kinds of a block mask.

Order (the design of issue 24, the CPU reference's): scale, softcap, ALiBi, additive mask, ``score_mod``,
then the masks. Scores are in log2 units inside the kernels, the user's function in natural ones:

    s = score_mod(LN2 * s2, b, h, q_idx, kv_idx),   then exp2(LOG2E * s - m2)   (d s / d (LN2 s2) = score_mod')

and without built-in modifiers ``score_mod(scale * q.k, ...)`` directly: ``LOG2E`` then rides in the
exponent's FFMA as ``qk_scale`` does in the plain kernel, so a softcap written as a score_mod costs what
its own arithmetic costs (docs: the loop profile's ``--score-mod`` rows).

``b`` is the flat batch index and ``h`` the query head (int32 scalars), ``q_idx`` and ``kv_idx`` the
absolute query and key positions as broadcast index tensors, ``C0..C3`` the captured tensors' pointers
(the kernels hold them as a tuple of four in :class:`flashattn_teach.triton.kernels.records.UserMods`).
The backward kernels work on transposed tiles (keys along rows) and pass ``q_idx (1, BLOCK_M)``, ``kv_idx
(BLOCK_N, 1)``: the generated functions are elementwise with broadcasting, so the result is the transpose.

A block mask's kinds, one int8 per (query tile, key tile) of the launch's ``BLOCK_M x BLOCK_N``
(``TILE_KINDS (B|1, H|1, T_r, T_c)``, stride 0 along broadcast dims; :data:`KIND_SKIP` and the others are
:mod:`flashattn_teach.flex.mods`' codes): a SKIP tile is not computed (its K, V are not even loaded), a
FULL tile runs without ``mask_mod``, a PARTIAL one with it (every tile is PARTIAL without a block mask).
The loops walk a list of the tiles to visit (``LISTED``, :func:`flashattn_teach.triton.variants.tile_list`,
FlexAttention's ``kv_indices``) as one masked stage: no branch in the loop, so its loads stay pipelined.
Only the dK/dV loop of a query-head group whose heads have different kinds branches on each tile's kind.
"""

from __future__ import annotations

import triton
from triton import language as tl

KIND_SKIP = tl.constexpr(0)  # flashattn_teach.flex.mods.KIND_SKIP, KIND_PARTIAL, KIND_FULL
KIND_PARTIAL = tl.constexpr(1)
KIND_FULL = tl.constexpr(2)


@triton.jit
def _score_mod(s, b, h, q_idx, kv_idx, captures, SCORE_MOD: tl.constexpr):
    """``score_mod(s, ...)`` on natural-unit scores ``s`` (fp32), with its four captured tensors'
    pointers ``captures`` (None in unused slots); the result, in natural units, may be -inf (the kernels'
    arithmetic is guarded for it)."""
    return SCORE_MOD(s, b, h, q_idx, kv_idx, captures[0], captures[1], captures[2], captures[3]).to(tl.float32)


@triton.jit
def _mask_mod_visible(visible, kind, b, h, q_idx, kv_idx, captures, MASK_MOD: tl.constexpr):
    """``visible & (kind == FULL or mask_mod(b, h, q_idx, kv_idx))``: a FULL tile takes the built-in masks
    alone; ``kind`` is :data:`KIND_PARTIAL` (a constant) without a block mask."""
    user = MASK_MOD(b, h, q_idx, kv_idx, captures[0], captures[1], captures[2], captures[3]) != 0
    return visible & (user | (kind == KIND_FULL))
