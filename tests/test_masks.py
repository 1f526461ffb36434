"""The mask contract (window, softcap, ALiBi, seqlens_k, attn_mask) on the dense oracle and the tiled references.

Every path is checked against ``formula``, written here from flash-attn's definitions with plain torch ops
over the whole score matrix (it shares no code with ``masks.py``), and the dense oracle against torch's
SDPA given the equivalent dense float mask where SDPA can express it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import flashattn_teach as fa
from flashattn_teach import online_softmax
from flashattn_teach._options import make_options
from flashattn_teach.masks.causal import TileKind
from flashattn_teach.masks.spec import Tiling
from flashattn_teach.reference import dense_attention, flash_backward, key_major_attention, online_attention

from attention_strategies import Problem, parallel_attention, problems

NEG_INF = float("-inf")


TILED = [
    pytest.param(online_attention, id="query_major"),
    pytest.param(key_major_attention, id="key_major"),
    pytest.param(parallel_attention, id="parallel"),
]
ALL = [*TILED, pytest.param(dense_attention, id="dense")]


def formula(q, k, v, *, causal=False, causal_align="top_left", window=None, softcap=None, alibi_slopes=None,
            seqlens_k=None, attn_mask=None, **_):  # fmt: skip
    """``(O, lse)`` by the definitions, float64, 4-D inputs ``(B, H, N, D)`` with ``H_kv`` dividing ``H_q``."""
    q, k, v = q.double(), k.double(), v.double()
    B, H_q, N_q, D = q.shape
    N_k = k.shape[-2]
    k = k.repeat_interleave(H_q // k.shape[1], dim=1)
    v = v.repeat_interleave(H_q // v.shape[1], dim=1)
    S = torch.einsum("bhid,bhjd->bhij", q, k) / D**0.5
    if softcap is not None:
        S = softcap * torch.tanh(S / softcap)
    off = 0 if causal_align == "top_left" else N_k - N_q
    if seqlens_k is not None and causal_align == "bottom_right":
        off = (seqlens_k - N_q).reshape(-1, 1, 1, 1)  # flash-attn: each batch element aligned to its own length
    i = torch.arange(N_q)[:, None]
    j = torch.arange(N_k)[None, :]
    seen = torch.ones(B, H_q, N_q, N_k, dtype=torch.bool)
    if causal:
        seen &= j <= i + off
    if window is not None:
        left, right = window
        if left >= 0:
            seen &= j >= i + off - left
        if right >= 0:
            seen &= j <= i + off + right
    if seqlens_k is not None:
        seen &= j < seqlens_k[:, None, None, None]
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().reshape(-1, H_q, 1, 1)  # (1 or B, H_q, 1, 1)
        S = S - slopes * (i + off - j).abs()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            seen &= attn_mask
        else:
            S = S + attn_mask.double()
    S = S.masked_fill(~seen, NEG_INF)
    empty = torch.isneginf(S).all(dim=-1, keepdim=True)  # rows that see no key: O = 0, lse = -inf
    S = S.masked_fill(empty, 0.0)
    P = torch.softmax(S, dim=-1).masked_fill(empty, 0.0)
    lse = torch.logsumexp(S, dim=-1).masked_fill(empty[..., 0], NEG_INF)
    return P @ v, lse


@st.composite
def masked_problems(draw, dtype=torch.float64, requires_grad=False):
    """A :class:`Problem` and a random mix of the mask options, including rows and tiles that see nothing."""
    p: Problem = draw(problems(dtype, requires_grad=requires_grad))
    B, H_q, N_q = p.q.shape[:3]
    N_k = p.k.shape[-2]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    opts: dict = {}
    if draw(st.booleans()):
        opts["window"] = (draw(st.integers(-1, 6)), draw(st.integers(-1, 6)))
    if draw(st.booleans()):
        opts["softcap"] = draw(st.floats(0.25, 4.0))
    slopes = draw(st.sampled_from([None, (H_q,), (B, H_q)]))
    if slopes is not None:
        opts["alibi_slopes"] = torch.rand(*slopes, generator=g, dtype=dtype)
    if draw(st.booleans()):
        opts["seqlens_k"] = torch.tensor(draw(st.lists(st.integers(0, N_k), min_size=B, max_size=B)))
    kind = draw(st.sampled_from([None, "bool", "float", "zero float"]))
    if kind is not None:
        shape = draw(st.sampled_from([(B, 1, N_q, N_k), (N_q, N_k), (1, H_q, 1, N_k), (B, H_q, N_q, N_k)]))
        seen = torch.rand(*shape, generator=g) < draw(st.sampled_from([0.2, 0.6, 1.0]))
        # A rectangle that sees nothing: whole tiles (and maybe rows) hidden.
        r0, c0 = draw(st.integers(0, shape[-2])), draw(st.integers(0, shape[-1]))
        seen[..., r0 : r0 + draw(st.integers(0, 9)), c0 : c0 + draw(st.integers(0, 9))] = False
        if kind == "bool":
            opts["attn_mask"] = seen
        else:
            bias = (
                torch.zeros(shape, dtype=dtype)
                if kind == "zero float"
                else torch.randn(shape, generator=g, dtype=dtype)
            )
            opts["attn_mask"] = bias.masked_fill(~seen, NEG_INF)
    return p, opts


def assert_lse_equal(lse, ref, atol):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    finite = ~torch.isneginf(ref)
    torch.testing.assert_close(lse[finite].double(), ref[finite], atol=atol, rtol=0)


def loss(O, lse):
    """A loss through ``O`` and the finite ``lse``: rows that see no key carry no lse gradient."""
    w = torch.linspace(-1, 1, O.shape[-1], dtype=O.dtype)
    return (O * w).sum() + torch.where(torch.isneginf(lse), 0.0, lse).sum()


# ------------------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("attention", ALL)
@settings(max_examples=30)
@given(case=masked_problems(torch.float64, requires_grad=True))
def test_matches_the_formula_for_any_mask_float64(attention, case):
    """Window, causal in both alignments, softcap, ALiBi, seqlens_k and attn_mask, alone and together:
    values and the gradients of q, k, v, tiles of any size."""
    p, opts = case
    tiles = {} if attention is dense_attention else p.tiles
    O, lse = attention(p.q, p.k, p.v, return_lse=True, **p.kwargs, **opts, **tiles)
    O_ref, lse_ref = formula(p.q, p.k, p.v, **p.kwargs, **opts)
    torch.testing.assert_close(O, O_ref, atol=1e-12, rtol=0)
    assert_lse_equal(lse, lse_ref, 1e-12)
    grads = torch.autograd.grad(loss(O, lse), (p.q, p.k, p.v))
    refs = torch.autograd.grad(loss(O_ref, lse_ref), (p.q, p.k, p.v))
    for name, got, ref in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0, msg=f"d{name}")


@pytest.mark.parametrize("attention", TILED)
@settings(max_examples=25)
@given(case=masked_problems(torch.float32, requires_grad=True))
def test_matches_the_float64_formula_for_any_mask_float32(attention, case):
    p, opts = case
    O, lse = attention(p.q, p.k, p.v, return_lse=True, **p.kwargs, **opts, **p.tiles)
    assert O.dtype == torch.float32
    q, k, v = (t.detach().double().requires_grad_() for t in (p.q, p.k, p.v))
    wide = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in opts.items()}
    O_ref, lse_ref = formula(q, k, v, **p.kwargs, **wide)
    torch.testing.assert_close(O.double(), O_ref, atol=2e-5, rtol=0)
    assert_lse_equal(lse, lse_ref, 2e-5)
    grads = torch.autograd.grad(loss(O, lse), (p.q, p.k, p.v))
    refs = torch.autograd.grad(loss(O_ref, lse_ref), (q, k, v))
    for name, got, ref in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(got.double(), ref, atol=2e-4, rtol=0, msg=f"d{name}")


@settings(max_examples=20)
@given(case=masked_problems(torch.float64))
def test_flash_backward_matches_the_formula_for_any_mask(case):
    p, opts = case
    O, lse = online_attention(p.q, p.k, p.v, return_lse=True, **p.kwargs, **opts, **p.tiles)
    dO = torch.randn_like(O)
    grads = flash_backward(p.q, p.k, p.v, O, lse, dO, **p.kwargs, **opts, **p.tiles)
    q, k, v = (t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v))
    refs = torch.autograd.grad(formula(q, k, v, **p.kwargs, **opts)[0], (q, k, v), dO)
    for name, got, ref in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0, msg=f"d{name}")


@settings(max_examples=20)
@given(case=masked_problems(torch.float64))
def test_dense_matches_torch_sdpa_given_the_equivalent_float_mask(case):
    """Window, causal, seqlens_k and ALiBi written as one additive mask for torch (softcap has no SDPA form)."""
    p, opts = case
    opts.pop("softcap", None)
    B, H_q, N_q = p.q.shape[:3]
    N_k = p.k.shape[-2]
    with torch.no_grad():
        i, j = torch.arange(N_q)[:, None], torch.arange(N_k)[None, :]
        bias = torch.zeros(B, H_q, N_q, N_k, dtype=torch.float64)
        seen = formula_visible(p, opts, i, j)
        if "alibi_slopes" in opts:
            off = diagonal(p, opts)
            bias = bias - opts["alibi_slopes"].reshape(-1, H_q, 1, 1) * (i + off - j).abs()
        m = opts.get("attn_mask")
        if m is not None and m.dtype != torch.bool:
            bias = bias + m
        bias = bias.masked_fill(~seen, NEG_INF)
    kv_heads = H_q // p.k.shape[1]
    expected = F.scaled_dot_product_attention(
        p.q, p.k.repeat_interleave(kv_heads, 1), p.v.repeat_interleave(kv_heads, 1), attn_mask=bias
    )
    got = dense_attention(p.q, p.k, p.v, **p.kwargs, **opts)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def diagonal(p, opts):
    """:func:`formula`'s diagonal offset: 0, ``N_k - N_q``, or ``seqlens_k[b] - N_q`` per batch element."""
    N_q, N_k = p.q.shape[-2], p.k.shape[-2]
    if p.causal_align == "top_left":
        return 0
    if "seqlens_k" in opts:
        return (opts["seqlens_k"] - N_q).reshape(-1, 1, 1, 1)
    return N_k - N_q


