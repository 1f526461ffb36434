"""The Triton kernels honour the mask contract of :mod:`flashattn_teach.masks`: window (both causal
alignments, with and without causal), softcap, ALiBi, ``seqlens_k`` and ``attn_mask`` (bool or additive,
broadcast), alone and combined, forward and
backward, against the float64 dense oracle; their loop bounds visit no tile the contract skips and run
unmasked only tiles it calls full.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _triton_cases import DEVICE, REL_TOL, assert_close_scaled  # noqa: E402
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from triton import language as tl  # noqa: E402

import flashattn_teach as fa  # noqa: E402
from flashattn_teach._validate.inputs import AttentionShapes  # noqa: E402
from flashattn_teach.masks.causal import TileKind  # noqa: E402
from flashattn_teach.masks.spec import MaskSpec  # noqa: E402
from flashattn_teach.reference import dense_attention  # noqa: E402
from flashattn_teach.triton import AttentionConfig, triton_attention  # noqa: E402
from flashattn_teach.triton.kernels.masking import _window_key_range, _window_query_range  # noqa: E402

# ------------------------------------------------------------------------------------------ loop bounds


@triton.jit
def _window_ranges_probe(
    KEY_RANGE,  # (cdiv(N_q, BLOCK_M), 4) int32: begin, full_begin, full_end, end of query block i
    QUERY_RANGE,  # (cdiv(N_k, BLOCK_N), 4) int32: the same of key block j
    N_q,
    N_k,
    OFFSET,
    LEFT,
    RIGHT,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M < N_q:
        begin, full_begin, full_end, end = _window_key_range(
            block * BLOCK_M, N_k, OFFSET, LEFT, RIGHT, BLOCK_M, BLOCK_N
        )
        tl.store(KEY_RANGE + block * 4, begin)
        tl.store(KEY_RANGE + block * 4 + 1, full_begin)
        tl.store(KEY_RANGE + block * 4 + 2, full_end)
        tl.store(KEY_RANGE + block * 4 + 3, end)
    if block * BLOCK_N < N_k:
        begin, full_begin, full_end, end = _window_query_range(
            block * BLOCK_N, N_q, OFFSET, LEFT, RIGHT, BLOCK_M, BLOCK_N
        )
        tl.store(QUERY_RANGE + block * 4, begin)
        tl.store(QUERY_RANGE + block * 4 + 1, full_begin)
        tl.store(QUERY_RANGE + block * 4 + 2, full_end)
        tl.store(QUERY_RANGE + block * 4 + 3, end)


def _spec(N_q: int, N_k: int, causal: bool, causal_align: str, window: tuple[int, int]) -> MaskSpec:
    s = AttentionShapes(batch=(), H_q=1, H_kv=1, N_q=N_q, N_k=N_k, D=16, D_v=16, rank=2, scale=0.25)
    return MaskSpec.build(s, torch.float32, causal=causal, causal_align=causal_align, window=window)


def _sees(spec: MaskSpec, r0: int, r1: int, c0: int, c1: int) -> bool:
    """Some row of ``[r0, r1)`` (existing or not) sees some key of ``[c0, c1)`` that exists."""
    lo = -(10**9) if spec.left < 0 else None
    for r in range(r0, r1):
        first = lo if lo is not None else r + spec.offset - spec.left
        last = 10**9 if spec.right < 0 else r + spec.offset + spec.right
        if max(first, c0) <= min(last, c1 - 1, spec.shapes.N_k - 1):
            return True
    return False


@settings(max_examples=100, deadline=None)  # cheap: the probe is scalar arithmetic
@given(
    N_q=st.integers(1, 90),
    N_k=st.integers(1, 90),
    causal_align=st.sampled_from(["top_left", "bottom_right"]),
    causal=st.booleans(),
    left=st.integers(-1, 40),
    right=st.integers(-1, 40),
    BM=st.sampled_from([16, 32]),
    BN=st.sampled_from([16, 32]),
)
def test_window_loop_bounds_visit_every_visible_tile_and_unmask_only_full_ones(
    N_q: int, N_k: int, causal_align: str, causal: bool, left: int, right: int, BM: int, BN: int
) -> None:
    from flashattn_teach.triton.variants import KernelVariants

    spec = _spec(N_q, N_k, causal, causal_align, (left, right))
    kv = KernelVariants.from_spec(spec)
    # a window that is only causal, (-1, 0) with causal=True, runs the causal stages: no window bounds to probe
    assume(kv.window)
    key_range = torch.zeros(triton.cdiv(N_q, BM), 4, dtype=torch.int32, device=DEVICE)
    query_range = torch.zeros(triton.cdiv(N_k, BN), 4, dtype=torch.int32, device=DEVICE)
    grid = (max(len(key_range), len(query_range)),)
    _window_ranges_probe[grid](key_range, query_range, N_q, N_k, spec.offset, kv.left, kv.right, BLOCK_M=BM, BLOCK_N=BN)

    for i, (begin, full_begin, full_end, end) in enumerate(key_range.tolist()):  # query block i
        r0, r1 = i * BM, min((i + 1) * BM, N_q)
        assert 0 <= begin <= full_begin <= full_end <= end <= N_k
        assert begin == end or begin % BN == 0
        for c0 in range(full_begin, full_end, BN):  # unmasked: whole key blocks, FULL for the block's rows
            assert c0 + BN <= N_k and spec.structure_kind(r0, r1, c0, c0 + BN) is TileKind.FULL
        for c0 in range(0, N_k, BN):  # never visited: no row of the block sees a key of these
            c1 = min(c0 + BN, N_k)
            if not begin <= c0 < end:
                assert spec.structure_kind(r0, r1, c0, c1) is TileKind.SKIP, (i, c0)
            else:  # visited: some row of the block, counting rows past N_q, sees one of its keys
                assert _sees(spec, i * BM, (i + 1) * BM, c0, c1), (i, c0)

    for j, (begin, full_begin, full_end, end) in enumerate(query_range.tolist()):  # key block j
        c0, c1 = j * BN, min((j + 1) * BN, N_k)
        assert 0 <= begin <= full_begin <= full_end <= end <= N_q
        assert begin == end or begin % BM == 0
        for r0 in range(full_begin, full_end, BM):  # unmasked: whole query blocks of existing rows
            assert full_begin % BM == 0 and r0 + BM <= N_q
            assert spec.structure_kind(r0, r0 + BM, c0, c1) is TileKind.FULL
        for r0 in range(0, N_q, BM):
            r1 = min(r0 + BM, N_q)
            if r1 <= begin or r0 >= end:
                assert spec.structure_kind(r0, r1, c0, c1) is TileKind.SKIP, (j, r0)


# ------------------------------------------------------------------------------ values and gradients


TILES_16 = AttentionConfig.uniform(16, 16)


@dataclass(frozen=True)
class VariantCase:
    """One call: shapes, and the keyword arguments both the kernels and the oracle take."""

    N_q: int = 37
    N_k: int = 53
    B: int = 1
    H_kv: int = 1
    group: int = 2
    D: int = 16
    config: AttentionConfig = TILES_16
    options: dict = field(default_factory=dict)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(0)
        H_q = self.H_kv * self.group
        q = torch.randn(self.B, H_q, self.N_q, self.D, generator=g)
        k = torch.randn(self.B, self.H_kv, self.N_k, self.D, generator=g)
        v = torch.randn(self.B, self.H_kv, self.N_k, self.D, generator=g)
        dO = torch.randn(self.B, H_q, self.N_q, self.D, generator=g)
        return q, k, v, dO


def _slopes(*shape: int) -> torch.Tensor:
    return torch.linspace(0.05, 0.6, int(torch.tensor(shape).prod())).reshape(shape)


def _masks() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    padding = torch.ones(2, 1, 1, 53, dtype=torch.bool)
    padding[0, ..., :10] = False  # left padding
    padding[1] = False  # a batch element with no key at all
    scattered = torch.rand(2, 2, 37, 53, generator=g) > 0.4
    scattered[1, 0, 5:9] = False  # rows that see nothing
    scattered[0, 1, :16, 16:32] = False  # a fully masked tile
    additive = torch.randn(37, 53, generator=g)
    additive[3:7] = float("-inf")
    additive[:, 20:36] = float("-inf")
    return padding, scattered, additive


PADDING, SCATTERED, ADDITIVE = _masks()

CASES = {
    "window_top_left": VariantCase(options={"window": (5, 3)}),
    "window_left_only": VariantCase(options={"window": (9, -1), "causal_align": "bottom_right"}),
    "window_right_only": VariantCase(options={"window": (-1, 4)}),
    "window_causal_top_left": VariantCase(options={"window": (6, 2), "causal": True}),
    "window_causal_bottom_right": VariantCase(
        options={"window": (20, 7), "causal": True, "causal_align": "bottom_right"}
    ),
    # N_q > N_k, bottom_right: the first rows' windows lie left of key 0, so they see nothing
    "window_empties_rows": VariantCase(N_q=53, N_k=37, options={"window": (3, 0), "causal_align": "bottom_right"}),
    "softcap": VariantCase(options={"softcap": 1.5}),
    "alibi_per_head": VariantCase(options={"alibi_slopes": _slopes(2), "causal": True}),
    "alibi_per_batch_and_head": VariantCase(
        B=2, options={"alibi_slopes": _slopes(2, 2), "causal_align": "bottom_right", "causal": True}
    ),
    "softcap_alibi_negative_scale": VariantCase(options={"softcap": 2.0, "alibi_slopes": _slopes(2), "scale": -0.4}),
    "softcap_alibi_window_causal": VariantCase(
        config=AttentionConfig.uniform(32, 16),
        options={"softcap": 3.0, "alibi_slopes": _slopes(2), "window": (11, 0), "causal": True},
    ),
    # a zero length empties every row of its batch element; 21 cuts a key block
    "seqlens_k": VariantCase(B=3, options={"seqlens_k": torch.tensor([0, 21, 53])}),
    "seqlens_k_causal_empties_rows": VariantCase(
        B=2,
        N_q=53,
        N_k=37,
        options={"seqlens_k": torch.tensor([37, 5]), "causal": True, "causal_align": "bottom_right"},
    ),
    # a padding mask (B, 1, 1, N_k), as a Hugging Face model builds it: left padding of 10 and 0 keys
    "bool_mask_padding": VariantCase(
        B=2, options={"attn_mask": PADDING, "causal": True, "causal_align": "bottom_right"}
    ),
    # a mask of every score's own, with rows it empties and a fully masked tile
    "bool_mask_full": VariantCase(B=2, options={"attn_mask": SCATTERED}),
    "additive_mask_softcap_window": VariantCase(
        options={"attn_mask": ADDITIVE, "softcap": 2.0, "window": (9, 4), "alibi_slopes": _slopes(2)}
    ),
    "gqa_everything": VariantCase(
        B=2,
        H_kv=2,
        group=3,
        options={
            "seqlens_k": torch.tensor([30, 53]),
            "window": (8, 8),
            "softcap": 2.5,
            "alibi_slopes": _slopes(2, 6),
            "causal_align": "bottom_right",
        },
    ),
}


def _run(f, c: VariantCase, q, k, v, dO) -> tuple[torch.Tensor, ...]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    O, lse = f(q, k, v, enable_gqa=True, return_lse=True, **c.options)
    (O * dO.to(O.dtype)).sum().backward()
    return O, lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("name", list(CASES))
def test_variant_matches_the_dense_oracle_values_lse_and_gradients(name: str) -> None:
    c = CASES[name]
    q, k, v, dO = c.tensors()
    dtype = torch.float32
    got = _run(
        lambda *a, **kw: triton_attention(*a, config=c.config, **kw), c, *(t.to(DEVICE, dtype) for t in (q, k, v, dO))
    )
    want = _run(dense_attention, c, *(t.double() for t in (q, k, v, dO)))
    for what, a, b in zip(("O", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert a.shape == b.shape, what
        assert_close_scaled(a, b, 2 * REL_TOL[dtype], f"{name} {what}")


def test_rows_that_see_nothing_give_zero_output_minus_inf_lse_and_zero_gradients() -> None:
    c = CASES["seqlens_k_causal_empties_rows"]
    q, k, v, dO = (t.to(DEVICE) for t in c.tensors())
    O, lse, dq, dk, dv = _run(lambda *a, **kw: triton_attention(*a, config=c.config, **kw), c, q, k, v, dO)
    # batch element 1 has 5 keys; bottom_right aligns it to its own length, putting row i's diagonal at key
    # i + 5 - 53 = i - 48: rows < 48 see nothing
    assert torch.isneginf(lse[1, :, :48]).all() and torch.isfinite(lse[1, :, 48:]).all()
    assert (O[1, :, :48] == 0).all() and (dq[1, :, :48] == 0).all()
    assert (dk[1, :, 5:] == 0).all() and (dv[1, :, 5:] == 0).all()  # keys past the length


# --------------------------------------------------------------------------------------------- routing


def test_triton_backend_runs_the_variants_and_masks() -> None:
    q = torch.randn(1, 2, 20, 16, device=DEVICE)
    slopes = _slopes(2).to(DEVICE)
    mask = torch.rand(20, 20, device=DEVICE) > 0.3
    options = {"window": (4, 0), "softcap": 5.0, "alibi_slopes": slopes, "attn_mask": mask}
    got = fa.flash_attention(q, q, q, backend="triton", **options)
    want = dense_attention(q.double(), q.double(), q.double(), **options)
    assert_close_scaled(got, want, REL_TOL[torch.float32], "flash_attention(backend='triton')")
    plan = str(fa.explain(q, q, q, attn_mask=mask, window=(4, 0), backend="triton"))
    assert plan.startswith("triton: requested explicitly; forward "), plan
    assert "backward: " in plan  # which one: test_triton_backward_fused.py
