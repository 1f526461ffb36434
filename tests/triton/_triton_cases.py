"""Shared pieces of the Triton tests: the device, dtypes, tolerances and a hypothesis strategy for shapes.

Without CUDA the kernels run in the Triton interpreter on CPU tensors (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``); with CUDA the same tests compile and run them for real, bf16 included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from flashattn_teach.triton import AttentionConfig

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# bf16 is stored as raw integers in the interpreter, so its dots come out wrong there: GPU only.
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if ON_GPU else [])]
# Error allowed against the float64 oracle on the same (already rounded) inputs, relative to max(1, |ref|).
# The kernels round P (and dS) to the input dtype before the tensor-core matmuls, and round outputs.
REL_TOL = {torch.float32: 2e-4 if not ON_GPU else 1e-3, torch.float16: 5e-3, torch.bfloat16: 4e-2}
# Tiles of different shapes, so that no code path may assume BLOCK_M == BLOCK_N or a divisible N.
CONFIGS = [AttentionConfig.uniform(32, 16), AttentionConfig.uniform(16, 32), AttentionConfig.uniform(32, 32)]


@dataclass(frozen=True)
class Case:
    B: int
    H_kv: int
    group: int
    N_q: int
    N_k: int
    D: int
    D_v: int
    causal: bool
    causal_align: str
    dtype: torch.dtype
    config: AttentionConfig

    @property
    def H_q(self) -> int:
        return self.H_kv * self.group

    def tensors(self, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(self.B, self.H_q, self.N_q, self.D, generator=g)
        k = torch.randn(self.B, self.H_kv, self.N_k, self.D, generator=g)
        v = torch.randn(self.B, self.H_kv, self.N_k, self.D_v, generator=g)
        return tuple(t.to(DEVICE, self.dtype) for t in (q, k, v))


# The strategy's sizes are bounded by what the interpreter pays for: one program per (batch, query head, query
# block), each looping over key blocks. B * H_q <= MAX_HEADS keeps every B, H_kv and group value, and every
# pair of them; the combination it leaves out, two batches of two grouped KV heads, is pinned below
# (``WIDE_GQA``), as are a length past three tiles of the largest tile (``LONG``) and, for the backward, rows
# that see no key (``EMPTY_ROWS``).
MAX_HEADS = 6


@st.composite
def cases(draw, max_n: int = 64) -> Case:
    """Ragged lengths, N_q != N_k, both causal alignments, GQA/MQA, head dims that are not powers of two."""
    D = draw(st.sampled_from([16, 24, 40, 64]))
    group = draw(st.integers(1, 3))
    H_kv = draw(st.integers(1, 2))
    return Case(
        B=draw(st.integers(1, max(1, min(2, MAX_HEADS // (H_kv * group))))),
        H_kv=H_kv,
        group=group,
        N_q=draw(st.integers(1, max_n)),
        N_k=draw(st.integers(1, max_n)),
        D=D,
        D_v=draw(st.sampled_from([D, D, 32])),
        causal=draw(st.booleans()),
        causal_align=draw(st.sampled_from(["top_left", "bottom_right"])),
        dtype=draw(st.sampled_from(DTYPES)),
        config=draw(st.sampled_from(CONFIGS)),
    )


# B = 2 with two KV heads of three query heads each (12 programs a query block), ragged, causal bottom-right
WIDE_GQA = Case(2, 2, 3, 17, 33, 24, 32, True, "bottom_right", torch.float32, CONFIGS[0])
# Causal bottom-right with N_q > N_k: the first 30 rows of each head see no key (O = 0, lse = -inf, dQ = 0)
EMPTY_ROWS = Case(2, 1, 3, 50, 20, 40, 32, True, "bottom_right", torch.float16, CONFIGS[1])
# Lengths past three 32 x 32 tiles: the unmasked stage loops, the diagonal crosses several blocks
LONG = Case(1, 1, 1, 97, 100, 40, 40, True, "top_left", torch.float16, CONFIGS[2])


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    """``max |actual - expected| <= rel * max(1, max |expected|)``, comparing -inf entries exactly."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), f"{what}: -inf in different places"
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    finite = torch.isfinite(expected)
    err = (actual[finite] - expected[finite]).abs().max().item() if finite.any() else 0.0
    bound = rel * max(1.0, expected[finite].abs().max().item() if finite.any() else 0.0)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"
