"""User functions inside the tiles: ``score_mod``, ``mask_mod`` and the block mask, as every CPU path runs them.

FlexAttention's two functions (torch.nn.attention.flex_attention), with this library's place for them in
the score (:mod:`flashattn_teach.masks`)::

    S_ij = score_mod(S_ij, b, h, q_idx, kv_idx)        after the scale, the softcap and the built-in biases
    S_ij = -inf  unless  visible(b, h, q_idx, kv_idx)  with the other masks

    visible = the element's block is FULL, or it is PARTIAL and mask_mod(b, h, q_idx, kv_idx)

Blocks are the block mask's (:class:`flashattn_teach.flex.BlockMask`): a SKIP block is invisible whatever
``mask_mod`` says, so a mask built by hand (``BlockMask.from_kv_blocks``) means what it says, as in torch.

The functions are called as torch calls them, per element (:mod:`.per_element`): inside the function
``b``, ``h`` (the query head), ``q_idx``, ``kv_idx`` and ``score`` are 0-d tensors, and nested ``torch.vmap``
levels batch it over a tile's index vectors, one tensor operation per tile. The tiles hand over their
indices in the *flat* layout (``B`` the flat batch index over the call's batch dims)::

    b       (B, 1, 1, 1)  int64        or shape () for one (b, h): then a vector of length 1 is mapped
    h       (1, H_q, 1, 1)  int64      or shape ()
    q_idx   (Br, 1)  int64             absolute query rows of the tile
    kv_idx  (1, Bc)  int64             absolute key columns

and get back ``(B, H_q, Br, Bc)`` (``mask_mod``'s with size 1 along ``b`` or ``h`` where it does not read
them). So ``bias[b][q_idx]``, ``bias[q_idx][kv_idx]``, ``doc[b][q_idx] == doc[b][kv_idx]`` and
``torch.dot(q_rope[b, h, q_idx], k_rope[b, h // G, kv_idx])`` mean the same at every size and on every
path, tiles of every head at once or of one head. Nothing of size ``N_q x N_k`` is made unless a tile is
that big (the dense oracle's one tile).

Gradients: the backward differentiates through ``score_mod`` tile by tile (``dS_in = dS_out * d
score_mod / dS``, by autograd on the tile) and collects the gradients of the captured tensors that require
grad (:mod:`.captures`), scalar and repeated indexing included, since autograd's indexing backward adds
repeated indices up.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ..errors import AttentionTypeError, AttentionValueError
from .captures import captured_tensors
from .per_element import probe_args
from .per_element import scores as per_element_scores
from .per_element import visible as per_element_visible

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

# The int8 codes of every tile-kind table (block masks, the kernels' tile kinds).
KIND_SKIP, KIND_PARTIAL, KIND_FULL = 0, 1, 2


class BlockMask(Protocol):
    """What the tiles read of a block mask (:class:`flashattn_teach.flex.block_mask.BlockMask` is the one
    implementation; this module does not import it, so the two never import each other)."""

    seq_lengths: tuple[int, int]
    BLOCK_SIZE: tuple[int, int]
    block_kinds: Tensor  # int8 (B|1, H|1, nQ, nKV), KIND_* codes
    mask_mod: Any

    @property
    def shape(self) -> tuple[int, ...]: ...  # (B, H, Q_LEN, KV_LEN) it was built for

    def tile_kinds(self, block_m: int, block_n: int) -> Tensor: ...


@dataclass(frozen=True)
class TileIndex:
    """``b, h, q_idx, kv_idx`` of one tile, broadcast against its scores in the flat layout."""

    b: Tensor
    h: Tensor
    q_idx: Tensor
    kv_idx: Tensor

    @staticmethod
    def flat(B: int, H: int, rows: tuple[int, int], cols: tuple[int, int], device: torch.device) -> TileIndex:
        """Every batch element and query head at once: ``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``."""
        return TileIndex(
            b=torch.arange(B, device=device).view(B, 1, 1, 1),
            h=torch.arange(H, device=device).view(1, H, 1, 1),
            q_idx=torch.arange(*rows, device=device)[:, None],  # (Br, 1)
            kv_idx=torch.arange(*cols, device=device)[None, :],  # (1, Bc)
        )

    def vectors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``b (B,)``, ``h (H,)``, ``q_idx (Br,)``, ``kv_idx (Bc,)``: the vectors the per-element call maps over
        (length 1 for the ``b`` and ``h`` of one head)."""
        return self.b.reshape(-1), self.h.reshape(-1), self.q_idx.reshape(-1), self.kv_idx.reshape(-1)

    @property
    def one_head(self) -> bool:
        """Whether the tile is of one ``(b, h)`` (scores ``(Br, Bc)``), not of every head (flat layout)."""
        return self.b.dim() == 0

    @staticmethod
    def head(b: int, h: int, rows: tuple[int, int], cols: tuple[int, int], device: torch.device) -> TileIndex:
        """One batch element ``b`` and query head ``h``: both of shape ``()``."""
        return TileIndex(
            b=torch.tensor(b, device=device),
            h=torch.tensor(h, device=device),
            q_idx=torch.arange(*rows, device=device)[:, None],
            kv_idx=torch.arange(*cols, device=device)[None, :],
        )


