"""Bottom-right alignment with ``seqlens_k`` follows each batch element's own length, as flash-attn does.

flash-attn's varlen and KV-cache calls put the last query row of batch element ``b`` at its last key:
key ``j`` is visible to query ``i`` iff ``j < L_b`` and, with ``off_b = L_b - N_q``,

    j <= i + off_b                                   causal
    i + off_b - left <= j <= i + off_b + right       window (left, right); -1: unbounded

and ALiBi adds ``-slope * |i + off_b - j|``. :func:`rule` builds that visibility one batch element at a
time from these lines alone (no library mask code) and every path is held against it: the dense oracle,
the tiled references and their backward, the tile plan, the folded decode rows and the tile replay.
``top_left`` keeps ``off = 0`` for every element.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashattn_teach as fa
from flashattn_teach._options import make_options
from flashattn_teach.dispatch import runner
from flashattn_teach.masks.causal import TileKind
from flashattn_teach.reference import dense_attention, flash_backward, key_major_attention, online_attention
from flashattn_teach.replay import replay

from attention_strategies import parallel_attention

NEG_INF = float("-inf")


def rule_visible(N_q, N_k, L, *, causal=True, causal_align="bottom_right", window=(-1, -1)):
    """``(N_q, N_k)`` bool: the keys each query row of a batch element with ``L`` keys sees."""
    off = L - N_q if causal_align == "bottom_right" else 0
    left, right = window
    seen = torch.zeros(N_q, N_k, dtype=torch.bool)
    for i in range(N_q):
        for j in range(N_k):
            ok = j < L
            ok &= not causal or j <= i + off
            ok &= left < 0 or j >= i + off - left
            ok &= right < 0 or j <= i + off + right
            seen[i, j] = ok
    return seen


def rule(q, k, v, seqlens_k, *, causal=True, causal_align="bottom_right", window=(-1, -1), alibi_slopes=None):
    """``(O, lse)`` in float64 by flash-attn's per-element rule; ``q (B, H_q, N_q, D)``, ``k, v (B, H_kv, N_k, .)``,
    ``alibi_slopes (H_q,)``. A row that sees no key gives ``O = 0`` and ``lse = -inf``."""
    B, H_q, N_q, D = q.shape
    N_k = k.shape[-2]
    k = k.double().repeat_interleave(H_q // k.shape[1], dim=1)
    v = v.double().repeat_interleave(H_q // v.shape[1], dim=1)
    outs, lses = [], []
    for b in range(B):
        L = int(seqlens_k[b])
        off = L - N_q if causal_align == "bottom_right" else 0
        S = q[b].double() @ k[b].transpose(-1, -2) / D**0.5  # (H_q, N_q, D) @ (H_q, D, N_k) -> (H_q, N_q, N_k)
        if alibi_slopes is not None:
            i, j = torch.arange(N_q)[:, None], torch.arange(N_k)[None, :]
            S = S - alibi_slopes.double()[:, None, None] * (i + off - j).abs()
        seen = rule_visible(N_q, N_k, L, causal=causal, causal_align=causal_align, window=window)
        S = S.masked_fill(~seen, NEG_INF)
        empty = ~seen.any(dim=-1, keepdim=True)  # (N_q, 1)
        S = S.masked_fill(empty, 0.0)
        outs.append(torch.softmax(S, dim=-1).masked_fill(empty, 0.0) @ v[b])
        lses.append(torch.logsumexp(S, dim=-1).masked_fill(empty[:, 0], NEG_INF))
    return torch.stack(outs), torch.stack(lses)


BACKENDS = [
    pytest.param(online_attention, id="query_major"),
    pytest.param(key_major_attention, id="key_major"),
    pytest.param(parallel_attention, id="parallel"),
    pytest.param(dense_attention, id="dense"),
]


def loss(O, lse):
    """Through ``O`` and the finite ``lse``: rows that see no key carry no lse gradient."""
    w = torch.linspace(-1, 1, O.shape[-1], dtype=O.dtype)
    return (O * w).sum() + torch.where(torch.isneginf(lse), 0.0, lse).sum()


def assert_lse_equal(lse, ref, atol):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    finite = ~torch.isneginf(ref)
    torch.testing.assert_close(lse[finite].double(), ref[finite], atol=atol, rtol=0)


@st.composite
def aligned_calls(draw):
    """Shapes, per-element lengths (some below ``N_q``, so that early rows see nothing; 0 included),
    causal or a window or neither, ALiBi or not, and tiles of any size."""
    B = draw(st.integers(1, 3))
    H_kv, G = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    N_q, N_k = draw(st.integers(1, 13)), draw(st.integers(1, 17))
    lengths = draw(st.lists(st.integers(0, N_k), min_size=B, max_size=B))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def make(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    D = draw(st.sampled_from([1, 3, 4]))
    q, k, v = make(B, H_kv * G, N_q, D), make(B, H_kv, N_k, D), make(B, H_kv, N_k, draw(st.sampled_from([2, 5])))
    options = {"seqlens_k": torch.tensor(lengths), "causal": draw(st.booleans())}
    if draw(st.booleans()):
        options["window"] = (draw(st.integers(-1, 5)), draw(st.integers(-1, 5)))
    if draw(st.booleans()):
        options["alibi_slopes"] = torch.rand(H_kv * G, generator=g, dtype=torch.float64)
    tiles = {"block_m": draw(st.integers(1, 8)), "block_n": draw(st.integers(1, 8))}
    return q, k, v, options, tiles


def _rule_of(q, k, v, options):
    window = options.get("window", (-1, -1))
    if options["causal"]:
        window = (window[0], 0)  # causal is the window's right side 0, intersected with any window
    return rule(q, k, v, options["seqlens_k"], causal=options["causal"], window=window,
                alibi_slopes=options.get("alibi_slopes"))  # fmt: skip


# ------------------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("attention", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(call=aligned_calls())
def test_every_backend_aligns_each_element_to_its_own_length_values_lse_and_gradients(attention, call):
    q, k, v, options, tiles = call
    kw = {"causal_align": "bottom_right", "enable_gqa": True, **options}
    O, lse = attention(q, k, v, return_lse=True, **kw, **({} if attention is dense_attention else tiles))
    O_ref, lse_ref = _rule_of(q, k, v, options)
    torch.testing.assert_close(O, O_ref, atol=1e-12, rtol=0)
    assert_lse_equal(lse, lse_ref, 1e-12)
    grads = torch.autograd.grad(loss(O, lse), (q, k, v))
    refs = torch.autograd.grad(loss(O_ref, lse_ref), (q, k, v))
    for name, got, want in zip("qkv", grads, refs, strict=True):
        assert not got.isnan().any(), f"d{name}"
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0, msg=f"d{name}")


@settings(max_examples=30, deadline=None)
@given(call=aligned_calls())
def test_flash_backward_aligns_each_element_to_its_own_length(call):
    q, k, v, options, tiles = call
    kw = {"causal_align": "bottom_right", "enable_gqa": True, **options, **tiles}
    O, lse = online_attention(q, k, v, return_lse=True, **kw)
    dO = torch.randn_like(O)
    grads = flash_backward(q, k, v, O, lse, dO, **kw)
    refs = torch.autograd.grad(_rule_of(q, k, v, options)[0], (q, k, v), dO)
    for name, got, want in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0, msg=f"d{name}")


def _probe_visible(attention, N_q, N_k, lengths, causal_align="bottom_right", **kw):
    """``(B, N_q, N_k)`` bool, measured: with all scores equal and ``V = I``, ``O[b, i, j] > 0`` exactly where
    query ``i`` of element ``b`` sees key ``j``."""
    B = len(lengths)
    q = torch.zeros(B, 1, N_q, 1, dtype=torch.float64)
    k = torch.zeros(B, 1, N_k, 1, dtype=torch.float64)
    v = torch.eye(N_k, dtype=torch.float64).expand(B, 1, N_k, N_k)
    tiles = {} if attention is dense_attention else {"block_m": 1, "block_n": 2}
    O = attention(q, k, v, seqlens_k=torch.tensor(lengths), causal_align=causal_align, **kw, **tiles)
    return O[:, 0] > 0


# The picture in causal.py's docstring, x: visible.
PICTURE = {
    "causal": (["x x x x x .", "x x x x x x"], ["x x x . . .", "x x x x . ."]),
    "window=(1, 0)": ([". . . x x .", ". . . . x x"], [". x x . . .", ". . x x . ."]),
}


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("case", sorted(PICTURE))
def test_the_pictured_batch_sees_the_keys_drawn(attention, case):
    """N_q = 2, N_k = 6, seqlens_k = [6, 4] (``causal.py``): element 1's rows see keys up to 2 and 3, not 4
    and 5 as an offset of N_k - N_q would give."""
    kw = {"causal": True} if case == "causal" else {"window": (1, 0)}
    seen = _probe_visible(attention, 2, 6, [6, 4], **kw)
    for b, rows in enumerate(PICTURE[case]):
        want = torch.tensor([[c == "x" for c in row.split()] for row in rows])
        assert torch.equal(seen[b], want), (b, seen[b])
        assert torch.equal(want, rule_visible(2, 6, (6, 4)[b], window=(1, 0) if case != "causal" else (-1, 0)))


def test_the_causal_module_draws_the_pictured_batch():
    import flashattn_teach.masks.causal as causal

    doc = causal.__doc__
    assert "seqlens_k = [6, 4]" in doc
    for rows in PICTURE["causal"]:
        for row in rows:
            assert row in doc.replace("-", ".")  # the picture draws padding as -


@pytest.mark.parametrize("attention", BACKENDS)
def test_rows_before_a_short_element_s_diagonal_see_nothing(attention):
    """Element 1 has 2 keys and 5 queries: off_1 = -3, so rows 0-2 see no key: O = 0, lse = -inf, zero
    gradients and no NaN; rows 3 and 4 see keys 0 and 0-1. Element 0 (all 7 keys) is unaffected."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (5, 7, 7))
    lengths = torch.tensor([7, 2])
    tiles = {} if attention is dense_attention else {"block_m": 2, "block_n": 3}
    O, lse = attention(q, k, v, causal=True, causal_align="bottom_right", seqlens_k=lengths, return_lse=True, **tiles)
    assert torch.isneginf(lse[1, :, :3]).all() and torch.isfinite(lse[1, :, 3:]).all() and torch.isfinite(lse[0]).all()
    assert (O[1, :, :3] == 0).all()
    dq, dk, dv = torch.autograd.grad(loss(O, lse), (q, k, v))
    assert not any(t.isnan().any() for t in (dq, dk, dv))
    assert (dq[1, :, :3] == 0).all() and (dk[1, :, 2:] == 0).all() and (dv[1, :, 2:] == 0).all()
    O_ref, lse_ref = rule(q, k, v, lengths)
    torch.testing.assert_close(O, O_ref, atol=1e-12, rtol=0)
    assert_lse_equal(lse, lse_ref, 1e-12)