def formula_visible(p, opts, i, j):
    """The bool visibility of :func:`formula`, for the SDPA comparison."""
    B, H_q, N_q = p.q.shape[:3]
    N_k = p.k.shape[-2]
    off = diagonal(p, opts)
    seen = torch.ones(B, H_q, N_q, N_k, dtype=torch.bool)
    if p.causal:
        seen &= j <= i + off
    left, right = opts.get("window", (-1, -1))
    if left >= 0:
        seen &= j >= i + off - left
    if right >= 0:
        seen &= j <= i + off + right
    if "seqlens_k" in opts:
        seen &= j < opts["seqlens_k"][:, None, None, None]
    m = opts.get("attn_mask")
    if m is not None:
        seen &= m if m.dtype == torch.bool else ~torch.isneginf(m)
    return seen


@pytest.mark.parametrize("causal_align", ["top_left", "bottom_right"])
def test_causal_is_the_window_with_right_side_zero(causal_align):
    q, k, v = (torch.randn(2, 3, n, 4, dtype=torch.float64) for n in (7, 11, 11))
    a = online_attention(q, k, v, causal=True, causal_align=causal_align, block_m=3, block_n=4)
    b = online_attention(q, k, v, window=(-1, 0), causal_align=causal_align, block_m=3, block_n=4)
    c = online_attention(q, k, v, causal=True, window=(-1, 5), causal_align=causal_align, block_m=3, block_n=4)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(a, c, atol=0, rtol=0)


