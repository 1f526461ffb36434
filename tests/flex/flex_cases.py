"""FlexAttention's test functions and the common masks and score_mods, written here from their definitions,
and the float64 dense oracle that every test in ``tests/flex`` checks against.

A case is a builder ``(dims, params) -> Mods``: the functions of one call and the captured tensors that require
grad. Builders draw their captured tensors from :class:`Params`, so the same seed gives the same values in every
dtype: a float32 run and its float64 oracle read the same (float32-rounded) biases.

The functions are plain Python of torch tensors with FlexAttention's signatures,
``score_mod(score, b, h, q_idx, kv_idx) -> score`` and ``mask_mod(b, h, q_idx, kv_idx) -> bool``, as a user
writes them for ``torch.nn.attention.flex_attention``; they only broadcast and index, so the same function runs
on a tile's index grids and on the oracle's full ones. ``h`` is the query head.

The oracle shares no code with ``flashattn_teach``: full index grids ``b (B,1,1,1)``, ``h (1,H,1,1)``,
``q_idx (1,1,N_q,1)``, ``kv_idx (1,1,1,N_k)``, the whole ``(B, H, N_q, N_k)`` score matrix in float64, in the
documented order (scale, softcap, ALiBi, score_mod, masks), and torch.autograd for the gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

NEG_INF = float("-inf")

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Dims:
    """The sizes a case's captured tensors depend on; ``H`` counts query heads."""

    B: int
    H: int
    N_q: int
    N_k: int


@dataclass
class Mods:
    """One call's user functions and the captured tensors of ``score_mod`` that require grad, by name."""

    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    learned: dict[str, Tensor] = field(default_factory=dict)


class Params:
    """Captured tensors drawn in float64 from one seeded generator, rounded to ``rounded_to`` (default
    ``dtype``) and held in ``dtype``: ``Params(float64, rounded_to=float32)`` repeats ``Params(float32)``'s
    values exactly, for the float64 oracle of a float32 run."""

    def __init__(self, dtype: torch.dtype, *, rounded_to: torch.dtype | None = None, seed: int = 0) -> None:
        self.dtype = dtype
        self.rounded_to = rounded_to or dtype
        self.generator = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, requires_grad: bool = False, mean: float = 0.0, std: float = 1.0) -> Tensor:
        t = mean + std * torch.randn(shape, generator=self.generator, dtype=torch.float64)
        return t.to(self.rounded_to).to(self.dtype).requires_grad_(requires_grad)

    def document_ids(self, B: int, N: int, documents: int) -> Tensor:
        """``(B, N)`` int64 document of each position: sorted, a different split in every batch element."""
        cuts = torch.stack([torch.randperm(N - 1, generator=self.generator)[: documents - 1] + 1 for _ in range(B)])
        starts = torch.zeros(B, N, dtype=torch.int64)
        starts.scatter_(1, cuts, 1)
        return starts.cumsum(dim=1)  # (B, N): 0 up to the first cut, then 1, ...


Builder = Callable[[Dims, Params], Mods]

# -------------------------------------------------------------------- FlexAttention's score functions
# The functions of torch's FlexAttention test suite (test/inductor/test_flex_attention.py), by its names,
# written here from what each computes.


def identity(score, b, h, q_idx, kv_idx):
    return score


def causal_score(score, b, h, q_idx, kv_idx):
    """Causal masking written as a score_mod: -inf above the diagonal."""
    return torch.where(q_idx >= kv_idx, score, NEG_INF)


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx)


def relative_causal(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score + (q_idx - kv_idx), NEG_INF)


def times_two(score, b, h, q_idx, kv_idx):
    return score * 2


def squared(score, b, h, q_idx, kv_idx):
    return score * score


def trigonometric(score, b, h, q_idx, kv_idx):
    return torch.sin(torch.cos(score)) + torch.tan(b)


def trigonometric_product(score, b, h, q_idx, kv_idx):
    return torch.cos(score) * torch.sin(score) + torch.tan(b)