@pytest.mark.parametrize("attention", BACKENDS)
def test_top_left_keeps_offset_zero_for_every_element(attention):
    seen = _probe_visible(attention, 3, 6, [6, 2], causal=True, causal_align="top_left")
    for b, L in enumerate((6, 2)):
        assert torch.equal(seen[b], rule_visible(3, 6, L, causal_align="top_left"))


@pytest.mark.parametrize("backend", ["query_major", "key_major", "dense"])
def test_forward_mode_ad_aligns_each_element_to_its_own_length(backend):
    """``torch.func.jvp`` runs the tiled forward-mode path (``reference/forward_ad.py``) on the CPU backends."""
    g = torch.Generator().manual_seed(7)
    primals = tuple(torch.randn(2, 2, n, 3, generator=g, dtype=torch.float64) for n in (5, 8, 8))
    tangents = tuple(torch.randn_like(t) for t in primals)
    lengths = torch.tensor([8, 3])
    kw = {"window": (2, 0), "causal_align": "bottom_right", "seqlens_k": lengths}
    out, t_out = torch.func.jvp(lambda q, k, v: fa.flash_attention(q, k, v, **kw, backend=backend), primals, tangents)
    want, t_want = torch.func.jvp(lambda q, k, v: rule(q, k, v, lengths, causal=False, window=(2, 0))[0], primals,
                                  tangents)  # fmt: skip
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(t_out, t_want, atol=1e-12, rtol=0)
    assert (t_out[1, :, :2] == 0).all()  # element 1: off_1 = -2, rows 0-1 see nothing