def test_a_window_without_causal_is_not_mistaken_for_plain_attention():
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    assert "window read tile by tile" in fa.explain(q, k, v, window=(-1, 0)).reason
    assert "window" not in fa.explain(q, k, v, window=(-1, 0), is_causal=True).reason  # this one is just causal
    for backend in ("parallel", "online", "key_major", "dense"):
        got = fa.flash_attention(q, k, v, window=(-1, 0), backend=backend)
        torch.testing.assert_close(got, formula(q, k, v, causal=True)[0], msg=backend)


def test_jvp_through_a_window_softcap_and_alibi_matches_the_dense_oracle():
    g = torch.Generator().manual_seed(3)
    q, k, v, tq, tk, tv = (torch.randn(1, 2, 9, 4, dtype=torch.float64, generator=g) for _ in range(6))
    kw = dict(window=(2, 1), softcap=1.5, alibi_slopes=torch.tensor([0.3, 0.7], dtype=torch.float64))
    _, t_tiled = torch.func.jvp(lambda *a: online_attention(*a, **kw, block_m=2, block_n=3), (q, k, v), (tq, tk, tv))
    _, t_dense = torch.func.jvp(lambda *a: dense_attention(*a, **kw), (q, k, v), (tq, tk, tv))
    torch.testing.assert_close(t_tiled, t_dense, atol=1e-12, rtol=0)


