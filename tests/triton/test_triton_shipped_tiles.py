"""The shipped configurations (128 x 128 tiles and the like) against the float64 oracle, in the interpreter too.

The other interpreter tests use small uniform tiles to stay fast; these pass ``config=shipped_config(...)``
for every row of ``configs.shipped_configs`` on both GPU generations, so the tile-boundary logic users get
(ragged last query and key blocks, the causal diagonal crossing a tile, rows that see no key, a GQA group)
runs in CI. Rows added to the tables are picked up here without an edit. bf16 runs on a GPU only (the
interpreter gets its dots wrong); a configuration without backward kernels is checked forward only. The
first shape runs the deterministic two-kernel backward, the second the default one (one kernel with dQ by
atomics where the row has a ``backward_fused`` tile), so both backward tiles of a row run.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from _triton_cases import DEVICE, DTYPES, REL_TOL, assert_close_scaled

from flashattn_teach.masks.causal import causal_mask
from flashattn_teach.reference import dense_attention
from flashattn_teach.triton import AttentionConfig, shipped_config, triton_attention
from flashattn_teach.triton.configs import ARCHS, shipped_configs


@dataclass(frozen=True)
class Shape:
    H_kv: int
    group: int
    N_q: int
    N_k: int
    causal_align: str


# Lengths ragged against every shipped tile (16 to 128 rows); one shape per causal alignment.
SHAPES = {
    # N_q < N_k top-left: keys 140..199 are seen by no query, their dK, dV must be 0
    "top_left": Shape(H_kv=2, group=1, N_q=140, N_k=200, causal_align="top_left"),
    # N_q > N_k bottom-right: query rows 0..129 see no key (O = 0, lse = -inf), a whole block of 128 rows
    # among them; two query heads share K, V
    "bottom_right_gqa": Shape(H_kv=1, group=2, N_q=300, N_k=170, causal_align="bottom_right"),
}


def _configs() -> list[tuple[str, torch.dtype, int]]:
    """``(arch, dtype, padded head dim)`` of each distinct shipped configuration this machine can run."""
    seen: set[tuple[torch.dtype, int, AttentionConfig]] = set()
    rows = []
    for arch in ARCHS:
        for dtype, d, config in shipped_configs(arch):
            if dtype in DTYPES and (dtype, d, config) not in seen:
                seen.add((dtype, d, config))
                rows.append((arch, dtype, d))
    return rows


CONFIGS = _configs()


def _attention(fn, q, k, v, dO, dlse, shape: Shape, backward: bool, **kw):
    """``(O, lse, grads)`` of ``loss = sum(O * dO) + sum(lse * dlse)`` (grads None if not ``backward``)."""
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    O, lse = fn(q, k, v, causal=True, causal_align=shape.causal_align, enable_gqa=True, return_lse=True, **kw)
    if not backward:
        return O, lse, None
    finite_lse = torch.where(torch.isneginf(lse), 0.0, lse)
    ((O * dO.to(O.dtype)).sum() + (finite_lse * dlse.to(lse.dtype)).sum()).backward()
    return O.detach(), lse.detach(), (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize(("arch", "dtype", "d"), CONFIGS, ids=[f"{a}-{str(t)[6:]}-d{d}" for a, t, d in CONFIGS])
def test_shipped_config_matches_dense(arch: str, dtype: torch.dtype, d: int, shape_name: str) -> None:
    shape = SHAPES[shape_name]
    # a ragged head dim (3/4 of the padded one) for the second shape, so BLOCK_D > D is exercised too
    D = d if shape_name == "top_left" else d * 3 // 4
    config = shipped_config(D, dtype, arch)
    backward = config.backward_dkdv is not None and config.backward_dq is not None
    H_q = shape.H_kv * shape.group
    g = torch.Generator().manual_seed(d)
    q = torch.randn(1, H_q, shape.N_q, D, generator=g)
    k, v = (torch.randn(1, shape.H_kv, shape.N_k, D, generator=g) for _ in range(2))
    dO, dlse = torch.randn(1, H_q, shape.N_q, D, generator=g), torch.randn(1, H_q, shape.N_q, generator=g)
    low = [t.to(DEVICE, dtype) for t in (q, k, v)]

    deterministic = shape_name == "top_left"
    O, lse, grads = _attention(
        triton_attention, *low, dO.to(DEVICE), dlse.to(DEVICE), shape, backward, config=config,
        deterministic=deterministic,
    )  # fmt: skip
    ref_O, ref_lse, ref_grads = _attention(dense_attention, *(t.double().cpu() for t in low), dO, dlse, shape, backward)

    assert_close_scaled(O, ref_O, REL_TOL[dtype], "O")
    assert_close_scaled(lse, ref_lse, REL_TOL[torch.float32], "lse")
    # exactly: rows that see no key give O = 0 and lse = -inf; keys no row sees get dK = dV = 0, and
    # those rows dQ = 0
    seen = causal_mask(shape.N_q, shape.N_k, shape.causal_align).to(O.device)  # (N_q, N_k)
    rows, keys = ~seen.any(dim=1), ~seen.any(dim=0)
    assert (O[:, :, rows] == 0).all() and torch.isneginf(lse[:, :, rows]).all()
    if grads is not None and ref_grads is not None:
        for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
            assert a.dtype == dtype and a.shape == b.shape, f"{name}: {a.dtype} {tuple(a.shape)}"
            assert_close_scaled(a, b, 2 * REL_TOL[dtype], name)
        dq, dk, dv = grads
        assert (dq[:, :, rows] == 0).all() and (dk[:, :, keys] == 0).all() and (dv[:, :, keys] == 0).all()
