"""FlexAttention's ``score_mod`` and ``mask_mod`` inside the Triton kernels (``SCORE_MOD``, ``SCORE_GRAD``,
``MASK_MOD``) and a block mask's tile kinds (``KINDS``), forward and both backwards, in the interpreter,
against a float64 oracle computed here by plain torch: the scores, the same function evaluated on the whole
index grids, the masks, the softmax.

The functions are written twice, as torch code for the oracle and as the ``@triton.jit`` code that
:mod:`flashattn_teach.triton.usermod` generates (its signatures), so these tests hold the kernels to the
documented order (scale, softcap, ALiBi, additive mask, score_mod, masks) independently of the translator.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _triton_cases import DEVICE, REL_TOL, assert_close_scaled  # noqa: E402
from triton import language as tl  # noqa: E402

from flashattn_teach._options import make_options  # noqa: E402
from flashattn_teach.triton import AttentionConfig  # noqa: E402
from flashattn_teach.triton.autograd import TritonAttentionFunction, TritonLaunch  # noqa: E402
from flashattn_teach.triton.kernels.masking import _tanh  # noqa: E402
from flashattn_teach.triton.variants import KernelVariants, tile_list  # noqa: E402

SKIP, PARTIAL, FULL = 0, 1, 2  # flashattn_teach.flex.mods' KIND_* codes
TILE = AttentionConfig.uniform(32, 16)  # every kernel's tile: the kinds tables below are at 32 x 16
CAP = 2.0  # the softcap written as a score_mod (small enough to change the scores)
DOC_N = 77  # the document ids' length, baked into _doc_mask as the translator bakes a capture's shape


# --------------------------------------------------------------------------- the functions, twice


@triton.jit
def _softcap(score, b, h, q_idx, kv_idx, C0, C1, C2, C3):
    return CAP * _tanh(score * (1.0 / CAP))


@triton.jit
def _softcap_grad(score, b, h, q_idx, kv_idx, C0, C1, C2, C3):
    t = _tanh(score * (1.0 / CAP))
    return 1.0 - t * t


@triton.jit
def _relative(score, b, h, q_idx, kv_idx, C0, C1, C2, C3):
    return score + 0.05 * (q_idx - kv_idx).to(tl.float32)


@triton.jit
def _alibi_like(score, b, h, q_idx, kv_idx, C0, C1, C2, C3):
    return score - tl.load(C0 + h) * tl.abs(q_idx - kv_idx).to(tl.float32)


@triton.jit
def _head_bias(score, b, h, q_idx, kv_idx, C0, C1, C2, C3):
    return score + tl.load(C0 + h)


@triton.jit
def _squared(score, b, h, q_idx, kv_idx, C0, C1, C2, C3):
    return score * score


@triton.jit
def _squared_grad(score, b, h, q_idx, kv_idx, C0, C1, C2, C3):
    return 2.0 * score


@triton.jit
def _every_third_row_empty(score, b, h, q_idx, kv_idx, C0, C1, C2, C3):
    return tl.where(q_idx % 3 == 0, float("-inf"), score)


@triton.jit
def _every_third_row_empty_grad(score, b, h, q_idx, kv_idx, C0, C1, C2, C3):
    return tl.where(q_idx % 3 == 0, 0.0, 1.0)


@triton.jit
def _identity(score, b, h, q_idx, kv_idx, C0, C1, C2, C3):
    return score


@triton.jit
def _nan_grad_at_minus_inf(score, b, h, q_idx, kv_idx, C0, C1, C2, C3):
    return tl.where(score == float("-inf"), float("nan"), 1.0)  # as d(x * x) / dx would be at -inf


@triton.jit
def _causal(b, h, q_idx, kv_idx, C0, C1, C2, C3):
    return q_idx >= kv_idx


@triton.jit
def _checkerboard(b, h, q_idx, kv_idx, C0, C1, C2, C3):
    return (q_idx + kv_idx + h) % 3 != 0


@triton.jit
def _doc_mask(b, h, q_idx, kv_idx, C0, C1, C2, C3):
    # doc[b, q_idx] == doc[b, kv_idx], doc (B, DOC_N) int64 contiguous; gathers masked by the shape
    q_doc = tl.load(C0 + b * DOC_N + q_idx, mask=q_idx < DOC_N, other=-1)
    kv_doc = tl.load(C0 + b * DOC_N + kv_idx, mask=kv_idx < DOC_N, other=-2)
    return q_doc == kv_doc


@dataclass(frozen=True)
class ScoreMod:
    """A compiled score_mod as :mod:`flashattn_teach.triton.usermod` hands it over, with its torch twin."""

    jit: Any
    grad: Any
    torch_fn: Callable[..., torch.Tensor]
    captures: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class MaskMod:
    jit: Any
    torch_fn: Callable[..., torch.Tensor]
    captures: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class Kinds:
    """A block mask's kinds at the tests' one tiling (32 x 16), so that no re-tiling blurs a hand-made table."""

    table: torch.Tensor  # int8 (B|1, H|1, T_r, T_c)

    def tile_kinds(self, block_m: int, block_n: int) -> torch.Tensor:
        assert (block_m, block_n) == (32, 16), f"a launch asked for kinds at {block_m} x {block_n}"
        return self.table

    def dense(self, N_q: int, N_k: int) -> torch.Tensor:
        """Each score's kind: (B|1, H|1, N_q, N_k)."""
        t = self.table.long().repeat_interleave(32, dim=2).repeat_interleave(16, dim=3)
        return t[..., :N_q, :N_k]


