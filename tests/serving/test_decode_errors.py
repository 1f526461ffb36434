"""Bad input to ``flash_attention_with_kvcache`` fails loudly and names the argument, and a failed check
writes nothing into the caches."""

from __future__ import annotations

import pytest
import torch

import flashattn_teach as fa

from decode_cases import problem, randn


def bad(**changes):
    q, k_cache, v_cache, (k, v) = problem(2, 4, 2, 10, 1, 2)
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "cache_seqlens": torch.tensor([3, 4])}
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("changes", "error", "words"),
    [
        ({"cache_seqlens": torch.tensor([3, 4, 5])}, ValueError, r"cache_seqlens must have shape \(2,\)"),
        ({"cache_seqlens": torch.tensor([[3, 4]])}, ValueError, r"cache_seqlens must have shape \(2,\)"),
        ({"cache_seqlens": torch.tensor([3.0, 4.0])}, TypeError, "cache_seqlens must be int32 or int64"),
        ({"cache_seqlens": torch.tensor([3, -1])}, ValueError, r"cache_seqlens\[1\] = -1"),
        ({"cache_seqlens": 11}, ValueError, r"cache_seqlens must lie in \[0, N_max\] = \[0, 10\]"),
        ({"cache_seqlens": torch.tensor([3, 4], device="meta")}, ValueError, "cache_seqlens is on meta but q"),
        ({"cache_seqlens": "3"}, TypeError, "cache_seqlens must be an int32/int64 torch.Tensor"),
        ({"cache_seqlens": True}, TypeError, "cache_seqlens must be an int32/int64 torch.Tensor"),
        ({"cache_seqlens": torch.tensor([3, 9])}, ValueError, r"cache_seqlens\[1\] = 9 leaves no room.*N_max = 10"),
        ({"q": randn(2, 3, 1, 8, seed=0)}, ValueError, "H_q=3 must be a multiple of the key/value heads H_kv=2"),
        ({"k": randn(2, 1, 2, 8, seed=0)}, ValueError, "k and v must have the same H_kv and N_new_kv"),
        ({"k": randn(2, 2, 2, 5, seed=0), "v": randn(2, 2, 2, 6, seed=0)}, ValueError, "k and k_cache must have"),
        ({"v": None}, ValueError, "k and v must be given together"),
        ({"q": randn(3, 4, 1, 8, seed=0)}, ValueError, "batch size B"),
        ({"q": randn(2, 4, 1, 7, seed=0)}, ValueError, "q and k_cache must have the same head dimension D"),
        ({"q": randn(2, 4, 8, seed=0)}, ValueError, r"q must have shape \(B, H_q, N_new, D\)"),
        ({"k_cache": None}, TypeError, "k_cache must be a torch.Tensor"),
        ({"q": randn(2, 4, 1, 8, seed=0, dtype=torch.float32)}, TypeError, "must share one dtype"),
        ({"v_cache": randn(2, 2, 9, 6, seed=0)}, ValueError, "k_cache and v_cache must have the same H_kv and N_max"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(changes, error, words):
    with pytest.raises(error, match=words) as info:
        fa.flash_attention_with_kvcache(**bad(**changes))
    assert isinstance(info.value, fa.AttentionError)


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"num_splits": -1}, ValueError, "num_splits must be 0"),
        ({"num_splits": 1.5}, TypeError, "num_splits must be an int"),
        ({"alibi_slopes": torch.ones(3)}, ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\)"),
        ({"window": (-2, 0)}, ValueError, "window left"),
        ({"softcap": -1.0}, ValueError, "softcap must be"),
        ({"causal": 1}, TypeError, "causal must be a bool"),
        ({"backend": "fast"}, ValueError, "backend must be one of"),
    ],
)
def test_bad_options_name_the_argument(options, error, words):
    with pytest.raises(error, match=words):
        fa.flash_attention_with_kvcache(**bad(), **options)


def test_triton_refuses_what_its_kernel_cannot_run_with_the_reason():
    # bad()'s float64 tensors (or, without the interpreter, CPU tensors; or no triton at all)
    with pytest.raises(NotImplementedError, match="backend='triton' cannot run this decode call: "):
        fa.flash_attention_with_kvcache(**bad(), backend="triton")


def test_gradients_through_the_in_place_write_are_refused_by_name():
    args = bad()
    args["k"].requires_grad_()
    with pytest.raises(ValueError, match="k requires grad, but k and v are written into k_cache"):
        fa.flash_attention_with_kvcache(**args)
    with torch.no_grad():
        fa.flash_attention_with_kvcache(**args)  # no gradient wanted: allowed


def test_a_failed_check_writes_nothing():
    args = bad(cache_seqlens=torch.tensor([3, 9]))
    before = args["k_cache"].clone()
    with pytest.raises(ValueError):
        fa.flash_attention_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before)
