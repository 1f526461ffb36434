"""The threaded CPU path (``reference/parallel.py``) against the float64 dense oracle and the references it
parallelises, and checks that its thread pool is used, and left, as documented."""

from __future__ import annotations

import math
import os
import signal
import threading
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flashattn_teach._options import make_options
from flashattn_teach.core import online_softmax as osm
from flashattn_teach.reference import dense_attention, parallel, workers
from flashattn_teach.reference.backward import backward_grouped
from flashattn_teach.reference.parallel import parallel_backward, parallel_forward
from flashattn_teach.reference.query_major import query_major_forward

LENGTHS = st.one_of(st.integers(1, 40), st.sampled_from([1, 7, 13, 31, 37, 64]))
MAX_TILES = 600  # per example, all heads together: keeps each example to milliseconds
BLOCKS = st.one_of(st.integers(1, 9), st.sampled_from([16, 64]))


@dataclass
class Grouped:
    """A problem in the grouped layout: q ``(B, H_kv, G, N_q, D)``, k, v ``(B, H_kv, 1, N_k, .)``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    causal_align: str
    block_m: int
    block_n: int
    workers: int

    @property
    def kwargs(self) -> dict:
        return dict(
            scale=self.q.shape[-1] ** -0.5,
            causal=self.causal,
            causal_align=self.causal_align,
            block_m=self.block_m,
            block_n=self.block_n,
        )


def single_threaded(q, k, v, *, scale, causal, causal_align, block_m, block_n) -> dict:
    """The keyword arguments of the loops (``query_major_forward``, ``backward_grouped`` and their parallel
    twins): the scale and the call's tiling, built from flat arguments as ``make_options`` builds them."""
    opts = make_options(q, k, v, causal=causal, causal_align=causal_align, scale=scale)
    return dict(scale=scale, tiling=opts.mask.tiling(block_m, block_n))


def make_grouped(B, H_kv, G, N_q, N_k, D, D_v, *, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_kv, G, N_q, D, generator=g, dtype=dtype)
    k = torch.randn(B, H_kv, 1, N_k, D, generator=g, dtype=dtype)
    v = torch.randn(B, H_kv, 1, N_k, D_v, generator=g, dtype=dtype)
    return q, k, v


@st.composite
def grouped_problems(draw, dtype=torch.float64) -> Grouped:
    """Batches, GQA groups (G = 1..4 over 1-2 key/value heads), N_q != N_k, ragged tiles, 1-3 workers."""
    shape = (
        draw(st.integers(1, 2)),  # B
        draw(st.integers(1, 2)),  # H_kv
        draw(st.integers(1, 4)),  # G
        draw(LENGTHS),  # N_q
        draw(LENGTHS),  # N_k
        draw(st.integers(1, 9)),  # D
        draw(st.integers(1, 9)),  # D_v
    )
    B, H_kv, G, N_q, N_k = shape[:5]
    block_m, block_n = draw(BLOCKS), draw(BLOCKS)
    assume(B * H_kv * G * math.ceil(N_q / block_m) * math.ceil(N_k / block_n) <= MAX_TILES)
    q, k, v = make_grouped(*shape, dtype=dtype, seed=draw(st.integers(0, 2**31 - 1)))
    return Grouped(
        q,
        k,
        v,
        causal=draw(st.booleans()),
        causal_align=draw(st.sampled_from(["top_left", "bottom_right"])),
        block_m=block_m,
        block_n=block_n,
        workers=draw(st.sampled_from([1, 2, 3])),
    )


def pool_for_any_size():
    """Send even tiny problems to the pool, so that the small examples exercise the threaded split."""
    return mock.patch.object(parallel, "MIN_PARALLEL_SCORES", 0)


def dense_grouped(q, k, v, *, scale, causal, causal_align, **_):
    """The dense oracle on grouped inputs: ``(O, lse)`` in the grouped layout."""
    B, H_kv, G, N_q, D = q.shape
    O, lse = dense_attention(
        q.reshape(B, H_kv * G, N_q, D),
        k.squeeze(2),
        v.squeeze(2),
        scale=scale,
        causal=causal,
        causal_align=causal_align,
        enable_gqa=True,
        return_lse=True,
    )
    return O.reshape(B, H_kv, G, N_q, -1), lse.reshape(B, H_kv, G, N_q)