@dataclass(frozen=True)
class UserMods:
    """A call's user functions: ``score_mod``, ``mask_mod`` (None when unset), the block mask that decides
    which tiles ``mask_mod`` runs on (``create_block_mask``'s when only ``mask_mod`` was given), and the
    tensors each function captures (:func:`~.captures.captured_tensors`)."""

    score_mod: ScoreMod | None
    mask_mod: MaskMod | None
    block_mask: BlockMask | None
    captures: tuple[Tensor, ...] = ()
    mask_captures: tuple[Tensor, ...] = ()

    versions: tuple[int, ...] = ()  # each capture's version counter when the call was checked

    @staticmethod
    def build(
        score_mod: object, mask_mod: object, block_mask: BlockMask | None, device: torch.device, dtype: torch.dtype
    ) -> UserMods | None:
        """The checked functions (None when neither is set); ``mask_mod`` is the block mask's own when a
        block mask is given. Their captured tensors are found by a probe on a 1 x 1 tile of ``device``
        (scores in ``dtype``) and by a walk (:func:`~.captures.captured_tensors`)."""
        for name, fn, arity in (("score_mod", score_mod, 5), ("mask_mod", mask_mod, 4)):
            _check_function(name, fn, arity)
        if score_mod is None and mask_mod is None and block_mask is None:
            return None
        if block_mask is not None:
            mask_mod = block_mask.mask_mod
        score, *at = probe_args(dtype, device)
        captures = () if score_mod is None else captured_tensors(score_mod, (score, *at))  # type: ignore[arg-type]
        return UserMods(
            score_mod=score_mod,  # type: ignore[arg-type]  # callable, checked above
            mask_mod=mask_mod,  # type: ignore[arg-type]
            block_mask=block_mask,
            captures=captures,
            mask_captures=() if mask_mod is None else captured_tensors(mask_mod, tuple(at)),  # type: ignore[arg-type]
            versions=tuple(t._version for t in captures),
        )

    def check_unchanged(self, device: torch.device, dtype: torch.dtype) -> None:
        """Before a backward that calls ``score_mod`` again: it must read the tensors the forward's call read,
        unmodified, or the gradients would be of another function (autograd refuses a changed input too)."""
        if self.score_mod is None:
            return
        now = UserMods.build(self.score_mod, None, None, device, dtype)
        assert now is not None
        before = {id(t) for t in self.captures}
        changed = [t._version != v for t, v in zip(self.captures, self.versions, strict=True)]
        if any(id(t) not in before for t in now.captures) or any(changed):
            raise AttentionValueError(
                "score_mod reads other tensors in the backward than in the forward (a variable it closes over "
                "was rebound, or a captured tensor was modified in place since the call); the tiled backward "
                "calls score_mod again, so keep what it reads unchanged until backward, or give each call its "
                "own function (for instance functools.partial(score_mod, bias=bias))"
            )

    @property
    def names(self) -> tuple[str, ...]:
        """The variants these functions make, by argument name (:attr:`flashattn_teach.masks.MaskSpec.variants`)."""
        named = {
            "score_mod": self.score_mod is not None,
            "mask_mod": self.mask_mod is not None or self.block_mask is not None,
        }
        return tuple(name for name, used in named.items() if used)

    @property
    def grad_captures(self) -> tuple[Tensor, ...]:
        """The captured tensors of ``score_mod`` whose gradients the backward computes."""
        return tuple(t for t in self.captures if t.requires_grad)

    # -------------------------------------------------------------------------------------- score_mod

    def score(self, S: Tensor, index: TileIndex) -> Tensor:
        """``score_mod(S, b, h, q_idx, kv_idx)`` of a flat-layout tile ``S`` (``(B, H_q, Br, Bc)``, or
        ``(Br, Bc)`` for one head), called per element (:func:`.per_element.scores`), in ``S``'s shape and
        dtype."""
        assert self.score_mod is not None
        S4 = S.reshape(1, 1, *S.shape) if index.one_head else S  # (B, H_q, Br, Bc)
        out = per_element_scores(self.score_mod, S4, *index.vectors())
        # a fresh tensor of S's shape: the loops mask it in place
        return out.reshape(S.shape).to(S.dtype).contiguous()

    # ------------------------------------------------------------------------ mask_mod and the blocks

    def visible(self, index: TileIndex, shape: Sequence[int]) -> Tensor:
        """Bool, broadcastable to the flat-layout tile ``shape``: the block mask's element visibility,
        ``FULL or (PARTIAL and mask_mod)``, at the tile's indices."""
        keep = self._mask(index, shape) if self.mask_mod is not None else None
        if self.block_mask is None:
            assert keep is not None
            return keep
        kinds = self._element_kinds(index)  # (B|1, H|1, Br, Bc), or (Br, Bc) for one head
        full = kinds == KIND_FULL
        partial = kinds == KIND_PARTIAL
        return full | partial if keep is None else full | (partial & keep)

    def _mask(self, index: TileIndex, shape: Sequence[int]) -> Tensor:
        assert self.mask_mod is not None
        out = per_element_visible(self.mask_mod, *index.vectors())  # (B|1, H|1, Br, Bc)
        return out.reshape(shape[-2:]) if index.one_head else out

    def _element_kinds(self, index: TileIndex) -> Tensor:
        """The block kind of every element of the tile, gathered from the block mask's table."""
        bm = self.block_mask
        assert bm is not None
        kinds = bm.block_kinds.to(index.q_idx.device)  # (B|1, H|1, nQ, nKV)
        bs_q, bs_kv = bm.BLOCK_SIZE
        rows, cols = index.q_idx // bs_q, index.kv_idx // bs_kv  # (Br, 1), (1, Bc)
        if index.b.dim() == 0:  # one head
            b = index.b if kinds.shape[0] > 1 else 0
            h = index.h if kinds.shape[1] > 1 else 0
            return kinds[b, h][rows, cols]  # (Br, Bc)
        return kinds[:, :, rows, cols]  # (B|1, H|1, Br, Bc)

    # ---------------------------------------------------------------------------- checks of the call

    def check(self, B: int, H: int, N_q: int, N_k: int) -> None:
        """The block mask fits the call: ``seq_lengths == (N_q, N_k)`` and its batch and head dims are 1
        or the call's flat batch ``B`` and query heads ``H``."""
        bm = self.block_mask
        if bm is None:
            return
        if tuple(bm.seq_lengths) != (N_q, N_k):
            raise AttentionValueError(
                f"block_mask was created for (Q_LEN, KV_LEN) = {tuple(bm.seq_lengths)}, but the call has "
                f"N_q = {N_q} queries and N_k = {N_k} keys; build it with create_block_mask(mask_mod, B, H, "
                f"{N_q}, {N_k})"
            )
        # the (B, H) it was built for (its kinds may hold size 1 where mask_mod ignores b or h): 1 or the call's
        Bm, Hm = (*(1,) * (4 - len(bm.shape)), *bm.shape)[:2]
        if Bm not in (1, B) or Hm not in (1, H):
            raise AttentionValueError(
                f"block_mask has (B, H) = ({Bm}, {Hm}), which does not broadcast to the call's batch {B} and "
                f"{H} query heads; build it with B in (None, 1, {B}) and H in (None, 1, {H})"
            )