# ---------------------------------------------------------------------------------------------- tile plan


@settings(max_examples=60, deadline=None)
@given(
    N_q=st.integers(1, 20),
    N_k=st.integers(1, 20),
    data=st.data(),
    block_m=st.integers(1, 6),
    block_n=st.integers(1, 6),
    causal=st.booleans(),
    left=st.integers(-1, 6),
    right=st.integers(-1, 6),
)
def test_tiles_over_the_batch_are_the_union_of_each_element_s(N_q, N_k, data, block_m, block_n, causal, left, right):
    """A tile is SKIP over the batch iff every element sees nothing of it and FULL iff every element sees
    all of it; per element (``b=``) by that element's own visibility; the loops visit every tile some
    element sees part of, and their key and query ranges hold every visible key and row."""
    lengths = data.draw(st.lists(st.integers(0, N_k), min_size=1, max_size=4))
    B = len(lengths)
    q = torch.zeros(B, 1, N_q, 1)
    k = torch.zeros(B, 1, N_k, 1)
    opts = make_options(q, k, k, causal=causal, causal_align="bottom_right", window=(left, right),
                        seqlens_k=torch.tensor(lengths))  # fmt: skip
    window = (left, 0 if causal else right)
    seen = torch.stack([rule_visible(N_q, N_k, L, causal=causal, window=window) for L in lengths])  # (B, N_q, N_k)
    tiling = opts.mask.tiling(block_m, block_n)

    def kind(t):
        return TileKind.SKIP if not t.any() else TileKind.FULL if t.all() else TileKind.PARTIAL

    for i, (r0, r1) in enumerate(tiling.row_blocks):
        visited = set(tiling.key_blocks(i))
        for j, (c0, c1) in enumerate(tiling.col_blocks):
            tile = seen[:, r0:r1, c0:c1]
            assert tiling.kind(i, j) is kind(tile), (i, j)
            assert (j in visited) == bool(tile.any()), (i, j)
            for b in range(B):
                assert tiling.kind(i, j, b=b) is kind(tile[b]), (i, j, b)
                assert (j in tiling.key_blocks(i, b=b)) == bool(tile[b].any()), (i, j, b)
                assert (i in tiling.query_blocks(j, b=b)) == bool(tile[b].any()), (i, j, b)
        for b in [None, *range(B)]:
            rows = seen[:, r0:r1] if b is None else seen[b : b + 1, r0:r1]
            cols = rows.any(dim=0).any(dim=0).nonzero()
            lo, hi = opts.mask.key_range(r0, r1, b=b)
            assert all(lo <= c < hi for c in cols.flatten().tolist()), (r0, r1, b)
    for c0, c1 in tiling.col_blocks:
        for b in [None, *range(B)]:
            cols = seen[:, :, c0:c1] if b is None else seen[b : b + 1, :, c0:c1]
            lo, hi = opts.mask.query_range(c0, c1, b=b)
            assert all(lo <= r < hi for r in cols.any(dim=0).any(dim=1).nonzero().flatten().tolist()), (c0, b)


