"""The backward replay against torch.autograd of a float64 dense attention written here."""

from __future__ import annotations

import math
import re

import pytest
import torch
from teaching import teaching_inputs

from flashattn_teach.errors import AttentionValueError
from flashattn_teach.replay.backward_replay import backward_of, numbers, replay_backward
from flashattn_teach.replay.replay import replay


def _dense_grads(q, k, v, dO, mask, softcap=None):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    S = (q @ k.T) / math.sqrt(q.shape[-1])
    if softcap is not None:
        S = softcap * torch.tanh(S / softcap)
    S = S.masked_fill(~mask, float("-inf"))
    P = torch.nan_to_num(torch.softmax(S, -1), nan=0.0)
    O = P @ v
    (O * dO).sum().backward()
    return P.detach(), O.detach(), (q.grad, k.grad, v.grad)


CASES = [
    (6, 4, 2, 2, False, None, None),
    (6, 4, 2, 2, True, None, None),
    (7, 4, 3, 2, True, None, None),
    (6, 4, 2, 2, False, (0, 0), None),
    (6, 4, 2, 2, True, None, 2.0),
]


@pytest.mark.parametrize(("N", "D", "bm", "bn", "causal", "window", "softcap"), CASES)
def test_backward_replay_matches_autograd(N, D, bm, bn, causal, window, softcap):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(N, D, generator=g, dtype=torch.float64) for _ in range(3))
    r = replay_backward(q, k, v, block_m=bm, block_n=bn, causal=causal, window=window, softcap=softcap)
    idx = torch.arange(N)
    mask = torch.ones(N, N, dtype=torch.bool)
    if causal:
        mask &= idx[None, :] <= idx[:, None]
    if window is not None:
        mask &= (idx[None, :] >= idx[:, None] - window[0]) & (idx[None, :] <= idx[:, None] + window[1])
    P, O, grads = _dense_grads(q, k, v, r.dO, mask, softcap)
    for mine, ref in zip(r.grads(), grads, strict=True):
        assert not torch.isnan(mine).any()
        torch.testing.assert_close(mine, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(r.delta, (r.dO * O).sum(-1), atol=1e-12, rtol=0)
    for s in r.dkdv_steps():
        (r0, r1), (c0, c1) = s.rows, s.cols
        torch.testing.assert_close(s["P_ij"], P[r0:r1, c0:c1], atol=1e-12, rtol=0)


def test_teaching_example_ends_at_float64_autograd_within_1e_12():
    q, k, v, dO = teaching_inputs(with_dO=True)
    r = replay_backward(q, k, v, dO, block_m=2, block_n=2)
    _, _, grads = _dense_grads(q[0], k[0], v[0], dO[0], torch.ones(6, 6, dtype=torch.bool))
    for mine, ref in zip(r.grads(), grads, strict=True):
        torch.testing.assert_close(mine, ref, atol=1e-12, rtol=0)
    assert max(r.max_error().values()) <= 1e-12
    for name, ref in zip(("dQ", "dK", "dV"), grads, strict=True):  # the module's oracle is the test's
        torch.testing.assert_close(r.oracle()[name], ref, atol=1e-14, rtol=0)
    # negative control: another dO moves the gradients far from these
    other = replay_backward(q, k, v, dO * 2 + 1, block_m=2, block_n=2)
    assert (other.grads()[0] - grads[0]).abs().max() > 1e-3


def test_a_row_that_sees_no_key_gets_zero_gradients_and_no_nan():
    q, k, v, dO = teaching_inputs(with_dO=True)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[3] = False  # query 3 sees no key
    r = replay_backward(q, k, v, dO, block_m=2, block_n=2, attn_mask=mask, causal=True)
    assert torch.isneginf(r.lse[3]) and float(r.delta[3]) == 0.0
    dQ, dK, dV = r.grads()
    assert not any(torch.isnan(t).any() for t in (dQ, dK, dV))
    assert torch.equal(dQ[3], torch.zeros(4, dtype=torch.float64))
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    _, _, grads = _dense_grads(q[0], k[0], v[0], dO[0], mask & causal)
    for mine, ref in zip((dQ, dK, dV), grads, strict=True):
        torch.testing.assert_close(mine, ref, atol=1e-12, rtol=0)
    for s in (*r.dkdv_steps(), *r.dq_steps()):
        assert all(not torch.isnan(t).any() for t in (s["P_ij"], s["dP_ij"], s["dS_ij"], *s.accumulators.values()))
        if s.rows[0] <= 3 < s.rows[1]:
            assert torch.equal(s["P_ij"][3 - s.rows[0]], torch.zeros(s.cols[1] - s.cols[0], dtype=torch.float64))


@pytest.mark.parametrize(("bm", "bn", "causal"), [(2, 2, False), (2, 3, True), (4, 2, True)])
def test_dq_pass_step_by_step(bm, bn, causal):
    """Each dQ_i after a step is the sum over the key blocks so far of scale dS_ij K_j, computed here from the
    test's own P and dP; after its last key block it is the oracle's rows of dQ."""
    q, k, v, dO = teaching_inputs(with_dO=True)
    r = replay_backward(q, k, v, dO, block_m=bm, block_n=bn, causal=causal)
    mask = torch.tril(torch.ones(6, 6, dtype=torch.bool)) if causal else torch.ones(6, 6, dtype=torch.bool)
    P, O, (dQ, _, _) = _dense_grads(q[0], k[0], v[0], dO[0], mask)
    dP = dO[0] @ v[0].T  # (N_q, N_k)
    dS = P * (dP - (dO[0] * O).sum(-1, keepdim=True))
    steps = list(r.dq_steps())
    assert steps
    for n, s in enumerate(steps):
        (r0, r1), (c0, c1) = s.rows, s.cols
        seen = [t for t in steps[: n + 1] if t.i == s.i]
        partial = sum(0.5 * dS[r0:r1, t.cols[0] : t.cols[1]] @ k[0, t.cols[0] : t.cols[1]] for t in seen)
        torch.testing.assert_close(s["dQ_i"], partial, atol=1e-12, rtol=0)
        torch.testing.assert_close(s["dS_ij"], dS[r0:r1, c0:c1], atol=1e-12, rtol=0)
        last = n + 1 == len(steps) or steps[n + 1].i != s.i
        if last:
            torch.testing.assert_close(s["dQ_i"], dQ[r0:r1], atol=1e-12, rtol=0)
    assert {s.i for s in steps} == set(range(-(-6 // bm)))


def test_sink_gradients_match_autograd():
    q, k, v, dO = teaching_inputs(with_dO=True)
    sink = torch.tensor([0.7], dtype=torch.float64, requires_grad=True)
    r = replay_backward(q, k, v, dO, block_m=2, block_n=2, causal=True, sinks=sink.detach())
    qq, kk, vv = (t[0].clone().requires_grad_(True) for t in (q, k, v))
    S = (qq @ kk.T / 2).masked_fill(~torch.tril(torch.ones(6, 6, dtype=torch.bool)), float("-inf"))
    P = torch.softmax(torch.cat([S, sink.expand(6, 1)], dim=-1), -1)[:, :6]  # the sink column, dropped
    (P @ vv * dO[0]).sum().backward()
    for mine, ref in zip(r.grads(), (qq.grad, kk.grad, vv.grad), strict=True):
        torch.testing.assert_close(mine, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(r.gradients()["dsink"], sink.grad, atol=1e-12, rtol=0)
    assert r.preprocess().equations[-1].name == "dsink"
    assert max(r.max_error().values()) <= 1e-12


def test_packed_sequences_match_autograd_per_sequence():
    q, k, v, dO = teaching_inputs(with_dO=True)
    r = replay_backward(q, k, v, dO, block_m=2, block_n=2, causal=True, cu_seqlens=torch.tensor([0, 3, 6]))
    idx = torch.arange(6)
    mask = (idx[None, :] <= idx[:, None]) & ((idx[None, :] < 3) == (idx[:, None] < 3))
    _, _, grads = _dense_grads(q[0], k[0], v[0], dO[0], mask)
    for mine, ref in zip(r.grads(), grads, strict=True):
        torch.testing.assert_close(mine, ref, atol=1e-12, rtol=0)


def test_equations_carry_their_numbers():
    q, k, v, dO = teaching_inputs(with_dO=True)
    r = replay_backward(q, k, v, dO, block_m=2, block_n=2)
    step = next(iter(r.dkdv_steps()))
    assert [e.line for e in step.equations] == [11, 12, 13, 14, 16]
    for eq in step.equations:
        result = eq.substituted.rsplit(" = ", 1)[1]
        assert result == numbers(eq.value)
    dV = step.equations[1]
    assert dV.name == "dV_j" and torch.equal(dV.value, step["dV_j"])
    assert dV.substituted.startswith("[[0, 0, 0, 0], [0, 0, 0, 0]] + " + numbers(step["P_ij"]) + "^T ")
    delta = r.preprocess().equations[0]
    assert delta.line == 4 and delta.substituted.endswith(" = " + numbers(r.delta))
    assert numbers(torch.tensor([float("-inf"), 1.23456])) == "[-inf, 1.235]"


def test_a_negative_zero_is_written_as_zero():
    assert numbers(torch.tensor([-0.0, 0.0, -1e-20])) == "[0, 0, -1e-20]"
    assert numbers(-0.0) == "0"
    # A masked score has P_ij = 0, so dS_ij = 0 * (dP_ij - delta_i): -0 where dP_ij - delta_i < 0.
    q, k, v, dO = teaching_inputs(with_dO=True)
    r = replay_backward(q, k, v, dO, block_m=2, block_n=2, causal=True, window=(1, 0))
    steps = [*r.dkdv_steps(), *r.dq_steps()]
    assert any(((s["dS_ij"] == 0) & torch.signbit(s["dS_ij"])).any() for s in steps)  # there are -0s to write
    texts = [e.substituted for s in steps for e in s.equations]
    assert not [t for t in texts if re.search(r"(?<![\w.])-0(?![\w.])", t)]


def test_inputs_are_checked_as_the_forward_replay_checks_them():
    q, k, v, _ = teaching_inputs(with_dO=True)
    with pytest.raises(AttentionValueError, match="do not broadcast"):
        replay_backward(q.expand(2, 6, 4), k.expand(3, 6, 4), v, block_m=2, block_n=2)
    with pytest.raises(AttentionValueError, match=r"query must have shape \(N, D\) or \(B, N, D\)"):
        replay_backward(q[None], k, v, block_m=2, block_n=2)
    with pytest.raises(AttentionValueError, match="batch_index"):
        replay_backward(q, k, v, block_m=2, block_n=2, batch_index=1)
    with pytest.raises(AttentionValueError, match="dO must have the output's shape"):
        replay_backward(q, k, v, torch.zeros(6, 3, dtype=torch.float64), block_m=2, block_n=2)
    with pytest.raises(AttentionValueError, match="cu_seqlens"):
        replay_backward(q, k[:, :5], v[:, :5], block_m=2, block_n=2, cu_seqlens=torch.tensor([0, 3, 6]))


def test_backward_of_a_forward_replay_uses_its_inputs_and_options():
    q, k, v, dO = teaching_inputs(with_dO=True)
    fwd = replay(q, k, v, block_m=2, block_n=3, query_block=1, causal=True, softcap=3.0, order="key_major")
    mine = backward_of(fwd, dO=dO)
    direct = replay_backward(q, k, v, dO, block_m=2, block_n=3, causal=True, softcap=3.0)
    for a, b in zip(mine.grads(), direct.grads(), strict=True):
        assert torch.equal(a, b)
    assert (mine.block_m, mine.block_n, mine.softcap) == (2, 3, 3.0)


@pytest.mark.parametrize("sink", [1e39, -1e39])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_a_sink_beyond_the_compute_dtype_is_refused_by_name(sink, backward):
    # 1e39 is finite in float64 but inf in float32, the replay's compute dtype for float32 inputs: it used to
    # pass the finiteness check and give m_i = inf, NaN in every l_i, O_i and dsink, with no error.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 4, generator=g) for _ in range(3))
    call = replay_backward if backward else replay
    with pytest.raises(AttentionValueError, match=r"sinks .*float32"):
        call(q, k, v, block_m=2, block_n=2, sinks=sink)
    call(q.double(), k.double(), v.double(), block_m=2, block_n=2, sinks=sink)  # finite in float64: replayed


def test_a_row_that_sees_no_key_says_why_its_P_is_zero():
    # P_ij's text for a fully masked row is exp(-inf - -inf) = 0: the equation must say the code takes it as 0
    # (it would be NaN), as the forward's equations do; only in tiles that have such a row.
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(4, 2, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[0] = False  # row 0 sees no key
    br = replay_backward(q, k, v, block_m=2, block_n=2, attn_mask=mask)
    for step in [*br.dkdv_steps(), *br.dq_steps()]:
        eq = step.equations[0]
        assert eq.name == "P_ij"
        assert ("lse_i = -inf" in eq.symbolic) == (step.i == 0), (step.i, eq.symbolic)
        assert not step["P_ij"].isnan().any()


def test_backward_of_carries_every_option_of_replay():
    # The forward and the backward replay take one set of keywords (ReplayKeywords), and backward_of passes the
    # forward's whole: every keyword of replay() but the three that pick what the forward shows is one of them.
    import inspect

    from flashattn_teach.replay.inputs import ReplayKeywords

    shared = set(ReplayKeywords.__annotations__)
    forward = set(inspect.signature(replay).parameters) - {"q", "k", "v"}
    assert shared == forward - {"query_block", "order", "source", "kernel"}  # the forward kernel: its own keywords
    # replay_backward's own: dO, seed, and source and deterministic (the backward kernels' trace)
    own = {"q", "k", "v", "dO", "seed", "source", "deterministic"}
    assert shared == set(inspect.signature(replay_backward).parameters) - own
    # And the options arrive: a backward of the forward's causal, windowed, capped call, against a direct one.
    q, k, v = (torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in range(3))
    kw = {"block_m": 2, "block_n": 3, "causal": True, "window": (1, 0), "softcap": 2.0, "scale": 0.7}
    via = backward_of(replay(q, k, v, query_block=1, **kw), seed=4).gradients()
    direct = replay_backward(q, k, v, seed=4, **kw).gradients()
    plain = replay_backward(q, k, v, seed=4, block_m=2, block_n=3).gradients()
    assert all(torch.equal(via[n], direct[n]) for n in direct) and not torch.equal(via["dQ"], plain["dQ"])
    with pytest.raises(TypeError, match="causl"):
        replay_backward(q, k, v, block_m=2, block_n=2, causl=True)
