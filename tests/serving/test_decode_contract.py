"""The KV-cache call keeps the library's contracts (issue #21): one backend table for every public
function, flash-attn's ``causal=False`` default, autocast as ``flash_attention`` follows it, and a call
that raises writes nothing into the caches."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import flashattn_teach as fa

B, H_Q, H_KV, N_MAX, D = 2, 4, 2, 16, 8


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def step(seed=0, dtype=torch.float32, N_new=1):
    """``q, k_cache, v_cache, k, v`` of one decode step, as keyword arguments."""
    return {
        "q": randn(B, H_Q, N_new, D, seed=seed, dtype=dtype),
        "k_cache": randn(B, H_KV, N_MAX, D, seed=seed + 1, dtype=dtype),
        "v_cache": randn(B, H_KV, N_MAX, D, seed=seed + 2, dtype=dtype),
        "k": randn(B, H_KV, N_new, D, seed=seed + 3, dtype=dtype),
        "v": randn(B, H_KV, N_new, D, seed=seed + 4, dtype=dtype),
    }


# ------------------------------------------------------------------------------- backend names


def _kvcache(backend):
    return fa.flash_attention_with_kvcache(**step(), cache_seqlens=torch.tensor([3, 7]), backend=backend)


def _explain_kvcache(backend):
    return fa.explain_with_kvcache(**step(), cache_seqlens=3, backend=backend)


def _attention(backend):
    q = randn(1, 2, 5, D, seed=0)
    return fa.flash_attention(q, q, q, backend=backend)


def _varlen(backend):
    q = randn(7, 2, D, seed=0)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    return fa.flash_attention_varlen(q, q, q, cu, cu, 4, 4, backend=backend)


PUBLIC = {"flash_attention": _attention, "varlen": _varlen, "kvcache": _kvcache, "explain_kvcache": _explain_kvcache}


@pytest.mark.parametrize("call", PUBLIC)
def test_every_public_function_takes_the_deprecated_spelling_with_one_warning(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = PUBLIC[call]("keymajor")
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert [str(w.message) for w in deprecations] == ["backend='keymajor' is deprecated; use 'key_major'"]
    assert deprecations[0].filename == __file__  # the caller's line, not one inside the package
    new = PUBLIC[call]("key_major")
    if isinstance(new, torch.Tensor):
        assert torch.equal(old, new)
    else:
        assert old == new


@pytest.mark.parametrize("call", PUBLIC)
def test_every_public_function_refuses_an_unknown_backend_in_the_same_words(call):
    with pytest.raises(fa.AttentionValueError) as info:
        PUBLIC[call]("fast")
    assert str(info.value) == f"backend must be one of {fa.BACKENDS}, got 'fast'"


# ------------------------------------------------------------------------------- causal default


@pytest.mark.parametrize("function", [fa.flash_attention_with_kvcache, fa.explain_with_kvcache])
def test_causal_is_off_by_default_as_in_flash_attn(function):
    assert inspect.signature(function).parameters["causal"].default is False


def test_several_new_queries_see_every_valid_key_unless_causal():
    def run(**causal):
        args = step(N_new=3)
        return fa.flash_attention_with_kvcache(**args, cache_seqlens=torch.tensor([2, 9]), **causal)

    assert torch.equal(run(), run(causal=False))
    assert not torch.allclose(run(), run(causal=True))


# ------------------------------------------------------------------------------------ autocast


@pytest.mark.parametrize("new_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N_new", [1, 3])
def test_autocast_is_followed_as_flash_attention_follows_it(new_dtype, N_new):
    """Under autocast, q is cast (the result in the autocast dtype, lse in float32) and the caches are read
    as flash_attention reads keys and values there; k, v (here as a bfloat16 projection under autocast
    would give them) are written in the caches' own dtype."""
    args = step(N_new=N_new)
    args["k"], args["v"] = args["k"].to(new_dtype), args["v"].to(new_dtype)
    lengths = [3, 9]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        O, lse = fa.flash_attention_with_kvcache(
            **args, cache_seqlens=torch.tensor(lengths), causal=True, num_splits=2, return_lse=True
        )
        expected = [
            fa.flash_attention(
                args["q"][b : b + 1],
                args["k_cache"][b : b + 1, :, : n + N_new],
                args["v_cache"][b : b + 1, :, : n + N_new],
                causal=True,
                causal_align="bottom_right",
                return_lse=True,
            )
            for b, n in enumerate(lengths)
        ]
    assert O.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert args["k_cache"].dtype == torch.float32  # the caller's storage keeps its dtype
    for b, n in enumerate(lengths):
        assert torch.equal(args["k_cache"][b, :, n : n + N_new], args["k"][b].float())
        assert torch.equal(args["v_cache"][b, :, n : n + N_new], args["v"][b].float())
        O_b, lse_b = expected[b]
        assert O_b.dtype == torch.bfloat16
        torch.testing.assert_close(O[b : b + 1], O_b)
        torch.testing.assert_close(lse[b : b + 1], lse_b, atol=1e-5, rtol=1e-5)