def test_explain_counts_the_tiles_of_each_element_s_diagonal():
    """N_q = N_k = 4 at 1 x 1 tiles, seqlens_k = [4, 2], causal: element 0 sees the lower triangle (10
    tiles), element 1 keys 0-1 from rows 2-3 (query 2 key 0, query 3 keys 0-1), inside it. So 10 tiles are
    visited, 6 skipped, and of the visited only the 3 both elements see whole are FULL."""
    q = torch.zeros(2, 1, 4, 1)
    opts = make_options(q, q, q, causal=True, causal_align="bottom_right", seqlens_k=torch.tensor([4, 2]))
    counts = opts.mask.tiling(1, 1).counts()
    assert counts[TileKind.SKIP] == 6 and counts[TileKind.FULL] == 3 and counts[TileKind.PARTIAL] == 7


# ------------------------------------------------------------------------------ decode rows and the replay


def test_one_query_per_head_folds_and_aligns_each_element(monkeypatch):
    """One new query, bottom-right causal: the row of element b sits at key L_b - 1 and sees all its keys,
    so the query heads fold into rows; a window (2, 0) then sees the last 3 of each element's keys."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 1, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 30, 8, generator=g, dtype=torch.float64) for _ in range(2))
    lengths = torch.tensor([30, 11])
    seen = []
    tiled = runner.TiledAttentionFunction.forward
    monkeypatch.setattr(
        runner.TiledAttentionFunction,
        "forward",
        staticmethod(lambda q, *a: seen.append(tuple(q.shape)) or tiled(q, *a)),
    )
    O = fa.flash_attention(q, k, v, causal=True, causal_align="bottom_right", seqlens_k=lengths, backend="query_major")
    assert seen == [(2, 2, 2, 8)]  # folded: G = 2 rows per key/value head
    torch.testing.assert_close(O, rule(q, k, v, lengths)[0], atol=1e-12, rtol=0)
    O = fa.flash_attention(
        q, k, v, window=(2, 0), causal_align="bottom_right", seqlens_k=lengths, backend="query_major"
    )
    torch.testing.assert_close(O, rule(q, k, v, lengths, causal=False, window=(2, 0))[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("batch_index", [0, 1])
def test_the_replay_follows_the_replayed_element_s_diagonal(batch_index):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 9, 3, generator=g, dtype=torch.float64) for _ in range(2))
    lengths = torch.tensor([9, 5])
    r = replay(q, k, v, block_m=2, block_n=2, query_block=1, causal=True, causal_align="bottom_right",
               seqlens_k=lengths, batch_index=batch_index)  # fmt: skip
    assert r.diagonal_offset == int(lengths[batch_index]) - 4
    want = rule(q[:, None], k[:, None], v[:, None], lengths)[0][batch_index, 0, 2:4]
    steps = list(r.steps)
    torch.testing.assert_close(steps[-1]["O_partial"], want, atol=1e-12, rtol=0)
    torch.testing.assert_close(r.steps.O_final, want, atol=1e-12, rtol=0)
    visited = {s.j for s in steps}  # key block j holds keys 2j, 2j + 1; rows 2-3 see keys <= 2 + off_b + 1
    assert visited == set(range((int(lengths[batch_index]) - 4 + 3) // 2 + 1))
