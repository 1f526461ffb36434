"""Bad ``block_table``, ``cache_leftpad`` or ``sinks`` to ``flash_attention_with_kvcache`` fail loudly, name
the argument and the shapes, and a refused call writes nothing into the pools."""

from __future__ import annotations

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach.errors import BackendUnavailableError

from paged_cases import PagedCase, make_problem

# lengths [13, 0, 29] and one new key: L_b = [14, 1, 30], 11 pages of 3 slots per row (N_max = 33), 36 pages
CASE = PagedCase(
    page_size=3, variant="plain", H_q=4, H_kv=2, N_new=1, N_new_kv=1, num_splits=2, flash_attn_layout=False
)


def _args(**changes):
    p = make_problem(CASE)
    args = {
        "q": p.q,
        "k_cache": p.k_pool,
        "v_cache": p.v_pool,
        "k": p.k,
        "v": p.v,
        "cache_seqlens": torch.tensor(CASE.lengths, dtype=torch.int32),
        "block_table": p.block_table,
    }
    args.update(changes)
    return args


def _table(edit):
    t = make_problem(CASE).block_table.clone()
    edit(t)
    return t


B, MAX_BLOCKS = 3, make_problem(CASE).block_table.shape[1]
NUM_BLOCKS = make_problem(CASE).k_pool.shape[0]


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def _pool(page_size, width):
    return torch.zeros(NUM_BLOCKS, CASE.H_kv, page_size, width, dtype=torch.float64)


def _set(b, p, value):
    return _table(lambda t: t.__setitem__((b, p), value))


I32 = torch.int32
TABLE = r"\(3, max_blocks\)"


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    [
        ({"block_table": [[0, 1]]}, TypeError, rf"block_table must be an int32 torch.Tensor of shape {TABLE}"),
        ({"block_table": torch.zeros(B, MAX_BLOCKS)}, TypeError, "block_table must be int32 .or int64.,"),
        ({"block_table": torch.zeros(MAX_BLOCKS, dtype=I32)}, ValueError, rf"block_table must have shape {TABLE}"),
        ({"block_table": torch.zeros(2, MAX_BLOCKS, dtype=I32)}, ValueError, r"got \(2, \d+\)"),
        ({"block_table": torch.zeros(B, MAX_BLOCKS, dtype=I32, device="meta")}, ValueError, "block_table is on meta"),
        ({"block_table": _set(2, 1, -1)}, ValueError, r"block_table\[2, 1\] = -1 is not a page"),
        ({"block_table": _set(0, 0, NUM_BLOCKS)}, ValueError, rf"\[0, num_blocks\) = \[0, {NUM_BLOCKS}\)"),
        ({"block_table": _set(0, 4, 10**6)}, ValueError, r"block_table\[0, 4\] = 1000000.*pages \[0, 5\)"),
        ({"block_table": _table(lambda t: None)[:, :2]}, ValueError, r"\[0, 6\] \(N_max = block_table.shape\[1\] \*"),
        ({"cache_seqlens": _i32(13, 0, 33)}, ValueError, r"cache_seqlens\[2\] = 33 leaves no room.*N_max = 33"),
        ({"v_cache": _pool(4, CASE.D_v)}, ValueError, "num_blocks, H_kv and page_size"),
        ({"k_cache": _pool(0, CASE.D), "v_cache": _pool(0, CASE.D_v)}, ValueError, "page_size must be at least 1"),
        ({"k_cache": _pool(3, CASE.D)[..., 0]}, ValueError, r"k_cache must have shape \(num_blocks, H_kv, page_size"),
        ({"q": torch.zeros(2, 4, 1, CASE.D, dtype=torch.float64)}, ValueError, "batch size B"),
        ({"cache_leftpad": _i32(0, 0, 30)}, ValueError, r"cache_leftpad\[2\] = 30 must lie in \[0, cache_seqlens"),
        ({"cache_leftpad": _i32(-1, 0, 0)}, ValueError, r"cache_leftpad\[0\] = -1"),
        ({"cache_leftpad": _i32(0, 0)}, ValueError, r"cache_leftpad must have shape \(3,\)"),
        ({"cache_leftpad": torch.tensor([0.0, 0, 0])}, TypeError, "cache_leftpad must be int32"),
        ({"cache_leftpad": 2}, TypeError, "cache_leftpad must be an int32 torch.Tensor"),
        ({"sinks": torch.zeros(3, dtype=torch.float64)}, ValueError, r"sinks must have shape \(4,\)"),
        ({"sinks": torch.zeros(4, dtype=torch.int64)}, TypeError, "sinks must be floating-point"),
        ({"sinks": [0.0] * 4}, TypeError, "sinks must be a torch.Tensor"),
    ],
)  # fmt: skip
def test_bad_paged_input_names_the_argument_and_writes_nothing(changes, error, words):
    args = _args(**changes)
    k_before, v_before = args["k_cache"].clone(), args["v_cache"].clone()
    with pytest.raises(error, match=words) as info:
        fa.flash_attention_with_kvcache(**args)
    assert isinstance(info.value, fa.AttentionError)
    assert torch.equal(args["k_cache"], k_before) and torch.equal(args["v_cache"], v_before)


def test_leftpad_and_sinks_work_without_a_block_table():
    """``cache_leftpad`` and ``sinks`` on contiguous caches: the paged call's result on the same keys."""
    p = make_problem(CASE)
    pad = torch.tensor([2, 0, 5], dtype=torch.int32)
    sinks = torch.randn(CASE.H_q, dtype=torch.float64)
    lengths = torch.tensor(CASE.lengths, dtype=torch.int32)
    L_max = p.block_table.shape[1] * CASE.page_size
    # the pools laid out contiguously, (B, H_kv, N_max, D): page p of row b at [p * page_size, ...)
    ids = p.block_table.long().clamp(0, p.k_pool.shape[0] - 1)
    k_cache, v_cache = (pool[ids].transpose(1, 2).reshape(B, CASE.H_kv, L_max, -1) for pool in (p.k_pool, p.v_pool))
    O_paged = fa.flash_attention_with_kvcache(
        p.q, p.k_pool, p.v_pool, cache_seqlens=lengths, block_table=p.block_table, cache_leftpad=pad, sinks=sinks
    )
    O = fa.flash_attention_with_kvcache(p.q, k_cache, v_cache, cache_seqlens=lengths, cache_leftpad=pad, sinks=sinks)
    torch.testing.assert_close(O, O_paged, atol=1e-14, rtol=1e-14)
    O_no_pad = fa.flash_attention_with_kvcache(p.q, k_cache, v_cache, cache_seqlens=lengths, sinks=sinks)
    assert (O_no_pad[0] - O[0]).abs().max() > 1e-3  # the control: the padding hides keys


def test_backend_triton_refuses_float64_pages_before_writing():
    """float64: the kernel's dtypes refuse it, before the write (the kernel on pages, padding and sinks:
    tests/triton/test_triton_paged.py)."""
    p = make_problem(CASE, dtype=torch.float64)
    before = p.k_pool.clone()
    with pytest.raises(BackendUnavailableError):
        fa.flash_attention_with_kvcache(
            p.q, p.k_pool, p.v_pool, p.k, p.v, cache_seqlens=torch.tensor(CASE.lengths), block_table=p.block_table,
            backend="triton",
        )  # fmt: skip
    assert torch.equal(p.k_pool, before)
