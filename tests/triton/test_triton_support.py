"""What the Triton path accepts, what it refuses and why, and the configuration table's invariants."""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICE

from flashattn_teach.errors import AttentionTypeError, AttentionValueError
from flashattn_teach.triton import AttentionConfig, KernelConfig, triton_attention, unsupported_reason
from flashattn_teach.triton.configs import ARCHS, KERNELS, block_d, max_head_dim, shipped_config, shipped_configs


def qkv(D: int, dtype: torch.dtype, requires_grad: bool = False, H_kv: int = 2):
    q = torch.randn(1, 4, 8, D, dtype=dtype, device=DEVICE, requires_grad=requires_grad)
    k = torch.randn(1, H_kv, 8, D, dtype=dtype, device=DEVICE)
    return q, k, k.clone()


def test_supported_inputs_have_no_reason() -> None:
    assert (
        unsupported_reason(*qkv(64, torch.float16), causal=True, causal_align="bottom_right", enable_gqa=True) is None
    )
    assert unsupported_reason(*qkv(256, torch.float16), enable_gqa=True) is None
    assert unsupported_reason(*qkv(256, torch.float16, requires_grad=True), enable_gqa=True) is None  # split dK/dV
    assert unsupported_reason(*qkv(64, torch.float32, requires_grad=True), enable_gqa=True) is None
    assert unsupported_reason(*qkv(128, torch.float32, requires_grad=True), enable_gqa=True) is None


@pytest.mark.parametrize(
    ("args", "kwargs", "phrase"),
    [
        (qkv(64, torch.float64), {"enable_gqa": True}, "float64"),
        (qkv(160, torch.float32), {"enable_gqa": True}, "head dimensions"),
        (qkv(160, torch.float32, requires_grad=True), {"enable_gqa": True}, "forward and backward"),
        (qkv(288, torch.float16, requires_grad=True), {"enable_gqa": True}, "forward and backward"),
        (qkv(64, torch.float16), {}, "enable_gqa"),
        (qkv(64, torch.float16), {"enable_gqa": True, "causal_align": "middle"}, "causal_align"),
    ],
)
def test_unsupported_inputs_give_a_reason_without_raising(args, kwargs, phrase: str) -> None:
    reason = unsupported_reason(*args, **kwargs)
    assert reason is not None and phrase in reason


def test_cpu_tensors_need_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = (t.cpu() for t in qkv(64, torch.float16, H_kv=4))
    assert "CUDA" in unsupported_reason(q, k, v)


def test_triton_attention_raises_the_reason() -> None:
    with pytest.raises(ValueError, match="float64"):
        triton_attention(*qkv(32, torch.float64, H_kv=4))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_shipped_tile_is_a_power_of_two_of_at_least_16(arch: str) -> None:
    for _, _, config in shipped_configs(arch):
        for name in KERNELS:
            c = config.kernel(name)
            if c is not None and name != "backward_preprocess":
                assert c.BLOCK_M >= 16 and c.BLOCK_N >= 16
                assert c.BLOCK_M & (c.BLOCK_M - 1) == 0 and c.BLOCK_N & (c.BLOCK_N - 1) == 0


def test_head_dims_pad_to_the_next_power_of_two() -> None:
    padded = {1: 16, 16: 16, 17: 32, 40: 64, 64: 64, 80: 128, 96: 128, 128: 128, 129: 256, 256: 256}
    assert {d: block_d(d) for d in padded} == padded
    assert max_head_dim(torch.float16, backward=False) == 256 and max_head_dim(torch.float16, backward=True) == 256
    assert max_head_dim(torch.float32, backward=False) == 128 and max_head_dim(torch.float32, backward=True) == 128


def test_uniform_config_sets_every_kernel() -> None:
    c = AttentionConfig.uniform(32, 16)
    assert c.forward == c.backward_dkdv == c.backward_dq and c.forward.BLOCK_M == 32


def test_autotune_picks_the_fastest_candidate_and_the_result_is_unchanged() -> None:
    from flashattn_teach.triton.autotune import autotune

    q, k, v = qkv(16, torch.float32)
    fast, slow = AttentionConfig.uniform(16, 16), AttentionConfig.uniform(32, 16)
    calls = iter([2.0, 1.0])  # milliseconds reported for slow, then fast
    best = autotune(q, k, v, causal=True, enable_gqa=True, candidates=[slow, fast], timer=lambda fn: next(calls))
    assert best == fast
    O = triton_attention(q, k, v, causal=True, enable_gqa=True, config="autotune")
    assert torch.allclose(O, triton_attention(q, k, v, causal=True, enable_gqa=True, config=fast), atol=1e-6)


def test_autotune_names_a_bad_argument() -> None:
    from flashattn_teach.triton.autotune import autotune

    q, k, v = qkv(16, torch.float32, H_kv=4)
    with pytest.raises(AttentionValueError, match="candidates"):
        autotune(q, k, v, candidates=[])
    with pytest.raises(AttentionTypeError, match="candidates"):
        autotune(q, k, v, candidates=[(32, 16)])
    forward_only = AttentionConfig(forward=KernelConfig(16, 16, 4, 1), backward_dkdv=None, backward_dq=None)
    with pytest.raises(AttentionValueError, match="backward_dkdv=None"):
        autotune(q, k, v, candidates=[forward_only], backward=True)
    with pytest.raises(AttentionTypeError, match="float64"):
        autotune(*qkv(16, torch.float64, H_kv=4))


@pytest.mark.parametrize(
    ("args", "error", "phrase"),
    [
        ((64, torch.float16, "sm70"), AttentionValueError, "arch"),
        ((64, torch.float64, "sm90"), AttentionTypeError, "dtype"),
        ((512, torch.float16, "sm90"), AttentionValueError, "head_dim"),
        ((160, torch.float32, "sm80"), AttentionValueError, "head_dim"),
    ],
)
def test_shipped_config_names_a_bad_argument(args, error: type[Exception], phrase: str) -> None:
    with pytest.raises(error, match=phrase):
        shipped_config(*args)


def test_a_triton_older_than_the_kernels_need_is_a_reason_by_version(monkeypatch) -> None:
    from flashattn_teach.triton import support

    support.triton_reason.cache_clear()
    try:
        assert support.triton_reason() is None  # the installed one (the control)
        monkeypatch.setattr(support, "_triton_version", lambda: (3, 3))
        support.triton_reason.cache_clear()
        why = support.triton_reason()
        assert why is not None and "3.3" in why and "triton>=3.4" in why
    finally:
        support.triton_reason.cache_clear()
