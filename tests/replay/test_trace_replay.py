"""The replay against the online references (same update, same result) and an independent recomputation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashattn_teach.errors import AttentionTypeError, AttentionValueError
from flashattn_teach.reference import dense_attention, key_major_attention, online_attention
from flashattn_teach.replay import replay

REFERENCES = {"query_major": online_attention, "key_major": key_major_attention}


@st.composite
def replay_cases(draw):
    N_q, N_k = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    block_m, block_n = draw(st.integers(1, 10)), draw(st.integers(1, 10))
    case = {
        "N_q": N_q,
        "N_k": N_k,
        "D": draw(st.integers(1, 4)),
        "D_v": draw(st.integers(1, 4)),
        "block_m": block_m,
        "block_n": block_n,
        "query_block": draw(st.integers(0, -(-N_q // block_m) - 1)),
        "causal": draw(st.booleans()),
        "causal_align": draw(st.sampled_from(["top_left", "bottom_right"])),
        "order": draw(st.sampled_from(["query_major", "key_major"])),
        "seed": draw(st.integers(0, 2**16)),
        "sink": draw(st.none() | st.floats(-3.0, 3.0)),  # an attention sink, or none
    }
    return case


def make(case, dtype=torch.float64):
    g = torch.Generator().manual_seed(case["seed"])
    q = torch.randn(1, case["N_q"], case["D"], generator=g, dtype=dtype)
    k = torch.randn(1, case["N_k"], case["D"], generator=g, dtype=dtype)
    v = torch.randn(1, case["N_k"], case["D_v"], generator=g, dtype=dtype)
    return q, k, v


def run(case, q, k, v):
    return replay(
        q,
        k,
        v,
        block_m=case["block_m"],
        block_n=case["block_n"],
        query_block=case["query_block"],
        causal=case["causal"],
        causal_align=case["causal_align"],
        order=case["order"],
        sinks=case.get("sink"),
    )


def sinks_of(case):
    """The case's sink as the references take it: ``(1,)`` for the one head, or None."""
    return None if case.get("sink") is None else torch.tensor([case["sink"]], dtype=torch.float64)


@given(replay_cases())
def test_replay_equals_online_reference_after_last_tile_for_any_tiling(case):
    q, k, v = make(case)
    r = run(case, q, k, v)
    r0, r1 = r.rows
    O = REFERENCES[case["order"]](
        q,
        k,
        v,
        causal=case["causal"],
        causal_align=case["causal_align"],
        block_m=case["block_m"],
        block_n=case["block_n"],
        sinks=sinks_of(case),
    )[0, r0:r1]
    last = r.steps[-1]["O_partial"] if r.steps else torch.zeros_like(O)  # no visible key: O = 0
    torch.testing.assert_close(last, O, rtol=0, atol=1e-13)
    assert last.dtype == torch.float64
    if r.steps:
        assert r.steps[-1].max_diff < 1e-13


def independent(case, q, k, v):
    """Plain numpy float64: full scores, the causal mask cell by cell, softmax over the columns seen so far."""
    q, k, v = (t[0].numpy().astype(np.float64) for t in (q, k, v))
    N_q, N_k = case["N_q"], case["N_k"]
    S = (q @ k.T) / math.sqrt(q.shape[1])
    offset = 0 if case["causal_align"] == "top_left" else N_k - N_q
    visible = np.array([[not case["causal"] or c <= r + offset for c in range(N_k)] for r in range(N_q)])
    return S, visible