def test_autocast_leaves_float64_alone_and_names_a_mismatch():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        O = fa.flash_attention_with_kvcache(**step(dtype=torch.float64), cache_seqlens=3)
        assert O.dtype == torch.float64
        args = {**step(), "q": randn(B, H_Q, 1, D, seed=0, dtype=torch.float64)}
        with pytest.raises(fa.AttentionTypeError, match=r"q becomes torch\.float64 but the caches"):
            fa.flash_attention_with_kvcache(**args, cache_seqlens=3)
        assert fa.explain_with_kvcache(**step(), cache_seqlens=3).backend == "parallel"


# ------------------------------------------------------------- a call that raises writes nothing


def _slopes_needing_grad():
    return torch.rand(H_Q).requires_grad_()


# One case per kind of refusal on the CPU path: (changes to a good call, the error raised, its words).
REFUSALS = {
    "input shapes": ({"q": randn(B, 3, 1, D, seed=0)}, ValueError, "H_q=3 must be a multiple"),
    "input dtypes": ({"q": randn(B, H_Q, 1, D, seed=0, dtype=torch.float64)}, TypeError, "share one dtype"),
    "cache_seqlens type": ({"cache_seqlens": "3"}, TypeError, "cache_seqlens must be an int32/int64"),
    "cache_seqlens range": ({"cache_seqlens": torch.tensor([3, 17])}, ValueError, r"cache_seqlens\[1\] = 17"),
    "no room, tensor": ({"cache_seqlens": torch.tensor([3, 16])}, ValueError, r"cache_seqlens\[1\] = 16 leaves"),
    "no room, int": ({"cache_seqlens": 16}, ValueError, "cache_seqlens = 16 leaves no room"),
    "option value": ({"window": (-2, 0)}, ValueError, "window left"),
    "option type": ({"causal": 1}, TypeError, "causal must be a bool"),
    "return_lse": ({"return_lse": "yes"}, TypeError, "return_lse must be a bool"),
    "backend name": ({"backend": "fast"}, ValueError, "backend must be one of"),
    "grad through the write": ({"k": randn(B, H_KV, 1, D, seed=3).requires_grad_()}, ValueError, "k requires grad"),
    "backend refuses": (
        {"alibi_slopes": _slopes_needing_grad(), "backend": "query_major"},
        NotImplementedError,
        "dense",
    ),
}


def _assert_refused_without_writing(changes, error, words):
    args = {**step(), "cache_seqlens": torch.tensor([3, 7]), **changes}
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    with pytest.raises(error, match=words):
        fa.flash_attention_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1])


@pytest.mark.parametrize("refusal", REFUSALS)
def test_a_call_that_raises_writes_nothing_into_the_caches(refusal):
    _assert_refused_without_writing(*REFUSALS[refusal])


def test_a_backend_that_refuses_under_torch_func_writes_nothing():
    args = {**step(), "cache_seqlens": 3, "backend": "parallel"}
    before = args["k_cache"].clone()

    def f(q):
        return fa.flash_attention_with_kvcache(**{**args, "q": q}).sum()

    with pytest.raises(NotImplementedError, match=r"torch\.func transform"):
        torch.func.grad(f)(args["q"])
    assert torch.equal(args["k_cache"], before)


# On the Triton path (the interpreter runs it on CPU tensors): an int or a CPU tensor of lengths is read on
# the host at no cost, so a length that leaves no room is refused there too, before anything is written.
TRITON_REFUSALS = {
    "no room, int": ({"cache_seqlens": 16}, ValueError, r"cache_seqlens = 16 leaves no room for the N_new_kv=1"),
    "no room, cpu tensor": ({"cache_seqlens": torch.tensor([3, 16])}, ValueError, r"cache_seqlens\[1\] = 16"),
    "negative int": ({"cache_seqlens": -1}, ValueError, r"cache_seqlens must lie in \[0, N_max\] = \[0, 16\]"),
    "gradient": ({"q": randn(B, H_Q, 1, D, seed=0).requires_grad_()}, ValueError, "Triton decode kernel"),
    "unsupported dtype": (step(dtype=torch.float64), NotImplementedError, "backend='triton' cannot run"),
}


@pytest.mark.parametrize("refusal", TRITON_REFUSALS)
def test_the_triton_path_refuses_before_writing(refusal):
    pytest.importorskip("triton")
    changes, error, words = TRITON_REFUSALS[refusal]
    _assert_refused_without_writing({"backend": "triton", **changes}, error, words)


def test_the_room_error_names_cache_seqlens_its_value_the_new_entries_and_the_cache_length():
    with pytest.raises(fa.AttentionValueError) as info:
        fa.flash_attention_with_kvcache(**step(), cache_seqlens=16)
    assert str(info.value) == (
        "cache_seqlens = 16 leaves no room for the N_new_kv=1 new entries of k and v: 16 + 1 > N_max = 16 "
        "(k_cache.shape[2]); enlarge the caches or pass fewer"
    )