# ------------------------------------------------------------------------------------------------- tiles


def count_score_tiles(monkeypatch):
    """Patch the references to record ``(Br, Bc, masked)`` of every score tile they compute: ``score_tile``
    for the query-major and key-major loops, ``Tiling.head_tile`` for the parallel path's per-head loops."""
    visited: list[tuple[int, int, bool]] = []
    original = online_softmax.score_tile

    def counting(q_i, k_j, scale, allowed=None, **variants):
        visited.append((q_i.shape[-2], k_j.shape[-2], allowed is not None))
        return original(q_i, k_j, scale, allowed, **variants)

    head_tile = Tiling.head_tile

    def counting_head_tile(self, i, j, rows, **where):
        allowed, bias = head_tile(self, i, j, rows, **where)
        c0, c1 = self.col_blocks[j]
        visited.append((rows[1] - rows[0], c1 - c0, allowed is not None))
        return allowed, bias

    monkeypatch.setattr(online_softmax, "score_tile", counting)
    monkeypatch.setattr(Tiling, "head_tile", counting_head_tile)
    return visited


def needed_tiles(seen, block_m, block_n):
    """Independent count from the whole visibility matrix: (tiles some row sees, tiles every row sees)."""
    N_q, N_k = seen.shape[-2:]
    some = every = 0
    for r0 in range(0, N_q, block_m):
        for c0 in range(0, N_k, block_n):
            t = seen[..., r0 : r0 + block_m, c0 : c0 + block_n]
            some += bool(t.any())
            every += bool(t.all())
    return some, every


@pytest.mark.parametrize("attention", TILED)
@pytest.mark.parametrize(
    "window, causal_align", [((8, 0), "top_left"), ((3, 5), "bottom_right"), ((0, -1), "top_left")]
)
def test_window_tiles_outside_are_never_visited_and_inside_run_unmasked(attention, window, causal_align, monkeypatch):
    visited = count_score_tiles(monkeypatch)
    N_q, N_k, block_m, block_n = 40, 50, 4, 6
    q, k, v = (torch.randn(1, 1, n, 4) for n in (N_q, N_k, N_k))
    attention(q, k, v, window=window, causal_align=causal_align, block_m=block_m, block_n=block_n)
    i, j = torch.arange(N_q)[:, None], torch.arange(N_k)[None, :]
    off = 0 if causal_align == "top_left" else N_k - N_q
    left, right = window
    seen = (j >= i + off - left) if left >= 0 else torch.ones(N_q, N_k, dtype=torch.bool)
    if right >= 0:
        seen &= j <= i + off + right
    some, every = needed_tiles(seen, block_m, block_n)
    assert len(visited) == some
    assert sum(not masked for _, _, masked in visited) == every