def positional_arity(fn: Callable[..., object]) -> int | None:
    """How many positional parameters without defaults ``fn`` takes (None: it takes ``*args`` or cannot
    be inspected)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: give it the benefit of the doubt
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _check_function(name: str, fn: object, arity: int) -> None:
    if fn is None:
        return
    if not callable(fn):
        raise AttentionTypeError(f"{name} must be a function or None, got {type(fn).__name__}")
    got = positional_arity(fn)
    if got is not None and got != arity:
        args = "(score, b, h, q_idx, kv_idx)" if arity == 5 else "(b, h, q_idx, kv_idx)"
        other = "mask_mod" if arity == 5 else "score_mod"
        hint = f" (a function of {got} arguments is a {other}: pass it as {other}=)" if got == 9 - arity else ""
        raise AttentionTypeError(f"{name} takes {got} positional arguments; a {name} takes {arity}, {args}{hint}")


def check_block_mask(block_mask: object) -> BlockMask | None:
    """``block_mask`` as a block mask, or None; anything else raises, naming it."""
    if block_mask is None:
        return None
    if not all(hasattr(block_mask, name) for name in ("block_kinds", "BLOCK_SIZE", "seq_lengths", "tile_kinds")):
        raise AttentionTypeError(
            f"block_mask must be a flashattn_teach BlockMask, got {type(block_mask).__module__}."
            f"{type(block_mask).__name__}; build it with flashattn_teach.create_block_mask"
        )
    return block_mask  # type: ignore[return-value]  # it has the protocol's attributes


def to_flat(t: Tensor) -> Tensor:
    """A tile broadcastable to the flat layout, with its leading dims made explicit: ``(B|1, H|1, Br, Bc)``."""
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t


class CaptureGrads:
    """The gradients of ``score_mod``'s captured tensors, summed over the tiles of a backward (thread-safe:
    the parallel path's workers add into it)."""

    def __init__(self, captures: Sequence[Tensor]) -> None:
        self.captures = tuple(captures)
        self.grads: list[Tensor | None] = [None] * len(self.captures)
        self._lock = threading.Lock()

    def add(self, grads: Sequence[Tensor | None]) -> None:
        with self._lock:
            for n, g in enumerate(grads):
                if g is not None:
                    before = self.grads[n]
                    self.grads[n] = g if before is None else before + g

    def values(self) -> tuple[Tensor | None, ...]:
        """Each capture's gradient, None for one the function did not differentiate through (as autograd
        leaves a parameter it never reached)."""
        return tuple(None if g is None else g.to(t.dtype) for t, g in zip(self.captures, self.grads, strict=True))

    def part(self) -> CaptureGrads:
        """An empty sum for one task of a parallel backward; :meth:`merge` adds the parts in a fixed order,
        so the result does not depend on which worker finished first."""
        return CaptureGrads(self.captures)

    def merge(self, parts: Sequence[CaptureGrads]) -> None:
        for part in parts:
            self.add(part.grads)


