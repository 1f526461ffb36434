"""bench_attention.py's ``triton-ptr`` and ``triton-nows`` providers build a configuration the library accepts
for every sm_90 16-bit row of the benchmark's grid (no GPU needed: configurations are data). Built by
replacing a field, ``replace(forward, ws=False)``, they kept a TMA fallback that ``KernelConfig`` refuses,
and raised on every such row."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from flashattn_teach.errors import AttentionValueError
from flashattn_teach.triton import shipped_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_attention

GRID = bench_attention.parse_args([])  # the full grid: bf16 and fp16, head dims 64, 128, 256
ROWS = [(getattr(torch, bench_attention.DTYPES[dt]), d) for dt in GRID.dtypes for d in GRID.head_dims]


@pytest.mark.parametrize(("dtype", "head_dim"), ROWS, ids=[f"{dt}-d{d}".replace("torch.", "") for dt, d in ROWS])
def test_the_fallback_providers_build_a_valid_config_for_every_sm90_row(dtype: torch.dtype, head_dim: int) -> None:
    shipped = shipped_config(head_dim, dtype, "sm90")
    nows = bench_attention.provider_config("triton-nows", head_dim, dtype, "sm90")
    ptr = bench_attention.provider_config("triton-ptr", head_dim, dtype, "sm90")
    # the forward without warp specialisation is the shipped forward's fallback tile (or itself, unspecialised)
    assert not nows.forward.ws
    want = shipped.forward.fallback if shipped.forward.ws and shipped.forward.fallback else shipped.forward
    assert (nows.forward.BLOCK_M, nows.forward.BLOCK_N, nows.forward.num_warps) == (
        want.BLOCK_M,
        want.BLOCK_N,
        want.num_warps,
    )
    # through pointers: neither TMA nor warp specialisation, and no fallback of its own
    assert not ptr.forward.tma and not ptr.forward.ws and ptr.forward.fallback is None
    for config in (nows, ptr):
        dataclasses.replace(config.forward)  # KernelConfig's checks run again, and pass
        assert (config.backward_dkdv, config.backward_dq, config.backward_fused) == (
            shipped.backward_dkdv,
            shipped.backward_dq,
            shipped.backward_fused,
        )


def test_replacing_the_ws_field_is_what_was_refused() -> None:
    """The old construction, on the hd64 row: the reason the providers now ask the configuration instead."""
    forward = shipped_config(64, torch.bfloat16, "sm90").forward
    assert forward.ws and forward.fallback is not None and forward.fallback.tma
    with pytest.raises(AttentionValueError, match="fallback"):
        dataclasses.replace(forward, ws=False)


def test_an_unknown_provider_name_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="triton-nows"):
        bench_attention.provider_config("triton-fast", 64, torch.bfloat16, "sm90")