def test_a_window_visits_scores_linear_in_n(monkeypatch):
    """Window w: O(N (w + Bc)) scores; doubling N doubles them (the full matrix would quadruple)."""
    visited = count_score_tiles(monkeypatch)
    scores = []
    for N in (256, 512):
        visited.clear()
        q = torch.randn(1, 1, N, 4)
        online_attention(q, q, q, window=(16, 0), block_m=16, block_n=16)
        scores.append(sum(br * bc for br, bc, _ in visited))
    # Each query block of 16 rows sees its own key block and the one before: 2 tiles (1 for the first).
    assert scores == [(2 * N // 16 - 1) * 16 * 16 for N in (256, 512)]
    assert scores[1] < 2.1 * scores[0]  # and the whole matrix would be 256^2 = 65536, then 4x that


def test_padding_and_a_mask_skip_the_tiles_nobody_sees(monkeypatch):
    visited = count_score_tiles(monkeypatch)
    N, block = 32, 8
    q, k, v = (torch.randn(2, 2, N, 4) for _ in range(3))
    mask = torch.ones(2, 1, N, N, dtype=torch.bool)
    mask[:, :, :, 16:] = False  # key blocks 2 and 3 hidden from every row
    mask[:, :, 8:16, :8] = False  # and tile (1, 0)
    online_attention(q, k, v, seqlens_k=torch.tensor([30, 12]), attn_mask=mask, block_m=block, block_n=block)
    # Key blocks 0 and 1 for every query block, less tile (1, 0); key block 1 is partial under seqlens 12.
    assert len(visited) == 4 * 2 - 1
    # Key block 1 carries a mask in all four query blocks (batch 1 sees keys 8-11 of it); key block 0 none.
    assert sum(masked for _, _, masked in visited) == 4


def test_tile_kinds_per_batch_element_and_head():
    q = torch.randn(2, 2, 16, 4)
    mask = torch.ones(2, 2, 16, 16, dtype=torch.bool)
    mask[1, 0, :, :8] = False  # batch 1, head 0 sees nothing of key block 0
    opts = make_options(q, q, q, seqlens_k=torch.tensor([16, 4]), attn_mask=mask)
    tiling = opts.mask.tiling(8, 8)
    assert tiling.kind(0, 1, b=0, h=0) is TileKind.FULL
    assert tiling.kind(0, 1, b=1, h=1) is TileKind.SKIP  # past batch 1's 4 keys
    assert tiling.kind(0, 0, b=1, h=1) is TileKind.PARTIAL  # keys 0-3 of 8
    assert tiling.kind(0, 0, b=1, h=0) is TileKind.SKIP  # hidden by the mask
    assert tiling.kind(0, 1) is TileKind.PARTIAL  # over the whole batch: some see all of it, some none


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor any torch op allocates (views of an op's inputs are not allocations)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        storages = {a.untyped_storage().data_ptr() for a in inputs}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("option", ["attn_mask", "window", "seqlens_k", "alibi_slopes"])
def test_no_n_by_n_tensor_besides_the_users_mask(option):
    N, block = 256, 32
    q, k, v = (torch.randn(1, 1, N, 4) for _ in range(3))
    mask = torch.rand(1, 1, N, N) > 0.5
    value = {
        "attn_mask": mask,
        "window": (16, 16),
        "seqlens_k": torch.tensor([200]),
        "alibi_slopes": torch.tensor([0.5]),
    }[option]
    with LargestTensor() as probe:
        online_attention(q, k, v, **{option: value}, block_m=block, block_n=block)
    assert probe.largest <= N * block  # a key block's column of the mask at most; the score tile is smaller
    with LargestTensor() as probe:
        dense_attention(q, k, v, **{option: value})
    assert probe.largest >= N * N  # the probe sees the dense oracle's score matrix


# --------------------------------------------------------------------------------------------------- API


@pytest.mark.parametrize("kind", ["bool", "float min", "float -inf"])
def test_a_left_padded_batch_with_a_hugging_face_mask_runs_tiled_and_matches_torch(kind):
    """The 4-D mask a Hugging Face decoder builds for left padding: (B, 1, N_q, N_k), causal and padding."""
    B, H, N, D = 3, 4, 37, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    pad = torch.tensor([0, 5, 20])  # left padding per sequence
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    seen = (j <= i) & (j >= pad[:, None, None, None])  # (B, 1, N, N)
    if kind == "bool":
        mask = seen
    else:
        hidden = torch.finfo(q.dtype).min if kind == "float min" else NEG_INF
        mask = torch.zeros(B, 1, N, N).masked_fill(~seen, hidden)
    plan = fa.explain(q, k, v, attn_mask=mask)
    assert plan.backend != "dense" and "skipped" in plan.reason
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    got = fa.scaled_dot_product_attention(*ours, attn_mask=mask)
    expected = F.scaled_dot_product_attention(*theirs, attn_mask=mask)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=0)
    dO = torch.randn(got.shape, generator=g)
    for name, a, b in zip(
        "qkv", torch.autograd.grad(got, ours, dO), torch.autograd.grad(expected, theirs, dO), strict=True
    ):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0, msg=f"d{name}")


def test_triton_takes_the_variants_and_refuses_a_mask_that_requires_grad():
    q = torch.randn(1, 1, 5, 16)
    assert fa.explain(q, q, q, window=(2, 0), softcap=3.0, backend="triton").backend == "triton"
    assert fa.explain(q, q, q, seqlens_k=torch.tensor([3]), backend="triton").backend == "triton"
    with pytest.raises(NotImplementedError, match="attn_mask requires grad"):
        fa.explain(q, q, q, attn_mask=torch.zeros(5, 5, requires_grad=True), backend="triton")
    p = fa.explain(q, q, q, window=(1, 0))  # five query rows: the wide key tiles of a few-row call (dispatch.tiles)
    assert p.backend == "parallel" and "1 tile of 1024 x 2048: 0 visited whole, 1 visited with a tile mask" in p.reason


def test_a_mask_that_requires_grad_runs_dense_and_gets_its_gradient():
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    mask = torch.zeros(5, 5, dtype=torch.float64, requires_grad=True)
    assert fa.explain(q, q, q, attn_mask=mask).backend == "dense"
    fa.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum().backward()
    assert mask.grad is not None


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(window=(-2, 0)), ValueError, r"window left must be -1 \(unbounded\) or at least 0, got -2"),
        (dict(window=(0, -5)), ValueError, "window right"),
        (dict(window=3), TypeError, "window must be a pair"),
        (dict(window=(1.5, 0)), TypeError, "window left must be an int"),
        (dict(softcap=-1.0), ValueError, "softcap must be a finite number > 0"),
        (dict(softcap=-1e-3), ValueError, "softcap"),
        (dict(softcap=float("inf")), ValueError, "softcap"),
        (dict(softcap=float("nan")), ValueError, "softcap"),
        (dict(softcap="1"), TypeError, "softcap must be a real number"),
        (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(2, 4\) or \(4,\)"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.int64)), TypeError, "alibi_slopes must be floating-point"),
        (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a torch.Tensor"),
        (dict(seqlens_k=torch.tensor([1, 2, 3])), ValueError, r"seqlens_k must have the batch shape \(2,\)"),
        (dict(seqlens_k=torch.tensor([1.0, 2.0])), TypeError, "seqlens_k must be int32 or int64"),
        (dict(seqlens_k=torch.tensor([1, 7])), ValueError, r"seqlens_k must lie in \[0, N_k\] = \[0, 6\]"),
        (dict(seqlens_k=torch.tensor([-1, 2])), ValueError, "seqlens_k must lie in"),
    ],
)
def test_bad_mask_options_are_named(kwargs, error, match):
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8)
    with pytest.raises(error, match=match) as info:
        fa.flash_attention(q, k, k, **kwargs)
    assert isinstance(info.value, fa.AttentionError)