@given(replay_cases())
def test_statistics_match_an_independent_float64_recomputation(case):
    q, k, v = make(case)
    r = run(case, q, k, v)
    S, visible = independent(case, q, k, v)
    V = v[0].numpy()
    i, (r0, r1), bm, bn = case["query_block"], r.rows, case["block_m"], case["block_n"]
    assert (r0, r1) == (i * bm, min((i + 1) * bm, case["N_q"]))

    # Which tiles of block i run: exactly those with a visible cell, in increasing j; the rest are skipped.
    T_c = -(-case["N_k"] // bn)
    runs = [j for j in range(T_c) if visible[r0:r1, j * bn : (j + 1) * bn].any()]
    assert [s.j for s in r.steps] == runs
    assert sorted(j for i_t, j in r.skipped if i_t == i) == sorted(set(range(T_c)) - set(runs))

    dense = dense_attention(
        q[0], k[0], v[0], causal=case["causal"], causal_align=case["causal_align"], sinks=sinks_of(case)
    )[r0:r1]
    sink = case.get("sink")
    for n, step in enumerate(r.steps):
        c0, c1 = step.cols
        assert (c0, c1) == (step.j * bn, min((step.j + 1) * bn, case["N_k"]))
        assert step.completed_columns == c0 and step.index == n and step.i == i and not step.skipped
        assert step.masked == (not visible[r0:r1, c0:c1].all())
        np.testing.assert_allclose(
            step["S_ij"].numpy(), np.where(visible[r0:r1, c0:c1], S[r0:r1, c0:c1], -np.inf), rtol=1e-13, atol=1e-13
        )
        seen = np.where(visible[r0:r1, :c1], S[r0:r1, :c1], -np.inf)  # every column up to this tile
        values = V[:c1]
        if sink is not None:  # the sink: one more column of score sink and value zero
            seen = np.concatenate([seen, np.full((r1 - r0, 1), sink)], axis=1)
            values = np.concatenate([values, np.zeros((1, V.shape[1]))], axis=0)
        m = seen.max(axis=1)
        m_safe = np.where(np.isneginf(m), 0.0, m)
        P = np.exp(seen - m_safe[:, None])
        l = P.sum(axis=1)
        partial = (P @ values) / np.where(l == 0, 1.0, l)[:, None]
        if sink is not None:
            np.testing.assert_allclose(step["sink_share"].numpy(), P[:, -1] / l, rtol=1e-12, atol=1e-15)
        else:
            assert step.get("sink_share") is None
        np.testing.assert_array_equal(step["m_i"].numpy() == -np.inf, m == -np.inf)
        np.testing.assert_allclose(step["m_i"].numpy(), m, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(step["l_i"].numpy(), l, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(step["O_partial"].numpy(), partial, rtol=1e-12, atol=1e-12)
        # O_final comes from the block's own rows of the oracle: the same sums, up to BLAS's order of adding.
        torch.testing.assert_close(step["O_final"], dense, rtol=1e-14, atol=1e-15)
        assert step.max_diff == pytest.approx(float(np.abs(partial - dense.numpy()).max()), abs=1e-12)


@given(replay_cases())
def test_key_major_steps_sit_in_algorithm_1_order(case):
    case = {**case, "order": "key_major"}
    r = run(case, *make(case))
    # Alg. 1: key blocks outside, query blocks inside; every computed tile exactly once.
    assert list(r.schedule) == sorted(r.schedule, key=lambda t: (t[1], t[0]))
    assert len(set(r.schedule)) == len(r.schedule)
    for step in r.steps:
        assert r.schedule[step.position] == (step.i, step.j)
        assert set(step.done) == {t for t in r.schedule if (t[1], t[0]) < (step.j, step.i)}


def test_float32_inputs_replay_in_float32_and_batch_index_picks_the_element():
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 5, 4) for _ in range(3))
    r = replay(q, k, v, block_m=2, block_n=3, query_block=1, batch_index=2)
    assert r.steps[-1]["O_partial"].dtype == torch.float32
    O = online_attention(q[2], k[2], v[2], block_m=2, block_n=3)
    torch.testing.assert_close(r.steps[-1]["O_partial"], O[2:4])


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"query_block": 3}, AttentionValueError, r"query_block must be in \[0, 3\).*got 3"),
        ({"query_block": 1.0}, AttentionTypeError, "query_block must be an int, got float 1.0"),
        ({"query_block": True}, AttentionTypeError, "query_block must be an int"),
        ({"order": "diagonal"}, AttentionValueError, "order must be one of .*'diagonal'"),
        ({"order": "key-major"}, AttentionValueError, "order must be one of .*'key_major'.*got 'key-major'"),
        ({"batch_index": 2}, AttentionValueError, r"batch_index must be in \[0, 2\) .* got 2"),
        ({"block_m": 0}, ValueError, "block_m"),
        ({"causal_align": "middle"}, ValueError, "causal_align"),
    ],
)
def test_bad_arguments_raise_a_named_error(kwargs, error, named):
    q = torch.randn(2, 6, 4, dtype=torch.float64)
    with pytest.raises(error, match=named):
        replay(q, q, q, **{"block_m": 2, "block_n": 2, **kwargs})


def test_batch_sizes_that_do_not_broadcast_are_named_as_batch_sizes():
    q, k = torch.randn(2, 6, 4), torch.randn(3, 6, 4)
    with pytest.raises(AttentionValueError, match=r"batch sizes .*\{'query': 2, 'key': 3, 'value': 3\}"):
        replay(q, k, k, block_m=2, block_n=2)
    with pytest.raises(AttentionValueError, match=r"query must have shape \(N, D\) or \(B, N, D\), got \(1, 2, 6, 4\)"):
        replay(q[None], q[None], q[None], block_m=2, block_n=2)
    with pytest.raises(TypeError, match="query"):
        replay([[1.0]], k, k, block_m=2, block_n=2)


def test_steps_are_computed_on_access_and_the_same_every_time():
    torch.manual_seed(0)
    q, k, v = (torch.randn(7, 3, dtype=torch.float64) for _ in range(3))
    r = replay(q, k, v, block_m=3, block_n=2, query_block=1, causal=True, order="key_major")
    steps = list(r.steps)
    assert len(r.steps) == len(steps) == 3  # rows 3-5 see keys 0-5: key blocks 0, 1, 2
    for n in range(-3, 3):
        again = r.steps[n]
        assert again.index == steps[n].index and again.position == steps[n].position
        torch.testing.assert_close(again["O_partial"], steps[n]["O_partial"], rtol=0, atol=0)
    for n in (3, -4):
        with pytest.raises(IndexError):
            r.steps[n]
