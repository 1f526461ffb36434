"""attention_forward against transformers' own ``sdpa_attention_forward``, argument for argument: the same
module, tensors and keywords go to both, and the outputs must agree (float32, within 1e-5)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from flashattn_teach import flash_attention  # noqa: E402
from flashattn_teach.integrations.transformers import attention_forward  # noqa: E402

B, H_Q, H_KV, D = 2, 4, 2, 16


class _Attention(torch.nn.Module):
    """What the attention functions read from a model's attention module."""

    def __init__(self, is_causal: bool = True) -> None:
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = H_Q // H_KV


def _qkv(N_q: int, N_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_Q, N_q, D, generator=g)
    k, v = (torch.randn(B, H_KV, N_k, D, generator=g) for _ in range(2))
    return q, k, v


def _same_as_sdpa(module, q, k, v, mask, **kwargs) -> torch.Tensor:
    """Run both; check they agree; return transformers' output ``(B, N_q, H_q, D_v)``."""
    want, _ = sdpa_attention_forward(module, q, k, v, mask, **kwargs)
    got, weights = attention_forward(module, q, k, v, mask, **kwargs)
    assert weights is None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    return want


def test_without_a_mask_a_prefill_into_a_static_cache_is_causal_top_left():
    # Prefill of 9 tokens into a static cache of 11 slots: transformers passes no mask and every slot as keys.
    q, k, v = _qkv(9, 11)
    want = _same_as_sdpa(_Attention(), q, k, v, None, scaling=D**-0.5)
    # negative control: bottom-right alignment lets the prompt see the 2 empty slots, which shows here
    bottom_right = flash_attention(q, k, v, causal=True, causal_align="bottom_right").transpose(1, 2)
    assert (bottom_right - want).abs().max() > 1e-2


def test_without_a_mask_one_query_row_sees_every_key():
    q, k, v = _qkv(1, 11)
    _same_as_sdpa(_Attention(is_causal=True), q, k, v, None)


@pytest.mark.parametrize(("call", "module"), [(False, True), (True, False), (None, True), (None, False)])
def test_is_causal_of_the_call_wins_over_the_module(call, module):
    q, k, v = _qkv(7, 7)
    want = _same_as_sdpa(_Attention(is_causal=module), q, k, v, None, is_causal=call)
    # negative control: the other choice gives another result
    other = flash_attention(q, k, v, causal=not (module if call is None else call)).transpose(1, 2)
    assert (other - want).abs().max() > 1e-2
