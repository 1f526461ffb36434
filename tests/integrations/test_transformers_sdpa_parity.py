"""attention_forward against transformers' own ``sdpa_attention_forward``, argument for argument: the same
module, tensors and keywords go to both, and the outputs must agree (float32, within 1e-5)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from flashattn_teach import flash_attention  # noqa: E402
from flashattn_teach.errors import AttentionTypeError, AttentionValueError  # noqa: E402
from flashattn_teach.integrations.transformers import IGNORED_KWARGS, attention_forward  # noqa: E402

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


def _float_mask(visible: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An additive mask as transformers' models and tests build them: 0 where visible, finfo.min elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)


def _visible(N_q: int, N_k: int, seed: int = 1) -> torch.Tensor:
    """A random bool mask ``(B, 1, N_q, N_k)`` (True: visible) in which every row sees its key 0."""
    g = torch.Generator().manual_seed(seed)
    visible = torch.rand(B, 1, N_q, N_k, generator=g) > 0.4
    visible[..., 0] = True
    return visible


# dtype: (atol, rtol) of this library against torch's SDPA in that dtype
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_a_float_4d_mask_is_added_as_torch_does_and_a_row_masked_with_finfo_min_is_not_nan(dtype):
    q, k, v = (t.to(dtype) for t in _qkv(6, 9))
    visible = _visible(6, 9)
    visible[1, 0, 2] = False  # a row that sees no key: finfo.min everywhere, an average of the values in torch
    mask = _float_mask(visible, dtype)
    want, _ = sdpa_attention_forward(_Attention(), q, k, v, mask)
    got, _ = attention_forward(_Attention(), q, k, v, mask)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert not got.isnan().any()


def _bias(N_q: int, N_k: int, heads: int = H_Q) -> torch.Tensor:
    """A position bias ``(1, H_q, N_q, N_k)`` as T5's relative attention buckets give, one per head."""
    return torch.randn(1, heads, N_q, N_k, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize(("N_q", "N_k"), [(7, 7), (7, 11), (1, 11)])  # plain; a static-cache prefill; a decode step
@pytest.mark.parametrize("is_causal", [True, False])
def test_position_bias_is_added_to_the_scores_without_a_mask(N_q, N_k, is_causal):
    q, k, v = _qkv(N_q, N_k)
    module = _Attention(is_causal=is_causal)
    want = _same_as_sdpa(module, q, k, v, None, position_bias=_bias(N_q, N_k), scaling=1.0)
    # negative control: without the bias the result is another
    assert (_same_as_sdpa(module, q, k, v, None, scaling=1.0) - want).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_position_bias_combines_with_a_mask(kind):
    q, k, v = _qkv(6, 9)
    visible = _visible(6, 9)
    mask = visible if kind == "bool" else _float_mask(visible)
    _same_as_sdpa(_Attention(), q, k, v, mask, position_bias=_bias(6, 9), scaling=1.0)


def test_position_bias_with_a_bool_mask_gives_zero_for_a_row_that_sees_no_key():
    # transformers' SDPA turns a bool mask into finfo.min, and such a row into an average of the values; here it
    # is -inf, so the row is 0 as the library's bool masks give (transformers discards those rows)
    q, k, v = _qkv(6, 9)
    visible = _visible(6, 9)
    visible[1, 0, 2] = False
    got, _ = attention_forward(_Attention(), q, k, v, visible, position_bias=_bias(6, 9))
    assert not got.isnan().any() and got[1, 2].abs().max() == 0
    want, _ = sdpa_attention_forward(_Attention(), q, k, v, visible, position_bias=_bias(6, 9))
    seen = visible.any(-1)[:, 0]  # (B, N_q): the rows that see some key
    torch.testing.assert_close(got[seen], want[seen], atol=1e-5, rtol=1e-5)


def test_every_ignored_keyword_changes_nothing():
    q, k, v = _qkv(7, 7)
    mask = _visible(7, 7)
    plain, _ = attention_forward(_Attention(), q, k, v, mask)
    for name in sorted(IGNORED_KWARGS):
        got, _ = attention_forward(_Attention(), q, k, v, mask, **{name: torch.ones(B, 7, dtype=torch.long)})
        assert torch.equal(got, plain), name


@pytest.mark.parametrize("name", ["indices", "block_indices"])
def test_a_keyword_for_a_feature_not_implemented_is_refused_by_name(name):
    q, k, v = _qkv(7, 7)
    with pytest.raises(NotImplementedError, match=rf"{name}.*attn_implementation="):
        attention_forward(_Attention(), q, k, v, None, **{name: torch.zeros(H_Q)})
    attention_forward(_Attention(), q, k, v, None, **{name: None})  # None: the feature is off


def test_s_aux_and_sinks_are_the_attention_sinks_and_both_at_once_is_refused():
    q, k, v = _qkv(7, 7)
    s_aux = torch.linspace(-1.0, 1.0, H_Q, dtype=q.dtype)
    want, _ = attention_forward(_Attention(), q, k, v, None, s_aux=s_aux)
    got, _ = attention_forward(_Attention(), q, k, v, None, sinks=s_aux)
    plain, _ = attention_forward(_Attention(), q, k, v, None)
    assert torch.equal(got, want) and not torch.allclose(want, plain)
    with pytest.raises(AttentionValueError, match=r"s_aux .* and sinks .* are both given"):
        attention_forward(_Attention(), q, k, v, None, s_aux=s_aux, sinks=s_aux.clone())


def test_an_unknown_keyword_is_refused_by_name_not_dropped():
    q, k, v = _qkv(7, 7)
    with pytest.raises(AttentionTypeError, match=r"alibi_bias=.*attn_implementation='sdpa'"):
        attention_forward(_Attention(), q, k, v, None, alibi_bias=torch.zeros(H_Q, 7, 7))


@pytest.mark.parametrize("mask", [torch.ones(B, 1, 7, 7, dtype=torch.long), object()], ids=["int64", "BlockMask-like"])
def test_a_mask_neither_bool_nor_float_is_refused_naming_attention_mask(mask):
    q, k, v = _qkv(7, 7)
    with pytest.raises(AttentionTypeError, match=r"attention_mask of .*bool mask"):
        attention_forward(_Attention(), q, k, v, mask)
