"""No N_q x N_k tensor on the tiled paths: a window, key padding and packed sequences hold none at all, and
an ``attn_mask`` call holds none besides the user's own mask, forward and backward.

The probe is a ``TorchDispatchMode`` that sees every tensor any torch op returns and records the largest one
the op allocated (an output sharing storage with one of the op's inputs is a view, not an allocation; so
views of the user's mask are not counted, and neither are views of ``q, k, v``). Dispatch modes are per
thread, so the parallel path is run inline, in the calling thread: the same tile loops its pool runs.
The tiles are made small (``TILES``) so that a short sequence already spans many of them and the test
stays quick (and ops run on one thread, which allocates the same tensors and does not stall on a busy
machine); the loops are the same at any tile size. Two controls show that the probe would see an N x N
tensor if one were there (the dense backend, on the same calls) and that it does see the tiled paths' own
score tiles.
"""

from __future__ import annotations

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach.dispatch import planner
from flashattn_teach.reference import parallel

from allocation_probe import LargestAllocation

# backend -> (loop order, block_m, block_n), in the form of planner.TILED
TILES = {"query_major": ("query_major", 32, 64), "key_major": ("key_major", 32, 64), "parallel": ("parallel", 64, 32)}
N_Q, N_K = 384, 384
H, D = 2, 8
TILED = list(TILES)


def _inputs(B: int, N_q: int = N_Q, N_k: int = N_K):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, N_q, D, generator=g).requires_grad_()
    k, v = (torch.randn(B, H, N_k, D, generator=g).requires_grad_() for _ in range(2))
    return q, k, v


def _window(backend):
    q, k, v = _inputs(1)
    return (q, k, v), fa.flash_attention(q, k, v, causal=True, window=(16, 0), backend=backend)


def _padding(backend):
    q, k, v = _inputs(2)
    lengths = torch.tensor([N_K - 90, N_K // 3])
    return (q, k, v), fa.flash_attention(q, k, v, seqlens_k=lengths, backend=backend)


def _varlen(backend):
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 60, (2 * N_Q // 30,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    total = int(cu[-1])
    q, k, v = (torch.randn(total, H, D, generator=g).requires_grad_() for _ in range(3))
    top = int(lengths.max())
    O = fa.flash_attention_varlen(q, k, v, cu, cu, top, top, causal=True, backend=backend)
    return (q, k, v), O


CALLS = {"window": _window, "seqlens_k padding": _padding, "varlen": _varlen}


def _scores(qkv) -> int:
    """N_q x N_k of a call: the packed length squared for varlen."""
    q, k, _ = qkv
    return q.shape[-2] * k.shape[-2] if q.dim() == 4 else q.shape[0] * k.shape[0]


def _probe(run, backend):
    """The largest tensor allocated by the call and its backward."""
    with LargestAllocation() as probe:
        qkv, O = run(backend)
        O.sum().backward()
    return qkv, probe.largest


@pytest.fixture(autouse=True)
def _small_tiles_and_parallel_inline(monkeypatch):
    for backend, tiles in TILES.items():
        monkeypatch.setitem(planner.TILED, backend, tiles)
    monkeypatch.setattr(parallel, "MIN_PARALLEL_SCORES", 2**62)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("backend", TILED)
def test_window_padding_and_varlen_allocate_nothing_n_by_n(call, backend):
    qkv, largest = _probe(CALLS[call], backend)
    assert largest < _scores(qkv)
    _, block_m, block_n = TILES[backend]
    assert largest >= block_m * block_n  # the probe does see the call's own work: a score tile


@pytest.mark.parametrize("call", list(CALLS))
def test_the_probe_sees_the_dense_backend_hold_n_by_n(call):
    qkv, largest = _probe(CALLS[call], "dense")
    assert largest >= _scores(qkv)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("backend", [*TILED, "dense"])
def test_an_attn_mask_call_allocates_nothing_n_by_n_besides_the_users_mask(kind, backend):
    q, k, v = _inputs(1)
    g = torch.Generator().manual_seed(2)
    seen = torch.rand(N_Q, N_K, generator=g) < 0.7
    mask = seen if kind == "bool" else torch.zeros(N_Q, N_K).masked_fill(~seen, float("-inf"))
    with LargestAllocation() as probe:
        fa.flash_attention(q, k, v, attn_mask=mask, backend=backend).sum().backward()
    if backend == "dense":
        assert probe.largest >= N_Q * N_K  # the control: the dense path's scores
    else:
        _, block_m, block_n = TILES[backend]
        assert block_m * block_n <= probe.largest < N_Q * N_K
