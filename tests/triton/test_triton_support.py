"""What the Triton path accepts, what it refuses and why, and the configuration table's invariants."""

from __future__ import annotations

import pytest
import torch
from _triton_cases import DEVICE

from flashattn_teach.triton import AttentionConfig, triton_attention, unsupported_reason
from flashattn_teach.triton.configs import ARCHS, KERNELS, block_d, max_head_dim, shipped_configs


def qkv(D: int, dtype: torch.dtype, requires_grad: bool = False, H_kv: int = 2):
    q = torch.randn(1, 4, 8, D, dtype=dtype, device=DEVICE, requires_grad=requires_grad)
    k = torch.randn(1, H_kv, 8, D, dtype=dtype, device=DEVICE)
    return q, k, k.clone()


def test_supported_inputs_have_no_reason() -> None:
    assert (
        unsupported_reason(*qkv(64, torch.float16), causal=True, causal_align="bottom_right", enable_gqa=True) is None
    )
    assert unsupported_reason(*qkv(256, torch.float16), enable_gqa=True) is None  # forward only
    assert unsupported_reason(*qkv(64, torch.float32, requires_grad=True), enable_gqa=True) is None


@pytest.mark.parametrize(
    ("args", "kwargs", "phrase"),
    [
        (qkv(64, torch.float64), {"enable_gqa": True}, "float64"),
        (qkv(128, torch.float32), {"enable_gqa": True}, "head dimensions"),
        (qkv(256, torch.float16, requires_grad=True), {"enable_gqa": True}, "forward and backward"),
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
    assert [block_d(d) for d in (1, 16, 17, 40, 64, 80, 96, 128, 129, 256)] == [
        16,
        16,
        32,
        64,
        64,
        128,
        128,
        128,
        256,
        256,
    ]
    assert max_head_dim(torch.float16, backward=False) == 256 and max_head_dim(torch.float16, backward=True) == 128


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
