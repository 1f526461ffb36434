"""explain_with_kvcache: it names the path, the key ranges and the row layout flash_attention_with_kvcache
then really uses (recorded from the call), writes nothing, and refuses what the call refuses."""

from __future__ import annotations

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach.dispatch import runner
from flashattn_teach.serving import step as decode_step_module


def _problem(B=2, H_q=8, H_kv=2, N_max=32, N_new=1, N_new_kv=1, D=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H_q, N_new, D, generator=g)
    k_cache, v_cache = torch.randn(B, H_kv, N_max, D, generator=g), torch.randn(B, H_kv, N_max, D, generator=g)
    k, v = torch.randn(B, H_kv, N_new_kv, D, generator=g), torch.randn(B, H_kv, N_new_kv, D, generator=g)
    return q, k_cache, v_cache, k, v


def _ranges_run(monkeypatch, *args, **kwargs):
    """``(backend, rows, keys)`` of every partial the call computes."""
    seen = []
    run = runner.run

    def recording(p, q, k, v, opts):
        seen.append((p.backend, q.shape[2], k.shape[2]))
        return run(p, q, k, v, opts)

    monkeypatch.setattr(runner, "run", recording)
    fa.flash_attention_with_kvcache(*args, **kwargs)
    return seen


@pytest.mark.parametrize("backend", ["auto", "query_major", "key_major", "dense"])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_the_plan_is_what_the_call_runs(monkeypatch, backend, num_splits):
    q, k_cache, v_cache, k, v = _problem()
    lengths = torch.tensor([20, 9])
    kw = dict(cache_seqlens=lengths, num_splits=num_splits, backend=backend)
    plan = fa.explain_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    seen = _ranges_run(monkeypatch, q, k_cache, v_cache, k, v, **kw)
    assert {b for b, _, _ in seen} == {plan.backend}
    n = num_splits or 1  # the CPU picks one range
    assert len(seen) == 2 * n  # two batch elements, every range non-empty at these lengths
    assert f"{n} key range" in plan.reason and "L_b = [21, 10]" in plan.reason
    assert all(rows == 4 for _, rows, _ in seen)  # one new query: G = 4 query heads as 4 rows
    assert "run as 4 rows" in plan.reason


def test_no_folding_is_named_with_alibi_or_several_new_queries():
    q, k_cache, v_cache, k, v = _problem(N_new=2, N_new_kv=2)
    assert "rows of it" not in fa.explain_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3).reason
    q, k_cache, v_cache, k, v = _problem()
    slopes = torch.rand(8)
    plan = fa.explain_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3, alibi_slopes=slopes)
    assert "rows of it" not in plan.reason


def test_explain_writes_nothing():
    q, k_cache, v_cache, k, v = _problem()
    before = k_cache.clone(), v_cache.clone()
    fa.explain_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([5, 6]))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize(
    "bad",
    [
        dict(num_splits=-1),
        dict(cache_seqlens=torch.tensor([32, 0])),  # no room for the new key
        dict(window=(1, 2, 3)),
        dict(backend="flash"),
    ],
)
def test_explain_refuses_what_the_call_refuses(bad):
    q, k_cache, v_cache, k, v = _problem()
    kw = {"cache_seqlens": torch.tensor([5, 6]), **bad}
    with pytest.raises(Exception) as call:
        fa.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    with pytest.raises(type(call.value)) as explained:
        fa.explain_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    assert str(explained.value) == str(call.value)


def test_triton_path_is_named_with_its_grid():
    pytest.importorskip("triton")
    q, k_cache, v_cache, k, v = _problem()
    plan = fa.explain_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=5, num_splits=4, backend="triton")
    assert plan.backend == "triton"
    assert "2 x 2 x 4" in plan.reason and "4 x 1 query rows" in plan.reason and "merges the 4 partials" in plan.reason


def test_the_triton_path_says_whether_the_lengths_are_checked_or_clamped(monkeypatch):
    pytest.importorskip("triton")
    q, k_cache, v_cache, k, v = _problem()
    plan = fa.explain_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([5, 9]), backend="triton")
    assert "cache_seqlens checked on the host (no device sync)" in plan.reason
    with pytest.raises(fa.AttentionValueError, match="leaves no room"):
        fa.explain_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=k_cache.shape[2], backend="triton")
    # a CUDA tensor of lengths (not on this machine: the check that tells them apart answers as for one)
    monkeypatch.setattr(decode_step_module, "lengths_on_host", lambda cache_seqlens: False)
    plan = fa.explain_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([5, 9]), backend="triton")
    assert "not checked (that would synchronise)" in plan.reason
    assert "overwrite the last valid ones" in plan.reason