SLOPES = torch.tensor([0.3, 0.1, 0.05, 0.02])  # per query head (up to 4)
BIAS = torch.tensor([0.5, -1.0, 2.0, 0.0])


def _docs(B: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(5, 40, (B, DOC_N), generator=g)
    # documents as consecutive runs: a row's id increases where the running length passes a boundary
    return torch.stack([torch.repeat_interleave(torch.arange(DOC_N), lengths[i])[:DOC_N] for i in range(B)])


SCORE_MODS = {
    "softcap": ScoreMod(_softcap, _softcap_grad, lambda s, b, h, q, kv: CAP * torch.tanh(s / CAP)),
    "relative": ScoreMod(_relative, None, lambda s, b, h, q, kv: s + 0.05 * (q - kv)),
    "alibi_like": ScoreMod(
        _alibi_like, None, lambda s, b, h, q, kv: s - SLOPES.double()[h] * (q - kv).abs(), (SLOPES,)
    ),
    "head_bias": ScoreMod(_head_bias, None, lambda s, b, h, q, kv: s + BIAS.double()[h], (BIAS,)),
    "squared": ScoreMod(_squared, _squared_grad, lambda s, b, h, q, kv: s * s),
    "empty_rows": ScoreMod(
        _every_third_row_empty,
        _every_third_row_empty_grad,
        lambda s, b, h, q, kv: torch.where(q % 3 == 0, float("-inf"), s),
    ),
}
MASK_MODS = {
    "causal": MaskMod(_causal, lambda b, h, q, kv: q >= kv),
    "checkerboard": MaskMod(_checkerboard, lambda b, h, q, kv: (q + kv + h) % 3 != 0),
}


# ----------------------------------------------------------------------------------------- oracle


def oracle(
    q, k, v, *, score_mod=None, mask_mod=None, kinds=None, causal=False, softcap=None, scale=None, attn_mask=None
):
    """``(O, lse)`` in float64 by plain torch on whole index grids; a row that sees no key: O = 0, lse = -inf.
    ``q (B, H_q, N_q, D)``, ``k, v (B, H_kv, N_k, .)``; grouped heads by repetition."""
    B, H, N_q, D = q.shape
    N_k = k.shape[2]
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (D**-0.5 if scale is None else scale) * q @ k.transpose(-1, -2)  # (B, H, N_q, N_k)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if attn_mask is not None:
        s = s + attn_mask
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    qi = torch.arange(N_q).view(N_q, 1)
    kj = torch.arange(N_k).view(1, N_k)
    if score_mod is not None:
        s = score_mod.torch_fn(s, b, h, qi, kj)
    visible = torch.ones(B, H, N_q, N_k, dtype=torch.bool)
    if causal:
        visible = visible & (qi >= kj)
    user = torch.ones_like(visible) if mask_mod is None else mask_mod.torch_fn(b, h, qi, kj).expand_as(visible)
    if kinds is not None:
        kind = kinds.dense(N_q, N_k).expand_as(visible)
        user = (kind == FULL) | ((kind == PARTIAL) & user)
    s = torch.where(visible & user, s, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isneginf(m), 0.0, m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = (p / torch.where(l == 0, 1.0, l)) @ v
    lse = torch.where(l == 0, float("-inf"), m + torch.log(torch.where(l == 0, 1.0, l))).squeeze(-1)
    return o, lse


# ------------------------------------------------------------------------------------------ running


@dataclass(frozen=True)
class Case:
    B: int = 2
    H: int = 2
    H_kv: int = 2
    N_q: int = 77
    N_k: int = 77
    D: int = 32
    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    kinds: Kinds | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def tensors(self, seed: int = 0) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(self.B, self.H, self.N_q, self.D, generator=g, dtype=torch.float64)
        k = torch.randn(self.B, self.H_kv, self.N_k, self.D, generator=g, dtype=torch.float64)
        v = torch.randn(self.B, self.H_kv, self.N_k, self.D, generator=g, dtype=torch.float64)
        dO = torch.randn(self.B, self.H, self.N_q, self.D, generator=g, dtype=torch.float64)
        return q, k, v, dO


def run_triton(c: Case, q, k, v, *, deterministic: bool = False):
    """``(O, lse)`` by the kernels, the user's functions handed to them as usermod would."""
    opts = make_options(q, k, v, enable_gqa=c.H != c.H_kv, deterministic=deterministic, **c.options)
    variants = replace(
        KernelVariants.from_spec(opts.mask),
        score_mod=c.score_mod,
        mask_mod=c.mask_mod,
        block_mask=c.kinds,
    )
    return TritonAttentionFunction.apply(q, k, v, opts, TritonLaunch(TILE, variants), None)


def values_and_grads(f, q, k, v, dO):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    O, lse = f(q, k, v)
    (O * dO.to(O.dtype)).sum().backward()
    return O, lse, q.grad, k.grad, v.grad


def check(c: Case, dtype: torch.dtype = torch.float32, deterministic: bool = False) -> tuple[torch.Tensor, ...]:
    q, k, v, dO = c.tensors()
    got = values_and_grads(
        lambda *a: run_triton(c, *a, deterministic=deterministic), *(t.to(DEVICE, dtype) for t in (q, k, v, dO))
    )
    want = values_and_grads(
        lambda *a: oracle(*a, score_mod=c.score_mod, mask_mod=c.mask_mod, kinds=c.kinds, **c.options), q, k, v, dO
    )
    for what, a, b in zip(("O", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert a.shape == b.shape, what
        assert_close_scaled(a, b, 2 * REL_TOL[dtype], what)
    return got


# ------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_score_mod_matches_the_oracle_values_lse_and_gradients(name: str) -> None:
    check(Case(score_mod=SCORE_MODS[name]))


@pytest.mark.parametrize("deterministic", [False, True], ids=["one_kernel", "two_kernels"])
@pytest.mark.parametrize(("N_q", "N_k"), [(77, 139), (139, 77)])
def test_score_mod_on_ragged_lengths_in_both_backwards(N_q: int, N_k: int, deterministic: bool) -> None:
    check(
        Case(N_q=N_q, N_k=N_k, score_mod=SCORE_MODS["softcap"], options={"causal": True}), deterministic=deterministic
    )


def test_score_mod_comes_after_the_built_in_softcap_and_before_causal() -> None:
    check(Case(score_mod=SCORE_MODS["relative"], options={"softcap": 1.5, "causal": True, "scale": -0.3}))


@pytest.mark.parametrize("deterministic", [False, True], ids=["one_kernel", "two_kernels"])
def test_rows_that_score_mod_empties_give_zero_output_minus_inf_lse_and_no_nan(deterministic: bool) -> None:
    O, lse, dq, dk, dv = check(Case(N_q=77, N_k=139, score_mod=SCORE_MODS["empty_rows"]), deterministic=deterministic)
    assert torch.isneginf(lse[:, :, ::3]).all() and torch.isfinite(lse[:, :, 1::3]).all()
    assert (O[:, :, ::3] == 0).all() and (dq[:, :, ::3] == 0).all()
    assert not any(torch.isnan(t).any() for t in (dq, dk, dv))


@pytest.mark.parametrize("deterministic", [False, True], ids=["one_kernel", "two_kernels"])
def test_an_additive_masks_minus_inf_reaching_score_mod_leaves_no_nan_in_the_gradients(deterministic: bool) -> None:
    # the derivative at a -inf score is NaN here; where P is 0 the kernels multiply nothing by it
    mask = torch.zeros(77, 77, dtype=torch.float64)
    mask[:, 40:70] = float("-inf")
    mask[5] = float("-inf")  # a row that sees nothing
    identity = ScoreMod(_identity, _nan_grad_at_minus_inf, lambda s, b, h, q, kv: s)
    check(Case(score_mod=identity, options={"attn_mask": mask.to(DEVICE, torch.float32)}), deterministic=deterministic)


@pytest.mark.parametrize("name", list(MASK_MODS))
def test_mask_mod_matches_the_oracle(name: str) -> None:
    check(Case(N_q=77, N_k=139, mask_mod=MASK_MODS[name]))


def test_document_mask_with_a_captured_tensor_and_a_score_mod() -> None:
    docs = _docs(2)
    mask = MaskMod(_doc_mask, lambda b, h, q, kv: docs[b, q] == docs[b, kv], (docs.to(DEVICE),))
    check(Case(mask_mod=mask, score_mod=SCORE_MODS["alibi_like"]), deterministic=True)


def test_grouped_query_heads_see_their_own_query_head_index() -> None:
    c = Case(H=4, H_kv=2, N_q=77, N_k=139, score_mod=SCORE_MODS["head_bias"], mask_mod=MASK_MODS["checkerboard"])
    check(c)


def _kinds_table(B: int, H: int, N_q: int, N_k: int, seed: int) -> torch.Tensor:
    """Random kinds at 32 x 16, every kind present (the first three tiles are SKIP, PARTIAL, FULL)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 3, (B, H, math.ceil(N_q / 32), math.ceil(N_k / 16)), generator=g, dtype=torch.int8)
    t[..., 0, :3] = torch.tensor([SKIP, PARTIAL, FULL], dtype=torch.int8)
    return t


@pytest.mark.parametrize("deterministic", [False, True], ids=["one_kernel", "two_kernels"])
def test_tile_kinds_skip_full_and_partial_tiles_as_the_block_mask_says(deterministic: bool) -> None:
    kinds = Kinds(_kinds_table(2, 2, 77, 139, seed=1))
    check(
        Case(N_q=77, N_k=139, mask_mod=MASK_MODS["checkerboard"], kinds=kinds, score_mod=SCORE_MODS["softcap"]),
        deterministic=deterministic,
    )


@pytest.mark.parametrize("heads", [4, 1], ids=["kinds_per_head", "kinds_shared_by_the_group"])
def test_tile_kinds_with_grouped_query_heads(heads: int) -> None:
    # per head, the dK/dV program's group of query heads has a list of tiles each (the branching loop); shared,
    # one list serves the group (the listed loop)
    kinds = Kinds(_kinds_table(2, heads, 77, 139, seed=4))
    check(Case(H=4, H_kv=2, N_q=77, N_k=139, mask_mod=MASK_MODS["checkerboard"], kinds=kinds))


def test_tile_kinds_broadcast_over_batch_and_heads_with_causal() -> None:
    kinds = Kinds(_kinds_table(1, 1, 77, 77, seed=2))
    check(Case(mask_mod=MASK_MODS["checkerboard"], kinds=kinds, options={"causal": True}))


def test_tile_list_holds_each_rows_visited_tiles_in_order_with_their_kinds() -> None:
    kinds = _kinds_table(2, 3, 77, 139, seed=5)
    table = tile_list(kinds)
    assert table.dtype == torch.int32 and table.shape == (*kinds.shape[:3], 1 + kinds.shape[3])
    for b, h, i in itertools.product(*(range(n) for n in kinds.shape[:3])):
        visited = [(j, int(kind)) for j, kind in enumerate(kinds[b, h, i].tolist()) if kind != SKIP]
        n = int(table[b, h, i, 0])
        assert [(int(c) >> 2, int(c) & 3) for c in table[b, h, i, 1 : 1 + n]] == visited


def test_a_skip_tile_is_not_computed_even_where_mask_mod_sees_keys() -> None:
    # Every score is visible to mask_mod; marking tiles SKIP must remove them as the oracle with that
    # block mask does (and change the result: the control), FULL and PARTIAL tiles keep theirs.
    everything = MaskMod(_causal, lambda b, h, q, kv: torch.ones_like(q >= kv))
    all_partial = Kinds(torch.full((1, 1, 3, 5), PARTIAL, dtype=torch.int8))
    skipped = all_partial.table.clone()
    skipped[0, 0, :, 2:5] = SKIP  # visible tiles left of the diagonal (causal keeps tiles of key < query)
    skipped[0, 0, 2, 0] = FULL
    base = Case(N_q=77, N_k=77, mask_mod=everything, options={"causal": True})
    plain = check(replace(base, kinds=all_partial))
    skips = check(replace(base, kinds=Kinds(skipped)))
    assert not torch.allclose(plain[0], skips[0]), "the control: SKIP tiles changed nothing"


def test_without_mask_mod_a_partial_tile_sees_every_key_and_a_skip_tile_none() -> None:
    kinds = Kinds(_kinds_table(2, 1, 77, 77, seed=3))
    check(Case(kinds=kinds, score_mod=SCORE_MODS["relative"]))


def test_half_precision_error_is_at_most_twice_torchs() -> None:
    """flash-attn's rule: against the float64 oracle, the kernel's fp16 error is at most twice (plus a
    little) that of the same attention computed by torch in fp16 throughout."""
    c = Case(N_q=77, N_k=139, score_mod=SCORE_MODS["softcap"], mask_mod=MASK_MODS["checkerboard"])
    q, k, v, dO = c.tensors()

    def reference(*a):
        return oracle(*a, score_mod=c.score_mod, mask_mod=c.mask_mod)

    want = values_and_grads(reference, q, k, v, dO)
    got = values_and_grads(lambda *a: run_triton(c, *a), *(t.to(DEVICE, torch.float16) for t in (q, k, v, dO)))
    torch_half = values_and_grads(reference, *(t.half() for t in (q, k, v, dO)))
    for what, i in (("O", 0), ("dq", 2), ("dk", 3), ("dv", 4)):
        err = (got[i].double().cpu() - want[i]).abs().max().item()
        ref = (torch_half[i].double() - want[i]).abs().max().item()
        assert err <= 2 * ref + 1e-3, f"{what}: fp16 kernel error {err:.3g} > 2 x torch's {ref:.3g} + 1e-3"