def score_backward(
    mods: UserMods, S_in: Tensor, index: TileIndex, grads: CaptureGrads | None
) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """``(S_out, vjp)``: ``score_mod`` of the tile ``S_in`` (flat layout), and ``dS_out -> dS_in``, which also
    adds the captured tensors' gradients to ``grads``. With grad mode on (a double backward) the result
    stays differentiable."""
    create_graph = torch.is_grad_enabled()
    wanted = grads.captures if grads is not None else ()
    with torch.enable_grad():
        S_leaf = S_in if S_in.requires_grad else S_in.detach().requires_grad_()
        # a copy for the user's function, which may work in place (score.mul_(2)) as it may in the forward
        S_out = mods.score(S_leaf.clone(), index)

    def vjp(dS_out: Tensor) -> Tensor:
        inputs: tuple[Any, ...] = (S_leaf, *wanted)
        got = torch.autograd.grad(S_out, inputs, dS_out, allow_unused=True, create_graph=create_graph)
        if grads is not None:
            grads.add(got[1:])
        dS_in = got[0]
        return torch.zeros_like(S_in) if dS_in is None else dS_in

    # A copy the caller may mask in place without touching what autograd saved (or S_in, for the identity).
    return (S_out.clone() if create_graph else S_out.detach().clone()), vjp
