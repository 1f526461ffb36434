"""What the kernels need of a call's mask contract (:class:`flashattn_teach.masks.MaskSpec`): the
constexpr flag of each variant and its runtime arguments, as the named records of :mod:`.records`.

:class:`KernelVariants` builds, by name, the kernels' :class:`~.records.Bounds` (the diagonal offset, the
window, ``seqlens_k``), :class:`~.records.ScoreTerms` (softcap, ALiBi, the user's mask),
:class:`~.records.Dropout`, :class:`~.records.Packed` (or None) and :class:`~.records.UserMods`; the
constexpr flags are ``WINDOW, SOFTCAP, ALIBI, SEQLENS, DROPOUT, BOOL_MASK, ADD_MASK, VARLEN`` (see
:mod:`.kernels.masking`, :mod:`.kernels.dropout` and :mod:`.varlen`), and ``SCORE_MOD, SCORE_GRAD,
MASK_MOD`` (the user's functions compiled by :mod:`flashattn_teach.triton.usermod`, or None) and ``KINDS``
(see :mod:`.kernels.usermods`), which :func:`flashattn_teach.triton.flags.kernel_flags` gathers into the
kernels' one flags record. A variant that is not set is None in its record, never read, so a call without
variants compiles to the plain kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ..dropout import DropoutKey
from ..errors import AttentionValueError
from ..masks.spec import MaskSpec
from .kernels.records import Bounds, Dropout, Packed, ScoreTerms, UserMods, score_terms

# A window side that never binds: beyond any |i + off - j| while sequences fit in 2^29 rows, and small
# enough that the kernels' range arithmetic (:mod:`.masking`) stays inside int32.
UNBOUNDED = 2**30

# The variants of the mask contract the kernels honour, by MaskSpec.variants' names (score_mod and
# mask_mod with the exceptions of support.mods_unsupported_reason)
SUPPORTED = ("window", "softcap", "alibi_slopes", "seqlens_k", "attn_mask", "score_mod", "mask_mod")
NO_DROPOUT = DropoutKey()
# score_mod's and mask_mod's captured tensors the kernels take (C0..C3, MC0..MC3): usermod.MAX_CAPTURES
CAPTURE_SLOTS = 4
KIND_SKIP = 0  # flashattn_teach.flex.mods.KIND_SKIP


class CompiledScoreMod(Protocol):
    """What the kernels read of :class:`flashattn_teach.triton.usermod.CompiledScoreMod`."""

    @property
    def jit(self) -> Any: ...  # @triton.jit (score, b, h, q_idx, kv_idx, C0, C1, C2, C3) -> score
    @property
    def grad(self) -> Any: ...  # d score_mod / d score, same signature; None when it is 1
    @property
    def captures(self) -> tuple[Tensor, ...]: ...


class CompiledMaskMod(Protocol):
    """What the kernels read of :class:`flashattn_teach.triton.usermod.CompiledMaskMod`."""

    @property
    def jit(self) -> Any: ...  # @triton.jit (b, h, q_idx, kv_idx, C0, C1, C2, C3) -> bool
    @property
    def captures(self) -> tuple[Tensor, ...]: ...


class TileKinds(Protocol):
    """What the kernels read of :class:`flashattn_teach.flex.block_mask.BlockMask`."""

    def tile_kinds(self, block_m: int, block_n: int) -> Tensor: ...  # int8 (B|1, H|1, T_r, T_c)


@dataclass(frozen=True)
class KernelVariants:
    """The kernels' view of one call's variants. ``left, right``: the window with causal folded in and
    :data:`UNBOUNDED` for an open side; ``alibi_slopes (1 or B, H_q)`` and ``seqlens_k (B,)`` on
    the query's device, in the dtypes the kernels read (float32, int32); ``dropout``: the key of
    :mod:`flashattn_teach.dropout` (``p = 0``: none), the same in the forward and the backward;
    ``attn_mask (B, H_q, N_q, N_k)``: the user's mask as a view with stride 0 along broadcast dims (a
    bool mask viewed as uint8), copied only when several batch dims broadcast unevenly; ``cu_seqlens_q,
    cu_seqlens_k (B + 1,)`` int32 and ``max_seqlen_q, max_seqlen_k``: packed sequences (``VARLEN``, set by
    :mod:`.varlen`), whose batch index is the sequence. ``score_mod``, ``mask_mod``: the user's functions,
    compiled (their captured tensors on the query's device); ``block_mask``: whatever gives the kinds of
    each tile at a launch's tiles (``tile_kinds(BLOCK_M, BLOCK_N)``), a FlexAttention block mask."""

    window: bool = False
    left: int = UNBOUNDED
    right: int = UNBOUNDED
    softcap: float | None = None
    alibi_slopes: Tensor | None = None
    seqlens_k: Tensor | None = None
    dropout: DropoutKey = NO_DROPOUT
    attn_mask: Tensor | None = None
    cu_seqlens_q: Tensor | None = None
    cu_seqlens_k: Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    score_mod: CompiledScoreMod | None = None
    mask_mod: CompiledMaskMod | None = None
    block_mask: TileKinds | None = None

    @staticmethod
    def from_spec(spec: MaskSpec, dropout: DropoutKey = NO_DROPOUT) -> KernelVariants:
        """The variants of ``spec`` (those of :data:`SUPPORTED`; the caller refuses the others)."""
        slopes = spec.alibi_slopes
        if slopes is not None:
            slopes = slopes.detach().reshape(-1, spec.shapes.H_q).to(torch.float32)  # (1 or B, H_q)
        lengths = spec.seqlens_k
        if lengths is not None:
            lengths = lengths.reshape(-1).to(torch.int32)  # (B,)
        mask = spec.attn_mask
        if mask is not None:
            s = spec.shapes
            # (*batch, H_q, N_q, N_k) with stride 0 where the user's mask broadcasts -> (B, H_q, N_q, N_k)
            mask = mask.detach().expand(s.score_shape).reshape(math.prod(s.batch), s.H_q, s.N_q, s.N_k)
            if mask.dtype == torch.bool:
                mask = mask.view(torch.uint8)  # same bytes; the kernels test != 0
        score_mod, mask_mod, block_mask = _compiled_mods(spec)
        window = "window" in spec.variants
        return KernelVariants(
            window=window,
            left=spec.left if window and spec.left >= 0 else UNBOUNDED,
            right=spec.right if window and spec.right >= 0 else UNBOUNDED,
            softcap=spec.softcap,
            alibi_slopes=slopes,
            seqlens_k=lengths,
            dropout=dropout,
            attn_mask=mask,
            score_mod=score_mod,
            mask_mod=mask_mod,
            block_mask=block_mask,
        )

    @property
    def used(self) -> bool:
        """Whether any variant is set (the call then gets the variant rows of the configuration table)."""
        return (
            self.window
            or self.modifies_scores
            or self.has_seqlens
            or self.has_dropout
            or self.bool_mask
            or self.varlen
            or self.user_mods
        )

    @property
    def modifies_scores(self) -> bool:
        """Softcap, ALiBi, an additive mask or a score_mod: the scale must reach the scores before them (no
        scale inside the exponent)."""
        return self.softcap is not None or self.alibi_slopes is not None or self.additive_mask or self.has_score_mod

    def bounds(self, offset: int) -> Bounds:
        """The kernels' :class:`~.records.Bounds`: ``offset`` (the launcher's ``OFFSET``), the window, the lengths."""
        return Bounds(OFFSET=offset, LEFT=self.left, RIGHT=self.right, SEQLENS_K=self.seqlens_k)

    def score_terms(self) -> ScoreTerms:
        """The kernels' :class:`~.records.ScoreTerms`: softcap in log2 units (1.0 unset), ALiBi, the attn_mask."""
        return score_terms(self.softcap, self.alibi_slopes, self.attn_mask)

    def dropout_args(self) -> Dropout:
        """The kernels' :class:`~.records.Dropout` (read only under ``DROPOUT``)."""
        key = self.dropout
        return Dropout(seed=key.seed, offset=key.offset, threshold=key.threshold, keep_scale=key.keep_scale)

    def packed(self) -> Packed | None:
        """The kernels' :class:`~.records.Packed`, or None without packed sequences."""
        if self.cu_seqlens_q is None or self.cu_seqlens_k is None:
            return None
        return Packed(self.cu_seqlens_q, self.cu_seqlens_k)

    def mods_record(
        self,
        device: torch.device,
        block_m: int,
        block_n: int,
        N_q: int,
        N_k: int,
        *,
        listed: bool,
        columns: bool = False,
    ) -> UserMods:
        """The kernels' :class:`~.records.UserMods`: the captured tensors of score_mod and of mask_mod (None in
        unused slots), the tile kinds at a launch's ``block_m x block_n`` tiles (strides 0 along broadcast
        dims) and with ``listed`` :func:`tile_list` of them: each query tile's key tiles, or with ``columns``
        each key tile's query tiles (the dK/dV kernel, whose programs own a key block). The kinds table must
        cover the launch's ``cdiv(N_q, block_m) x cdiv(N_k, block_n)`` tiles."""
        score = () if self.score_mod is None else tuple(self.score_mod.captures)
        mask = () if self.mask_mod is None else tuple(self.mask_mod.captures)
        for name, captures in (("score_mod", score), ("mask_mod", mask)):
            if len(captures) > CAPTURE_SLOTS:
                raise AttentionValueError(
                    f"{name} captures {len(captures)} tensors and the kernels take {CAPTURE_SLOTS}: run the call "
                    "on a CPU path (backend='query_major'), or fold captured tensors into fewer (torch.stack)"
                )
        kinds = self.tile_kinds(block_m, block_n)
        table: tuple[Any, ...] = (None,) * 5  # kinds and its strides
        tiles: tuple[Any, ...] = (None,) * 4  # the tile list and its strides
        if kinds is not None:
            need = (-(-N_q // block_m), -(-N_k // block_n))
            if kinds.dim() != 4 or kinds.dtype != torch.int8 or tuple(kinds.shape[2:]) < need:
                raise AttentionValueError(
                    f"block_mask's tile kinds at {block_m} x {block_n} tiles are {kinds.dtype} {tuple(kinds.shape)}, "
                    f"but N_q={N_q}, N_k={N_k} need int8 (B|1, H|1, {need[0]}, {need[1]}): build the block mask "
                    "for these lengths (create_block_mask(mask_mod, B, H, N_q, N_k))"
                )
            kinds = kinds.to(device)  # O(tiles) bytes; a no-op where the block mask was built
            stride_b, stride_h, stride_m, stride_n = kinds.stride()
            b, h = (0 if kinds.shape[0] == 1 else stride_b), (0 if kinds.shape[1] == 1 else stride_h)
            table = (kinds, b, h, stride_m, stride_n)
            if listed:
                t = tile_list(kinds.transpose(-1, -2) if columns else kinds)
                b, h = (0 if t.shape[0] == 1 else t.stride(0)), (0 if t.shape[1] == 1 else t.stride(1))
                tiles = (t, b, h, t.stride(2))
        slots: tuple[Tensor | None, ...] = (None,) * CAPTURE_SLOTS
        return UserMods((score + slots)[:CAPTURE_SLOTS], (mask + slots)[:CAPTURE_SLOTS], *table, *tiles)

    def tile_kinds(self, block_m: int, block_n: int) -> Tensor | None:
        """The block mask's kinds at ``block_m x block_n`` tiles, int8 ``(B|1, H|1, T_r, T_c)``, or None."""
        if self.block_mask is None:
            return None
        return self.block_mask.tile_kinds(block_m, block_n)

    @property
    def score_mod_fn(self) -> Any:
        """``SCORE_MOD``: the compiled score_mod, or None."""
        return None if self.score_mod is None else self.score_mod.jit

    @property
    def score_grad_fn(self) -> Any:
        """``SCORE_GRAD``: its derivative by the score, or None (none, or a derivative of 1)."""
        return None if self.score_mod is None else self.score_mod.grad

    @property
    def mask_mod_fn(self) -> Any:
        """``MASK_MOD``: the compiled mask_mod, or None."""
        return None if self.mask_mod is None else self.mask_mod.jit

    @property
    def has_score_mod(self) -> bool:
        return self.score_mod is not None

    @property
    def has_kinds(self) -> bool:
        return self.block_mask is not None

    @property
    def user_mods(self) -> bool:
        """Whether a score_mod, a mask_mod or a block mask is set (the user's functions in the kernels)."""
        return self.score_mod is not None or self.mask_mod is not None or self.block_mask is not None

    @property
    def has_softcap(self) -> bool:
        return self.softcap is not None

    @property
    def has_alibi(self) -> bool:
        return self.alibi_slopes is not None

    @property
    def has_seqlens(self) -> bool:
        return self.seqlens_k is not None

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def batch(self, B: int) -> int:
        """The grid's batch extent: the number of packed sequences, or ``B``."""
        return B if self.cu_seqlens_q is None else self.cu_seqlens_q.shape[0] - 1

    @property
    def bool_mask(self) -> bool:
        return self.attn_mask is not None and self.attn_mask.dtype == torch.uint8

    @property
    def additive_mask(self) -> bool:
        return self.attn_mask is not None and self.attn_mask.dtype != torch.uint8

    @property
    def has_dropout(self) -> bool:
        return self.dropout.p > 0.0


PLAIN = KernelVariants()


def tile_list(kinds: Tensor) -> Tensor:
    """Each query tile's key tiles that are not SKIP, in order: int32 ``(B|1, H|1, T_r, 1 + T_c)`` whose entry
    0 is their number ``n`` and entries ``1..n`` are ``(j << 2) | kind`` (``kinds`` int8 ``(B|1, H|1, T_r,
    T_c)``). The forward and dQ kernels loop over it, as FlexAttention's over its ``kv_indices``: a SKIP tile
    takes no iteration and no branch sits in the loop, whose loads stay pipelined. O(tiles) work."""
    visited = kinds != KIND_SKIP
    # stable: the visited tiles first, in key order
    order = torch.argsort((~visited).to(torch.int8), dim=-1, stable=True)
    codes = (order.to(torch.int32) << 2) | kinds.gather(-1, order).to(torch.int32)
    count = visited.sum(-1, keepdim=True, dtype=torch.int32)
    return torch.cat([count, codes], dim=-1).contiguous()


def _compiled_mods(spec: MaskSpec) -> tuple[CompiledScoreMod | None, CompiledMaskMod | None, TileKinds | None]:
    """``spec.mods``' functions compiled by :mod:`flashattn_teach.triton.usermod` (which imports triton) and
    its block mask; Nones without them. The caller has refused what cannot be compiled
    (:func:`flashattn_teach.triton.support.mods_unsupported_reason`)."""
    mods = spec.mods
    if mods is None:
        return None, None, None
    from .usermod import compile_mask_mod, compile_score_mod

    score = None if mods.score_mod is None else compile_score_mod(mods.score_mod, tuple(mods.captures))
    mask = None if mods.mask_mod is None else compile_mask_mod(mods.mask_mod, tuple(mods.mask_captures))
    return score, mask, mods.block_mask
