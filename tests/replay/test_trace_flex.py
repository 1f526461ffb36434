"""The tile replay under FlexAttention's block mask and score_mod (forward and backward).

Every check is against an independent computation: a float64 dense oracle written here (the whole ``(N_q, N_k)``
score matrix, ``score_mod`` on full index grids, ``mask_mod`` applied as ``-inf``, torch.autograd for the
gradients), ``flashattn_teach.flex_attention``'s own output, and the block mask's own ``block_kinds`` table for
which tiles are visited. A wrong block mask (a negative control) must change the visited tiles and the output.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from flashattn_teach import create_block_mask, flex_attention
from flashattn_teach.errors import AttentionValueError
from flashattn_teach.flex.block_mask import KIND_FULL, KIND_PARTIAL, KIND_SKIP, BlockMask
from flashattn_teach.masks.causal import TileKind
from flashattn_teach.replay import replay, replay_backward, to_experiment
from flashattn_teach.replay.html import render_html

F64 = torch.float64
N, D, TILE = 8, 4, 2
PREFIX = 3
DOCS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 1, 1, 1, 1, 2, 2]])  # (B, N): document of each position
TABLE = torch.randn(N, N, generator=torch.Generator().manual_seed(7), dtype=F64)  # a captured bias table


# FlexAttention's classic masks and score functions (torch's attention-gym), written from their definitions.
def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx


def sliding_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 2)


def document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return DOCS[b, q_idx] == DOCS[b, kv_idx]


def prefix_lm(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return (kv_idx < PREFIX) | (q_idx >= kv_idx)


def relative_position(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return score + 0.25 * (q_idx - kv_idx)


def alibi(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return score - 0.5 * (h + 1) * (q_idx - kv_idx).abs()


def tanh_softcap(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return 1.5 * torch.tanh(score / 1.5)


def table_bias(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return score + TABLE[q_idx, kv_idx]


MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MASKS: dict[str, MaskMod] = {f.__name__: f for f in (causal, sliding_window, document, prefix_lm)}
SCORES: dict[str, ScoreMod | None] = {
    "none": None,
    **{f.__name__: f for f in (relative_position, alibi, tanh_softcap, table_bias)},
}
CASES = [(m, s) for m in MASKS for s in ("none", "alibi")]
CASES += [("causal", s) for s in SCORES if s not in ("none", "alibi")]


def inputs(B: int = 1, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, N, D, generator=g, dtype=F64) for _ in range(3))  # type: ignore[return-value]


def oracle(q: Tensor, k: Tensor, v: Tensor, mask_mod: MaskMod, score_mod: ScoreMod | None, b: int = 0) -> Tensor:
    """Float64 dense attention of one head ``(N, D)``: scale, score_mod, then mask_mod as -inf; O = 0 where a row
    sees no key."""
    bi, hi = torch.tensor(b), torch.tensor(0)
    q_idx, kv_idx = torch.arange(N)[:, None], torch.arange(N)[None, :]
    S = (q @ k.T) / math.sqrt(D)  # (N, N)
    if score_mod is not None:
        S = score_mod(S, bi, hi, q_idx, kv_idx).expand(N, N)
    S = S.masked_fill(~mask_mod(bi, hi, q_idx, kv_idx).expand(N, N), float("-inf"))
    empty = torch.isneginf(S).all(-1, keepdim=True)
    P = torch.softmax(S.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return P @ v  # (N, D)


def replayed_output(q: Tensor, k: Tensor, v: Tensor, **options: object) -> tuple[Tensor, set, dict]:
    """The final O of every query block from the replays' last steps, the tiles they visited and their kinds."""
    O = torch.zeros(N, D, dtype=F64)
    visited, kinds = set(), {}
    for i in range(N // TILE):
        r = replay(q, k, v, query_block=i, **options)  # type: ignore[arg-type]
        for step in r.steps:
            visited.add((step.i, step.j))
            kinds[step.i, step.j] = step.kind
            if step.last:
                O[step.rows[0] : step.rows[1]] = step["O_partial"]
    return O, visited, kinds


def non_skip(table: Tensor) -> set:
    """The ``(i, j)`` tiles of a ``(T_r, T_c)`` kinds table that are not SKIP."""
    return {(i, j) for i, j in (table != KIND_SKIP).nonzero().tolist()}


@pytest.mark.parametrize(("mask_name", "score_name"), CASES)
def test_replay_with_a_block_mask_ends_at_flex_attention_and_the_dense_oracle(mask_name, score_name):
    mask_mod, score_mod = MASKS[mask_name], SCORES[score_name]
    q, k, v = inputs()
    bm = create_block_mask(mask_mod, None, None, N, N, device="cpu", BLOCK_SIZE=TILE)
    opts = {"block_m": TILE, "block_n": TILE, "block_mask": bm, "score_mod": score_mod}
    O, visited, kinds = replayed_output(q, k, v, **opts)
    flex = flex_attention(q[:, None], k[:, None], v[:, None], score_mod=score_mod, block_mask=bm)[0, 0]
    dense = oracle(q[0], k[0], v[0], mask_mod, score_mod)
    assert float((O - dense).abs().max()) < 1e-12
    assert float((O - flex).abs().max()) < 1e-12
    # The tiles: exactly the block mask's non-SKIP ones, FULL and PARTIAL as its table says.
    table = bm.block_kinds[0, 0]
    assert visited == non_skip(table)
    codes = {TileKind.FULL: KIND_FULL, TileKind.PARTIAL: KIND_PARTIAL}
    assert all(codes[kind] == int(table[i, j]) for (i, j), kind in kinds.items())


def test_the_teaching_example_with_a_causal_block_mask_is_the_causal_replay():
    # 6 tokens, width 4, 2x2 tiles: the block mask of causal gives the tiles and numbers of causal=True.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 4, generator=g, dtype=F64) for _ in range(3))
    bm = create_block_mask(causal, None, None, 6, 6, device="cpu", BLOCK_SIZE=2)
    for i in range(3):
        flex = replay(q, k, v, block_m=2, block_n=2, query_block=i, block_mask=bm)
        plain = replay(q, k, v, block_m=2, block_n=2, query_block=i, causal=True)
        assert [(s.j, s.kind) for s in flex.steps] == [(s.j, s.kind) for s in plain.steps]
        for a, b in zip(flex.steps, plain.steps, strict=True):
            assert (
                torch.equal(a["S_ij"], b["S_ij"])
                and torch.equal(a["m_i"], b["m_i"])
                and torch.equal(a["l_i"], b["l_i"])
            )
        assert set(flex.skipped) == set(plain.skipped)


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_a_block_mask_of_another_block_size_is_retiled_as_flex_attention_retiles_it(mask_name):
    mask_mod = MASKS[mask_name]
    q, k, v = inputs()
    bm = create_block_mask(mask_mod, None, None, N, N, device="cpu", BLOCK_SIZE=2)
    table = bm.block_kinds[0, 0]  # (4, 4) kinds at 2x2
    for i, (r0, r1) in enumerate([(0, 3), (3, 6), (6, 8)]):  # the replay's 3x3 tiles
        r = replay(q, k, v, block_m=3, block_n=3, query_block=i, block_mask=bm, score_mod=alibi)
        # A 3x3 tile is SKIP iff every 2x2 block it meets is SKIP, FULL iff every one is FULL (conservative).
        expected = {}
        for j, (c0, c1) in enumerate([(0, 3), (3, 6), (6, 8)]):
            met = table[r0 // 2 : (r1 - 1) // 2 + 1, c0 // 2 : (c1 - 1) // 2 + 1]
            if not bool((met == KIND_SKIP).all()):
                expected[j] = TileKind.FULL if bool((met == KIND_FULL).all()) else TileKind.PARTIAL
        assert {s.j: s.kind for s in r.steps} == expected
        dense = oracle(q[0], k[0], v[0], mask_mod, alibi)[r0:r1]
        assert float((r.steps[-1]["O_partial"] - dense).abs().max()) < 1e-12
        assert r.labels() == ["score_mod alibi", "block_mask " + mask_name + " 2x2, re-tiled to 3x3"]


def test_the_block_mask_of_the_replayed_batch_element_is_read():
    q, k, v = inputs(B=2, seed=3)
    bm = create_block_mask(document, 2, None, N, N, device="cpu", BLOCK_SIZE=TILE)
    flex = flex_attention(q[:, None], k[:, None], v[:, None], block_mask=bm, score_mod=relative_position)[:, 0]
    for b in (0, 1):
        opts = {"block_m": TILE, "block_n": TILE, "block_mask": bm, "score_mod": relative_position, "batch_index": b}
        O, visited, _ = replayed_output(q, k, v, **opts)
        assert visited == non_skip(bm.block_kinds[b, 0])
        assert float((O - oracle(q[b], k[b], v[b], document, relative_position, b=b)).abs().max()) < 1e-12
        assert float((O - flex[b]).abs().max()) < 1e-12
    assert non_skip(bm.block_kinds[0, 0]) != non_skip(bm.block_kinds[1, 0])  # the two elements differ


def test_negative_control_a_wrong_block_mask_changes_the_tiles_and_the_output():
    q, k, v = inputs()
    right = create_block_mask(sliding_window, None, None, N, N, device="cpu", BLOCK_SIZE=TILE)
    kinds = right.block_kinds.clone()
    assert int(kinds[0, 0, 2, 1]) != KIND_SKIP
    kinds[0, 0, 2, 1] = KIND_SKIP  # a visible tile marked SKIP by hand
    wrong = BlockMask(kinds, (N, N), TILE, sliding_window)
    O_right, visited_right, _ = replayed_output(q, k, v, block_m=TILE, block_n=TILE, block_mask=right)
    O_wrong, visited_wrong, _ = replayed_output(q, k, v, block_m=TILE, block_n=TILE, block_mask=wrong)
    assert visited_right - visited_wrong == {(2, 1)}
    dense = oracle(q[0], k[0], v[0], sliding_window, None)
    assert float((O_right - dense).abs().max()) < 1e-12
    assert float((O_wrong - dense).abs().max()) > 1e-3  # rows 4-5 lost keys 2-3
    # flex_attention reads the wrong table the same way: a SKIP block means what it says.
    flex = flex_attention(q[:, None], k[:, None], v[:, None], block_mask=wrong)[0, 0]
    assert float((O_wrong - flex).abs().max()) < 1e-12


@pytest.mark.parametrize(("mask_name", "score_name"), [*CASES[::2], ("causal", "tanh_softcap")])
def test_backward_replay_with_a_block_mask_matches_float64_autograd(mask_name, score_name):
    mask_mod, score_mod = MASKS[mask_name], SCORES[score_name]
    q, k, v = inputs(seed=1)
    dO = torch.randn(N, D, generator=torch.Generator().manual_seed(2), dtype=F64)
    bm = create_block_mask(mask_mod, None, None, N, N, device="cpu", BLOCK_SIZE=TILE)
    br = replay_backward(q, k, v, dO, block_m=TILE, block_n=TILE, block_mask=bm, score_mod=score_mod)
    leaves = [t[0].clone().requires_grad_(True) for t in (q, k, v)]
    oracle(*leaves, mask_mod, score_mod).backward(dO)
    mine = br.gradients()
    for name, leaf in zip(("dQ", "dK", "dV"), leaves, strict=True):
        assert leaf.grad is not None
        assert float((mine[name] - leaf.grad).abs().max()) < 1e-12, name
    visited = {(s.i, s.j) for s in br.dq_steps()}
    assert visited == {(s.i, s.j) for s in br.dkdv_steps()} == non_skip(bm.block_kinds[0, 0])
    assert set(br.skipped()) == {(i, j) for i in range(N // TILE) for j in range(N // TILE)} - visited


def test_the_backward_shows_the_score_mods_derivative_in_ds():
    q, k, v = inputs(seed=1)
    bm = create_block_mask(causal, None, None, N, N, device="cpu", BLOCK_SIZE=TILE)
    br = replay_backward(q, k, v, block_m=TILE, block_n=TILE, block_mask=bm, score_mod=tanh_softcap)
    step = next(iter(br.dq_steps()))
    eq = next(e for e in step.equations if e.name == "dS_ij")
    assert eq.symbolic.endswith("dscore_mod/dS")
    # d(1.5 tanh(S / 1.5))/dS = 1 - tanh(S / 1.5)^2, at the tile's (unmasked) scores
    S = (q[0, :TILE] @ k[0, :TILE].T) / math.sqrt(D)
    dS_in = step["P_ij"] * (step["dP_ij"] - br.delta[:TILE, None]) * (1 - torch.tanh(S / 1.5) ** 2)
    assert float((step["dS_ij"] - dS_in).abs().max()) < 1e-12


def test_labels_variants_json_and_page_name_the_block_mask():
    jsonschema = pytest.importorskip("jsonschema")
    from flashattn_teach.replay.manifest import schema

    q, k, v = inputs()
    bm = create_block_mask(prefix_lm, None, None, N, N, device="cpu", BLOCK_SIZE=TILE)
    r = replay(q, k, v, block_m=TILE, block_n=TILE, query_block=1, block_mask=bm, score_mod=alibi)
    assert r.variants == ("score_mod", "block_mask")
    assert r.labels() == ["score_mod alibi", "block_mask prefix_lm 2x2"]
    visible = torch.ones(N, N, dtype=torch.bool).tril() | (torch.arange(N) < PREFIX)[None, :]
    assert torch.equal(r.visible(), visible)
    experiment = to_experiment(r)
    jsonschema.Draft202012Validator(schema()).validate(experiment)
    page = render_html(r)
    assert "block_mask" in page


def test_refusals_name_the_argument_and_what_to_do():
    q, k, v = inputs()
    per_head = create_block_mask(causal, None, 2, N, N, device="cpu", BLOCK_SIZE=TILE)
    per_head_kinds = torch.cat([per_head.block_kinds, per_head.block_kinds], dim=1)  # (1, 2, T_r, T_c)
    two_heads = BlockMask(per_head_kinds, (N, N), TILE, causal, batch_shape=(1, 2))
    with pytest.raises(AttentionValueError, match=r"block_mask was built for H = 2 heads.*h = 0"):
        replay(q, k, v, block_m=TILE, block_n=TILE, block_mask=two_heads)
    with pytest.raises(AttentionValueError, match=r"block_mask was built for H = 2"):
        replay_backward(q, k, v, block_m=TILE, block_n=TILE, block_mask=two_heads)
    two_batch = create_block_mask(document, 2, None, N, N, device="cpu", BLOCK_SIZE=TILE)
    with pytest.raises(AttentionValueError, match=r"block_mask was built for B = 2"):
        replay(q, k, v, block_m=TILE, block_n=TILE, block_mask=two_batch)
    short = create_block_mask(causal, None, None, N - 2, N - 2, device="cpu", BLOCK_SIZE=TILE)
    with pytest.raises(AttentionValueError, match=r"block_mask was created for \(Q_LEN, KV_LEN\)"):
        replay(q, k, v, block_m=TILE, block_n=TILE, block_mask=short)
    cu = torch.tensor([0, 3, N], dtype=torch.int32)
    with pytest.raises(AttentionValueError, match=r"cu_seqlens cannot be combined with score_mod or block_mask"):
        replay(q, k, v, block_m=TILE, block_n=TILE, cu_seqlens=cu, score_mod=alibi)


def test_a_score_mod_that_returns_minus_inf_hides_its_cells_in_the_picture():
    def causal_by_score(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score, float("-inf"))

    q, k, v = inputs()
    r = replay(q, k, v, block_m=TILE, block_n=TILE, query_block=3, score_mod=causal_by_score)
    assert torch.equal(r.visible(), torch.ones(N, N, dtype=torch.bool).tril())
    assert len(r.steps) == N // TILE  # no block mask: every tile is visited, the scores are -inf above the diagonal
    assert float((r.steps[-1]["O_partial"] - oracle(q[0], k[0], v[0], causal, None)[6:]).abs().max()) < 1e-12
