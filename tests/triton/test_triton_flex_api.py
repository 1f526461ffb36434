"""The user's plain Python functions through the public functions into the Triton kernels (in the
interpreter): translated by :mod:`flashattn_teach.triton.usermod`, run with the block mask's tile kinds,
against the float64 dense path with the same functions; and the calls the kernels refuse, each with its
reason, which the planner and ``explain`` give.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _triton_cases import DEVICE, REL_TOL, assert_close_scaled  # noqa: E402

import flashattn_teach as fa  # noqa: E402
from flashattn_teach._options import make_options  # noqa: E402
from flashattn_teach.errors import BackendUnavailableError  # noqa: E402
from flashattn_teach.triton import generated_sources  # noqa: E402
from flashattn_teach.triton.support import call_unsupported_reason, mods_unsupported_reason  # noqa: E402

B, H, N, D = 2, 2, 113, 32


def _tensors(seed: int = 0, N_k: int = N) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, N_k, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, N_k, D, generator=g, dtype=torch.float64)
    return q, k, v


def _run(q, k, v, backend: str, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    O, lse = fa.flash_attention(q, k, v, backend=backend, return_lse=True, **kwargs)
    O.sum().backward()
    return O, lse, q.grad, k.grad, v.grad


def _same_as_dense(**kwargs) -> None:
    q, k, v = _tensors()
    got = _run(*(t.to(DEVICE, torch.float32) for t in (q, k, v)), "triton", **kwargs)
    want = _run(q, k, v, "dense", **kwargs)
    for what, a, b in zip(("O", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert_close_scaled(a, b, 2 * REL_TOL[torch.float32], what)


def test_document_mask_and_softcap_score_mod_translated_match_the_dense_path() -> None:
    docs = torch.randint(0, 5, (B, N), generator=torch.Generator().manual_seed(3)).sort(-1).values

    def document_causal(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30 * torch.tanh(score / 30)

    # blocks of 32 re-tiled to the launch's 32 x 16 tiles (conservatively, by the block mask)
    block_mask = fa.create_block_mask(document_causal, B, None, N, N, BLOCK_SIZE=32)
    _same_as_dense(score_mod=softcap, block_mask=block_mask)


def test_a_per_head_bias_without_grad_and_a_mask_mod_alone_match_the_dense_path() -> None:
    bias = torch.tensor([0.7, -1.3])

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h] - 0.02 * (q_idx - kv_idx).abs()

    def stripes(b, h, q_idx, kv_idx):
        return (kv_idx % 4 != 1) | (q_idx == kv_idx)

    _same_as_dense(score_mod=head_bias, mask_mod=stripes)


def test_generated_sources_print_what_the_kernels_run() -> None:
    q, k, v = (t.float() for t in _tensors())

    def rel(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx)

    opts = make_options(q, k, v, score_mod=rel)
    assert "def score_mod" in generated_sources(opts) and "def score_grad" in generated_sources(opts)
    assert "translated into @triton.jit" in str(fa.explain(q, k, v, score_mod=rel, backend="triton"))


def _reason(q, k, v, **kwargs) -> str | None:
    return call_unsupported_reason(q, k, v, make_options(q, k, v, **kwargs))


def test_learned_biases_run_on_the_cpu_reference_with_the_reason_named() -> None:
    q, k, v = (t.float() for t in _tensors())
    bias = torch.zeros(H, requires_grad=True)

    def learned(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    reason = _reason(q, k, v, score_mod=learned)
    assert reason is not None and "learned biases' gradients run on the CPU reference" in reason
    with pytest.raises(BackendUnavailableError, match="learned biases"):
        fa.flash_attention(q, k, v, score_mod=learned, backend="triton")
    with torch.no_grad():  # no gradient to take: the kernels run it
        assert _reason(q, k, v, score_mod=learned) is None


def test_a_function_the_translator_does_not_take_is_refused_naming_the_operation() -> None:
    q, k, v = (t.float() for t in _tensors())

    def reduces(score, b, h, q_idx, kv_idx):
        return score - score.amax()

    reason = _reason(q, k, v, score_mod=reduces)
    assert reason is not None and "amax" in reason and "test_triton_flex_api.py" in reason


def test_more_captured_tensors_than_the_kernels_take_are_refused() -> None:
    q, k, v = (t.float() for t in _tensors())
    a, b_, c, d, e = (torch.randn(H) for _ in range(5))

    def five(score, b, h, q_idx, kv_idx):
        return score + a[h] + b_[h] + c[h] + d[h] + e[h]

    reason = _reason(q, k, v, score_mod=five)
    assert reason is not None and "5" in reason and "4" in reason


def test_a_captured_tensor_on_another_device_is_refused_naming_both() -> None:
    q, k, v = (t.float() for t in _tensors())
    elsewhere = torch.zeros(H, device="meta")

    def biased(score, b, h, q_idx, kv_idx):
        return score + elsewhere[h]

    reason = mods_unsupported_reason(make_options(q, k, v, score_mod=biased), q.device)
    assert reason is not None and "meta" in reason and "cpu" in reason


def test_a_call_without_user_functions_has_no_mods_reason() -> None:
    q, k, v = (t.float() for t in _tensors())
    assert mods_unsupported_reason(make_options(q, k, v, causal=True)) is None


def test_a_capture_changed_in_place_before_the_backward_is_refused() -> None:
    q, k, v = (t.to(DEVICE, torch.float32).requires_grad_() for t in _tensors())
    bias = torch.tensor([0.5, -0.5], device=DEVICE)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    O = fa.flash_attention(q, k, v, score_mod=head_bias, backend="triton")
    bias.mul_(2.0)  # the backward kernels would read the new values
    with pytest.raises(fa.AttentionValueError, match="modified in place"):
        O.sum().backward()
    O = fa.flash_attention(q, k, v, score_mod=head_bias, backend="triton")
    O.sum().backward()  # the control: unchanged since its forward, it differentiates
    assert q.grad is not None and torch.isfinite(q.grad).all()