def _alibi_bias(d: Dims, p: Params) -> Mods:
    # ALiBi's geometric slopes 2^(-8 (h + 1) / H), in the call's dtype: the bias grows with the distance.
    slopes = torch.exp2(-8.0 * torch.arange(1, d.H + 1, dtype=torch.float64) / d.H).to(p.dtype)

    def alibi_bias(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return Mods(score_mod=alibi_bias)


def _head_offset(d: Dims, p: Params) -> Mods:
    offset = p.randn(d.H)

    def head_offset(score, b, h, q_idx, kv_idx):
        return score * offset[h]

    return Mods(score_mod=head_offset)


def _plain(fn: ScoreMod) -> Builder:
    return lambda d, p: Mods(score_mod=fn)


TORCH_SUITE: dict[str, Builder] = {
    "identity": _plain(identity),
    "causal": _plain(causal_score),
    "relative_bias": _plain(relative_bias),
    "relative_causal": _plain(relative_causal),
    "alibi_bias": _alibi_bias,
    "times_two": _plain(times_two),
    "squared": _plain(squared),
    "head_offset": _head_offset,
    "trigonometric": _plain(trigonometric),
    "trigonometric_product": _plain(trigonometric_product),
}

# ---------------------------------------------------------------------------------------- common masks


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


WINDOW = 37  # keys q - WINDOW < kv <= q
PREFIX = 29  # the prefix every query sees
DILATED_WINDOW, DILATION = 24, 3  # |q - kv| < 24 and q - kv a multiple of 3


def sliding_window_mask(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def prefix_lm_mask(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX) | (q_idx >= kv_idx)


def dilated_window_mask(b, h, q_idx, kv_idx):
    distance = q_idx - kv_idx
    return (distance.abs() < DILATED_WINDOW) & (distance % DILATION == 0)


def both(first: MaskMod, second: MaskMod) -> MaskMod:
    """The oracle's own intersection of two masks (``and_masks`` is under test)."""
    return lambda b, h, q_idx, kv_idx: first(b, h, q_idx, kv_idx) & second(b, h, q_idx, kv_idx)


def either(first: MaskMod, second: MaskMod) -> MaskMod:
    """The oracle's own union of two masks (``or_masks`` is under test)."""
    return lambda b, h, q_idx, kv_idx: first(b, h, q_idx, kv_idx) | second(b, h, q_idx, kv_idx)


def document_ids(d: Dims, p: Params, documents: int = 4) -> Tensor:
    """``(B, max(N_q, N_k))``: queries and keys at the same position belong to the same document."""
    return p.document_ids(d.B, max(d.N_q, d.N_k), documents)


def _document(d: Dims, p: Params) -> Mods:
    doc = document_ids(d, p)

    def document_mask(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    return Mods(mask_mod=document_mask)


def _causal_document(d: Dims, p: Params) -> Mods:
    return Mods(mask_mod=both(causal_mask, _document(d, p).mask_mod))


def _mask(fn: MaskMod) -> Builder:
    return lambda d, p: Mods(mask_mod=fn)


MASKS: dict[str, Builder] = {
    "causal": _mask(causal_mask),
    "sliding_window": _mask(sliding_window_mask),
    "prefix_lm": _mask(prefix_lm_mask),
    "document": _document,
    "causal_document": _causal_document,
    "dilated_window": _mask(dilated_window_mask),
}

# ------------------------------------------------------------------------- score_mods users write

SOFTCAP = 2.0  # small enough to bend scores of a few units


def tanh_softcap(score, b, h, q_idx, kv_idx):
    return SOFTCAP * torch.tanh(score / SOFTCAP)


HIDDEN_ROWS = 7


def hides_first_rows(score, b, h, q_idx, kv_idx):
    """-inf on every score of the first query rows: rows that see no key because of the score_mod alone."""
    return torch.where(q_idx >= HIDDEN_ROWS, score, NEG_INF)


def _head_bias(d: Dims, p: Params) -> Mods:
    """A learned bias per head: constant along a row, so only ``lse`` carries its gradient."""
    bias = p.randn(d.H, requires_grad=True)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    return Mods(score_mod=head_bias, learned={"bias": bias})


def _learned_alibi(d: Dims, p: Params) -> Mods:
    """A learned slope per head times the distance: ALiBi with trained slopes."""
    slope = p.randn(d.H, requires_grad=True, std=0.1)

    def learned_alibi(score, b, h, q_idx, kv_idx):
        return score + slope[h] * (kv_idx - q_idx)

    return Mods(score_mod=learned_alibi, learned={"slope": slope})


def _relative_table(d: Dims, p: Params) -> Mods:
    """A learned ``(H, N_q + N_k - 1)`` bias by relative position: every diagonal reads one entry, so the
    backward must add the gradients of all the scores that share it."""
    table = p.randn(d.H, d.N_q + d.N_k - 1, requires_grad=True, std=0.5)
    shift = d.N_k - 1  # q_idx - kv_idx ranges over [-(N_k - 1), N_q - 1]

    def relative_table(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + shift]

    return Mods(score_mod=relative_table, learned={"table": table})


def _temperature(d: Dims, p: Params) -> Mods:
    """One learned scalar, a shape-() tensor, dividing every score."""
    temperature = p.randn(requires_grad=True, mean=1.0, std=0.25)

    def scaled_by_temperature(score, b, h, q_idx, kv_idx):
        return score / temperature

    return Mods(score_mod=scaled_by_temperature, learned={"temperature": temperature})


def _key_bias(d: Dims, p: Params) -> Mods:
    """A learned ``(B, N_k)`` bias of each key, batch-dependent, read by every query row."""
    bias = p.randn(d.B, d.N_k, requires_grad=True)

    def key_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b, kv_idx]

    return Mods(score_mod=key_bias, learned={"bias": bias})


def _weighted_distance(score, b, h, q_idx, kv_idx, *, weight):
    return score - weight[h] * (q_idx - kv_idx).abs()


def _partial_capture(d: Dims, p: Params) -> Mods:
    """The learned tensor reaches the function through ``functools.partial``."""
    weight = p.randn(d.H, requires_grad=True, std=0.05)
    return Mods(score_mod=functools.partial(_weighted_distance, weight=weight), learned={"weight": weight})


class HeadGate(torch.nn.Module):
    """A module whose bound method is the score_mod: its parameter is the captured tensor."""

    def __init__(self, gate: Tensor) -> None:
        super().__init__()
        self.gate = torch.nn.Parameter(gate)

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score * torch.sigmoid(self.gate[h])


def _module_capture(d: Dims, p: Params) -> Mods:
    gate = HeadGate(p.randn(d.H))
    return Mods(score_mod=gate.score_mod, learned={"gate": gate.gate})


SCORE_MODS: dict[str, Builder] = {
    "tanh_softcap": _plain(tanh_softcap),
    "hides_first_rows": _plain(hides_first_rows),
    "head_bias": _head_bias,
    "learned_alibi": _learned_alibi,
    "relative_table": _relative_table,
    "temperature": _temperature,
    "key_bias": _key_bias,
    "partial_capture": _partial_capture,
    "module_capture": _module_capture,
}

# ----------------------------------------------------------------------------------------------- oracle


def oracle(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    visible: Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` in float64 over the whole score matrix, by the documented order.

    ``q (B, H_q, N_q, D)``, ``k (B, H_kv, N_k, D)``, ``v (B, H_kv, N_k, D_v)`` with ``H_kv`` dividing ``H_q``
    (query head h reads key head ``h // (H_q // H_kv)``); ``visible``: a bool mask broadcast to
    ``(B, H_q, N_q, N_k)`` (a block mask's blocks), applied with ``mask_mod``. A row that sees no key, or
    whose scores are all -inf after ``score_mod``, gives ``O = 0`` and ``lse = -inf``. Differentiable in
    q, k, v and in any tensor the functions capture.
    """
    q, k, v = q.double(), k.double(), v.double()
    B, H_q, N_q, D = q.shape
    N_k = k.shape[-2]
    k = k.repeat_interleave(H_q // k.shape[1], dim=1)  # (B, H_kv, N_k, D) -> (B, H_q, N_k, D)
    v = v.repeat_interleave(H_q // v.shape[1], dim=1)
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H_q).view(1, H_q, 1, 1)
    q_idx = torch.arange(N_q).view(1, 1, N_q, 1)
    kv_idx = torch.arange(N_k).view(1, 1, 1, N_k)
    S = (D**-0.5 if scale is None else scale) * (q @ k.transpose(-2, -1))  # (B, H_q, N_q, D) @ (.., D, N_k)
    if softcap is not None:
        S = softcap * torch.tanh(S / softcap)
    if alibi_slopes is not None:
        S = S - alibi_slopes.double().reshape(-1, H_q, 1, 1) * (q_idx - kv_idx).abs()
    if score_mod is not None:
        S = score_mod(S, b, h, q_idx, kv_idx).expand(B, H_q, N_q, N_k)
    seen = torch.ones(B, H_q, N_q, N_k, dtype=torch.bool)
    if causal:
        seen = seen & (q_idx >= kv_idx)
    if mask_mod is not None:
        seen = seen & mask_mod(b, h, q_idx, kv_idx)
    if visible is not None:
        seen = seen & visible
    S = S.masked_fill(~seen, NEG_INF)
    empty = torch.isneginf(S).all(dim=-1, keepdim=True)  # (B, H_q, N_q, 1): rows that see no key
    S = S.masked_fill(empty, 0.0)  # keeps softmax and its gradient finite on those rows
    P = torch.softmax(S, dim=-1).masked_fill(empty, 0.0)
    lse = torch.logsumexp(S, dim=-1).masked_fill(empty[..., 0], NEG_INF)
    return P @ v, lse  # (B, H_q, N_q, N_k) @ (B, H_q, N_k, D_v)


def block_visibility(
    kv_num_blocks: Tensor,
    kv_indices: Tensor,
    full_kv_num_blocks: Tensor | None,
    full_kv_indices: Tensor | None,
    block_size: tuple[int, int],
    N_q: int,
    N_k: int,
) -> tuple[Tensor, Tensor]:
    """``(partial, full)`` bool ``(B|1, H|1, N_q, N_k)``: the positions in a block mask's listed partial and
    full blocks, read from torch's documented layout (row ``i`` lists ``kv_num_blocks[..., i]`` key blocks
    in ``kv_indices[..., i, :]``). The oracle's visible set is ``full | (partial & mask_mod)``."""
    Bm, Hm, nQ = kv_num_blocks.shape

    def expand(num: Tensor | None, indices: Tensor | None) -> Tensor:
        if num is None or indices is None:
            return torch.zeros(Bm, Hm, N_q, N_k, dtype=torch.bool)
        n_kv = max(-(-N_k // block_size[1]), int(indices.max()) + 1)
        listed = (torch.arange(indices.shape[-1]) < num[..., None].long()).long()  # (Bm, Hm, nQ, slots)
        # unlisted slots hold arbitrary (possibly repeated) indices: count the listed ones, never overwrite
        grid = torch.zeros(Bm, Hm, nQ, n_kv, dtype=torch.long).scatter_add_(-1, indices.long(), listed) > 0
        dense = grid.repeat_interleave(block_size[0], dim=-2).repeat_interleave(block_size[1], dim=-1)
        return dense[..., :N_q, :N_k]

    return expand(kv_num_blocks, kv_indices), expand(full_kv_num_blocks, full_kv_indices)


def loss(O: Tensor, lse: Tensor) -> Tensor:
    """A loss through ``O`` and the finite ``lse`` (rows that see no key carry no lse gradient)."""
    w = torch.linspace(-1, 1, O.shape[-1], dtype=O.dtype)
    return (O * w).sum() + torch.where(torch.isneginf(lse), 0.0, lse).sum()


def assert_lse_equal(lse: Tensor, ref: Tensor, atol: float) -> None:
    """Same rows at -inf, the finite ones within ``atol``."""
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), "rows that see no key differ"
    finite = ~torch.isneginf(ref)
    torch.testing.assert_close(lse[finite].double(), ref[finite].double(), atol=atol, rtol=0)
