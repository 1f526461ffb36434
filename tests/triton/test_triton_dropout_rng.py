"""The kernels' dropout draw equals the CPU references' bit for bit (the same Philox counters and key)."""

from __future__ import annotations

import pytest
import torch
import triton
from triton import language as tl

from flashattn_teach import dropout as dp
from flashattn_teach.triton.devices import device_reason
from flashattn_teach.triton.kernels.dropout import _dropout_keep


@triton.jit
def _write_keep(OUT, seed, offset, bh, r0, c0, N_q, N_k, threshold, BM: tl.constexpr, BN: tl.constexpr):
    """The keep mask of the (BM, BN) tile at rows r0.., columns c0.., as int8."""
    offs_m = r0 + tl.arange(0, BM)
    offs_n = c0 + tl.arange(0, BN)
    keep = _dropout_keep(seed, offset, bh, offs_m, offs_n, N_q, N_k, threshold)
    tl.store(OUT + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :], keep.to(tl.int8))


@pytest.mark.parametrize(
    ("bh", "r0", "c0", "N_q", "N_k", "p", "seed", "offset"),
    [
        (0, 0, 0, 16, 32, 0.5, 1, 0),
        (5, 16, 32, 37, 53, 0.1, 2**61 + 12345, 7),
        (2, 8, 0, 70000, 70000, 0.9, 42, 0),  # counters past 2^32: the high word matters
    ],
)
def test_triton_keep_mask_equals_torch_bit_for_bit(bh, r0, c0, N_q, N_k, p, seed, offset):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(16, 32, dtype=torch.int8, device=device)
    if (reason := device_reason(out)) is not None:
        pytest.skip(reason)
    key = dp.DropoutKey(p=p, seed=seed, offset=offset)
    _write_keep[(1,)](out, seed, offset, bh, r0, c0, N_q, N_k, key.threshold, BM=16, BN=32)
    rows = torch.arange(r0, r0 + 16)[:, None]
    cols = torch.arange(c0, c0 + 32)[None, :]
    expected = dp.keep_mask(key, dp.counters(key, bh, rows, cols, N_q, N_k))
    assert 0 < int(expected.sum()) < expected.numel()  # a mask with both kinds, so equality means something
    assert torch.equal(out.cpu().bool(), expected)