def test_the_parallel_path_skips_each_batch_elements_padding(monkeypatch):
    """Per head, not over the whole batch: a padded element visits only its own keys' tiles."""
    visited = count_score_tiles(monkeypatch)
    q = torch.randn(2, 1, 32, 4)
    lengths = torch.tensor([32, 8])
    parallel_attention(q, q, q, seqlens_k=lengths, block_m=8, block_n=8)
    assert len(visited) == 4 * 4 + 4 * 1  # batch 0: all 16 tiles; batch 1: key block 0 of each query block
    visited.clear()
    online_attention(q, q, q, seqlens_k=lengths, block_m=8, block_n=8)
    assert len(visited) == 16  # the query-major reference runs the batch together: the union of both


@pytest.mark.parametrize("attention", ALL)
@pytest.mark.parametrize("batch", [(), (2, 3)], ids=["rank 3", "rank 5"])
@pytest.mark.parametrize("causal_align", ["top_left", "bottom_right"])
def test_batch_shapes_other_than_one_dim_map_each_option_to_its_element(attention, batch, causal_align):
    """seqlens_k has the batch shape, slopes (*batch, H_q), the mask broadcasts: checked through the formula
    on the same problem flattened to (B, H, N, D)."""
    g = torch.Generator().manual_seed(5)
    H, N_q, N_k = 2, 7, 9
    q, k, v = (torch.randn(*batch, H, n, 4, generator=g, dtype=torch.float64) for n in (N_q, N_k, N_k))
    lengths = torch.randint(0, N_k + 1, batch, generator=g)
    slopes = torch.rand(*batch, H, generator=g, dtype=torch.float64)
    mask = torch.rand(*batch[:1], *(1,) * len(batch[1:]), 1, N_q, N_k, generator=g) > 0.3
    kw = dict(window=(3, 2), softcap=2.0, alibi_slopes=slopes, seqlens_k=lengths, attn_mask=mask)
    kw["causal_align"] = causal_align  # bottom_right: the window follows each element's length
    tiles = {} if attention is dense_attention else dict(block_m=3, block_n=4)
    O, lse = attention(q, k, v, return_lse=True, **kw, **tiles)
    flat = math.prod(batch)
    O_ref, lse_ref = formula(
        *(t.reshape(flat, H, -1, 4) for t in (q, k, v)),
        window=(3, 2),
        causal_align=causal_align,
        softcap=2.0,
        alibi_slopes=slopes.reshape(flat, H),
        seqlens_k=lengths.reshape(flat),
        attn_mask=mask.expand(*batch, 1, N_q, N_k).reshape(flat, 1, N_q, N_k),
    )
    torch.testing.assert_close(O.reshape(O_ref.shape), O_ref, atol=1e-12, rtol=0)
    assert_lse_equal(lse.reshape(lse_ref.shape), lse_ref, 1e-12)


@pytest.mark.parametrize("attention", ALL)
@pytest.mark.parametrize("causal_align", ["top_left", "bottom_right"])
def test_two_dimensional_inputs_take_a_scalar_length_and_one_slope(attention, causal_align):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(n, 4, generator=g, dtype=torch.float64) for n in (6, 8, 8))
    kw = dict(window=(2, -1), alibi_slopes=torch.tensor([0.4], dtype=torch.float64), seqlens_k=torch.tensor(5))
    kw["causal_align"] = causal_align
    tiles = {} if attention is dense_attention else dict(block_m=4, block_n=3)
    O = attention(q, k, v, **kw, **tiles)
    O_ref, _ = formula(q[None, None], k[None, None], v[None, None], **{**kw, "seqlens_k": torch.tensor([5])})
    torch.testing.assert_close(O, O_ref[0, 0], atol=1e-12, rtol=0)