def dense_grads_grouped(q, k, v, dO, dlse, **kwargs):
    """``dq, dk, dv`` of ``sum(O * dO) + sum(lse * dlse)`` by autograd through the dense oracle (rows with
    ``lse = -inf`` carry no lse gradient)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    O, lse = dense_grouped(q, k, v, **kwargs)
    loss = (O * dO).sum() + (torch.where(torch.isneginf(lse), 0.0, lse) * dlse).sum()
    return torch.autograd.grad(loss, (q, k, v))


def assert_lse_equal(lse, ref, atol):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    finite = ~torch.isneginf(ref)
    torch.testing.assert_close(lse[finite], ref[finite], atol=atol, rtol=0)


# ------------------------------------------------------------------------------------ the in-place update


@given(
    Br=st.integers(1, 9),
    Bc=st.integers(1, 9),
    D_v=st.integers(1, 5),
    first=st.booleans(),
    masked=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_update_inplace_matches_update(Br, Bc, D_v, first, masked, seed):
    """Also for masked tiles: -inf entries, rows with every key masked, on top of a state that has seen no key."""
    g = torch.Generator().manual_seed(seed)
    if first:  # the state before any key
        m_i, l_i, acc = osm.init_state((Br,), D_v, dtype=torch.float64, device="cpu")
    else:
        m_i = torch.randn(Br, generator=g, dtype=torch.float64)
        l_i = torch.rand(Br, generator=g, dtype=torch.float64) + 0.5
        acc = torch.randn(Br, D_v, generator=g, dtype=torch.float64)
    S_ij = 3 * torch.randn(Br, Bc, generator=g, dtype=torch.float64)
    S_ij.masked_fill_(torch.rand(Br, Bc, generator=g) < masked, osm.NEG_INF)
    v_j = torch.randn(Bc, D_v, generator=g, dtype=torch.float64)
    expected = osm.update(m_i, l_i, acc, S_ij, v_j)
    osm.update_(m_i, l_i, acc, S_ij, v_j)
    for got, want in zip((m_i, l_i, acc), expected, strict=True):
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, want, atol=1e-13, rtol=1e-13)


# ------------------------------------------------------------------------------------------------ forward


@given(p=grouped_problems(torch.float64))
def test_parallel_forward_matches_dense_and_query_major_for_any_split_float64(p):
    with pool_for_any_size():
        O, lse = parallel_forward(p.q, p.k, p.v, **single_threaded(p.q, p.k, p.v, **p.kwargs), workers=p.workers)
    O_ref, lse_ref = dense_grouped(p.q, p.k, p.v, **p.kwargs)
    O_qm, lse_qm = query_major_forward(p.q, p.k, p.v, **single_threaded(p.q, p.k, p.v, **p.kwargs))
    assert O.shape == O_ref.shape and lse.shape == lse_ref.shape and O.dtype == torch.float64
    torch.testing.assert_close(O, O_ref, atol=1e-12, rtol=0)
    assert_lse_equal(lse, lse_ref, 1e-12)
    torch.testing.assert_close(O, O_qm, atol=1e-14, rtol=0)
    assert_lse_equal(lse, lse_qm, 1e-13)


@settings(max_examples=25)
@given(p=grouped_problems(torch.float32))
def test_parallel_forward_matches_float64_oracle_float32(p):
    with pool_for_any_size():
        O, lse = parallel_forward(p.q, p.k, p.v, **single_threaded(p.q, p.k, p.v, **p.kwargs), workers=p.workers)
    O_ref, lse_ref = dense_grouped(p.q.double(), p.k.double(), p.v.double(), **p.kwargs)
    assert O.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(O.double(), O_ref, atol=2e-5, rtol=0)
    assert_lse_equal(lse.double(), lse_ref, 2e-5)


@settings(max_examples=20)
@given(p=grouped_problems(torch.float64), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_large_logits_stay_finite_and_exact(p, dtype):
    """Scores stretched to |S| ~ 1e4: exp(S) would overflow, exp(S - m) does not."""
    S = p.q @ p.k.mT * p.kwargs["scale"]  # (B, H_kv, G, N_q, D) @ (B, H_kv, 1, D, N_k) -> (.., N_q, N_k)
    c = (1e4 / S.abs().max().clamp_min(1e-3)).sqrt()
    q, k = p.q * c, p.k * c
    with pool_for_any_size():
        qd, kd, vd = q.to(dtype), k.to(dtype), p.v.to(dtype)
        O, lse = parallel_forward(qd, kd, vd, **single_threaded(qd, kd, vd, **p.kwargs), workers=p.workers)
    O_ref, lse_ref = dense_grouped(q, k, p.v, **p.kwargs)
    assert torch.isfinite(O).all() and not torch.isnan(lse).any()
    atol = 1e-9 if dtype == torch.float64 else 5e-2  # float32 rounds a score of 1e4 by ~1e-3
    torch.testing.assert_close(O.double(), O_ref, atol=atol, rtol=0)
    assert_lse_equal(lse.double(), lse_ref, atol * 1e4)


# ----------------------------------------------------------------------------------------------- backward


@settings(max_examples=30)
@given(p=grouped_problems(torch.float64), with_dlse=st.booleans())
def test_parallel_backward_matches_dense_autograd_and_backward_grouped_float64(p, with_dlse):
    O, lse = dense_grouped(p.q, p.k, p.v, **p.kwargs)
    g = torch.Generator().manual_seed(0)
    dO = torch.randn(O.shape, generator=g, dtype=O.dtype)
    dlse = torch.randn(lse.shape, generator=g, dtype=lse.dtype) if with_dlse else None
    with pool_for_any_size():
        grads = parallel_backward(
            p.q, p.k, p.v, O, lse, dO, dlse, **single_threaded(p.q, p.k, p.v, **p.kwargs), workers=p.workers
        )
    refs = dense_grads_grouped(p.q, p.k, p.v, dO, torch.zeros_like(lse) if dlse is None else dlse, **p.kwargs)
    same_loops = backward_grouped(p.q, p.k, p.v, O, lse, dO, dlse, **single_threaded(p.q, p.k, p.v, **p.kwargs))
    for name, got, ref, other in zip("qkv", grads, refs, same_loops, strict=True):
        assert got.shape == ref.shape, name
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10, msg=f"d{name} vs dense")
        torch.testing.assert_close(got, other, atol=1e-13, rtol=1e-13, msg=f"d{name} vs backward_grouped")


@settings(max_examples=15)
@given(p=grouped_problems(torch.float32))
def test_parallel_backward_matches_float64_autograd_float32(p):
    O, lse = parallel_forward(p.q, p.k, p.v, **single_threaded(p.q, p.k, p.v, **p.kwargs), workers=1)
    g = torch.Generator().manual_seed(0)
    dO, dlse = torch.randn(O.shape, generator=g), torch.randn(lse.shape, generator=g)
    with pool_for_any_size():
        grads = parallel_backward(
            p.q, p.k, p.v, O, lse, dO, dlse, **single_threaded(p.q, p.k, p.v, **p.kwargs), workers=p.workers
        )
    q64, k64, v64 = (t.double() for t in (p.q, p.k, p.v))
    refs = dense_grads_grouped(q64, k64, v64, dO.double(), dlse.double(), **p.kwargs)
    for name, got, ref in zip("qkv", grads, refs, strict=True):
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4, msg=f"d{name}")


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_rows_that_see_no_key_give_zero_output_and_gradients(workers):
    """bottom_right with N_q = 9 > N_k = 4: query rows 0-4 see no key at all."""
    q, k, v = make_grouped(1, 1, 2, 9, 4, 3, 2)
    kw = dict(scale=0.5, causal=True, causal_align="bottom_right", block_m=2, block_n=3)
    with pool_for_any_size():
        O, lse = parallel_forward(q, k, v, **single_threaded(q, k, v, **kw), workers=workers)
        dq, dk, dv = parallel_backward(
            q, k, v, O, lse, torch.ones_like(O), torch.ones_like(lse), **single_threaded(q, k, v, **kw), workers=workers
        )
    blind = slice(0, 5)
    assert torch.equal(O[..., blind, :], torch.zeros_like(O[..., blind, :]))
    assert torch.isneginf(lse[..., blind]).all() and torch.isfinite(lse[..., 5:]).all()
    assert torch.equal(dq[..., blind, :], torch.zeros_like(dq[..., blind, :]))
    for t in (O, dq, dk, dv):
        assert not torch.isnan(t).any()


# ------------------------------------------------------------------------------------------------ threads


class ThreadLog:
    """Wraps a per-task function of ``parallel`` and records which thread ran each call, and with how many
    intra-op threads. With ``meet=n`` the first n calls wait for one another (10 s at most), so n threads
    must each take one: otherwise one fast worker may drain a short queue alone, and a count of the threads
    used would depend on the scheduler."""

    def __init__(self, fn, meet: int = 1):
        self.fn, self.calls, self.lock = fn, [], threading.Lock()
        self.barrier = threading.Barrier(meet, timeout=10)

    def __call__(self, *args):
        with self.lock:
            self.calls.append((threading.current_thread().name, torch.get_num_threads()))
            first = len(self.calls) <= self.barrier.parties
        if first:
            self.barrier.wait()
        self.fn(*args)

    @property
    def threads(self) -> set[str]:
        return {name for name, _ in self.calls}


def test_large_problems_run_on_the_pool_with_one_thread_per_worker(monkeypatch):
    log = ThreadLog(parallel._forward_rows, meet=2)
    monkeypatch.setattr(parallel, "_forward_rows", log)
    q, k, v = make_grouped(1, 4, 1, 512, 512, 8, 8, dtype=torch.float32)  # 4 * 512 * 512 = 2^20 scores
    assert q.shape[1] * 512 * 512 >= parallel.MIN_PARALLEL_SCORES
    kw = dict(scale=0.3, causal=True, causal_align="top_left", block_m=64, block_n=64)
    O, _ = parallel_forward(q, k, v, **single_threaded(q, k, v, **kw), workers=2)
    assert len(log.threads) == 2 and all(name.startswith("flashattn_teach") for name in log.threads)
    assert {n for _, n in log.calls} == {1}  # every op inside a worker runs on that worker's core
    O_ref, _ = query_major_forward(q, k, v, **single_threaded(q, k, v, **kw))
    torch.testing.assert_close(O, O_ref, atol=1e-6, rtol=0)


def test_small_problems_run_inline_in_the_calling_thread(monkeypatch):
    log = ThreadLog(parallel._forward_rows)
    monkeypatch.setattr(parallel, "_forward_rows", log)
    q, k, v = make_grouped(1, 4, 1, 64, 64, 8, 8)
    assert q.shape[1] * 64 * 64 < parallel.MIN_PARALLEL_SCORES
    before = torch.get_num_threads()
    kw = dict(scale=0.3, causal=False, causal_align="top_left", block_m=16, block_n=16)
    parallel_forward(q, k, v, **single_threaded(q, k, v, **kw), workers=2)
    assert log.threads == {threading.current_thread().name}
    assert {n for _, n in log.calls} == {1}  # single-threaded ops here too, and the count restored after
    assert torch.get_num_threads() == before


def test_few_key_value_heads_split_the_query_heads_of_a_group(monkeypatch):
    """MQA with one key/value head: the backward's tasks are ranges of its G query heads, each with its own
    dK, dV partial; their sum equals the single-threaded loops."""
    log = ThreadLog(parallel._backward_head, meet=2)
    monkeypatch.setattr(parallel, "_backward_head", log)
    q, k, v = make_grouped(1, 1, 4, 23, 17, 5, 3)
    kw = dict(scale=0.4, causal=True, causal_align="top_left", block_m=4, block_n=5)
    O, lse = query_major_forward(q, k, v, **single_threaded(q, k, v, **kw))
    dO = torch.randn_like(O)
    with pool_for_any_size():
        grads = parallel_backward(q, k, v, O, lse, dO, None, **single_threaded(q, k, v, **kw), workers=2)
    assert len(log.calls) == 4 and len(log.threads) == 2
    refs = backward_grouped(q, k, v, O, lse, dO, None, **single_threaded(q, k, v, **kw))
    for name, got, ref in zip("qkv", grads, refs, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-13, rtol=1e-13, msg=f"d{name}")


def test_starting_a_pool_leaves_other_threads_intra_op_count_alone():
    """The pool's threads run single-threaded ops; the caller, and threads started later, keep torch's count."""

    def fresh_thread_count() -> int:
        out = []
        t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
        t.start()
        t.join()
        return out[0]

    before, fresh_before = torch.get_num_threads(), fresh_thread_count()
    pool = workers._pool(5)  # a worker count no other test uses, so this call starts the pool
    assert pool.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == before
    assert fresh_thread_count() == fresh_before


def test_a_failing_task_raises_in_the_caller():
    q, k, v = make_grouped(1, 2, 1, 8, 8, 4, 4)
    with pool_for_any_size(), pytest.raises(RuntimeError):
        kw = dict(scale=1.0, causal=False, causal_align="top_left", block_m=4, block_n=4)
        parallel_forward(q, k[..., :3], v, **single_threaded(q, k, v, **kw), workers=2)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_its_own_pool():
    q, k, v = make_grouped(1, 4, 1, 512, 512, 4, 4, dtype=torch.float32)
    kw = dict(scale=0.3, causal=False, causal_align="top_left", block_m=128, block_n=128)
    O, _ = parallel_forward(q, k, v, **single_threaded(q, k, v, **kw), workers=2)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # child: must not wait on the parent's threads, which it does not have
        torch.set_num_threads(1)  # nor use the parent's OpenMP threads
        signal.alarm(60)  # a child waiting on threads it does not have dies, and the test fails, not hangs
        ok = torch.allclose(parallel_forward(q, k, v, **single_threaded(q, k, v, **kw), workers=2)[0], O)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
