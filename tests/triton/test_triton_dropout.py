"""Dropout in the Triton kernels draws :mod:`flashattn_teach.dropout`'s keep mask: for the same key the
interpreter's output and gradients equal a float64 dense computation that drops the same weights, and
``torch.manual_seed`` makes a call repeatable.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _triton_cases import DEVICE, REL_TOL, assert_close_scaled  # noqa: E402

import flashattn_teach as fa  # noqa: E402
from flashattn_teach import dropout as dp  # noqa: E402
from flashattn_teach._options import make_options  # noqa: E402
from flashattn_teach.triton import AttentionConfig, triton_attention  # noqa: E402

CONFIG = AttentionConfig.uniform(16, 16)


def dense_with_dropout(q, k, v, key: dp.DropoutKey, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """``(O, lse)`` from all ``N_q x N_k`` weights, with the mask contract's visibility and the key's
    dropout applied to ``P`` (not to ``lse``); grouped heads by repeating K and V."""
    opts = make_options(q, k, v, enable_gqa=True, **options)
    s = opts.shapes
    k, v = (t.repeat_interleave(s.group, dim=1) for t in (k, v))  # (B, H_q, N_k, .)
    S = s.scale * q @ k.transpose(-1, -2)  # (B, H_q, N_q, D) @ (B, H_q, D, N_k) -> (B, H_q, N_q, N_k)
    visible, bias = opts.mask.dense(q.device)
    assert bias is None
    if visible is not None:
        S = S.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(S, dim=-1)  # (B, H_q, N_q)
    P = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(S - lse[..., None]))
    B, H_q = q.shape[:2]
    bh = torch.arange(B * H_q).reshape(B, H_q, 1, 1)
    rows, cols = torch.arange(s.N_q)[:, None], torch.arange(s.N_k)[None, :]
    return dp.drop(P, key, bh, rows, cols, s.N_q, s.N_k) @ v, lse  # (B, H_q, N_q, N_k) @ (B, H_q, N_k, D_v)


def _run(f, q, k, v, dO):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    O, lse = f(q, k, v)
    (O * dO.to(O.dtype)).sum().backward()
    return O, lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"causal": True, "causal_align": "bottom_right"},
        {"window": (7, 3), "seqlens_k": torch.tensor([0, 40])},
    ],
    ids=["plain", "causal_bottom_right", "window_and_seqlens_k"],
)
def test_dropout_matches_the_dense_computation_with_the_same_keep_mask(options: dict) -> None:
    g = torch.Generator().manual_seed(0)
    B, H_kv, group, N_q, N_k, D = 2, 1, 2, 37, 53, 16
    q = torch.randn(B, H_kv * group, N_q, D, generator=g)
    k = torch.randn(B, H_kv, N_k, D, generator=g)
    v = torch.randn(B, H_kv, N_k, D, generator=g)
    dO = torch.randn(B, H_kv * group, N_q, D, generator=g)
    key = dp.DropoutKey(p=0.3, seed=2**40 + 12345, offset=7)  # a 64-bit seed and a nonzero offset
    got = _run(
        lambda q, k, v: triton_attention(
            q, k, v, enable_gqa=True, return_lse=True, config=CONFIG, dropout_key=key, **options
        ),
        *(t.to(DEVICE) for t in (q, k, v, dO)),
    )
    want = _run(lambda q, k, v: dense_with_dropout(q, k, v, key, **options), *(t.double() for t in (q, k, v, dO)))
    for what, a, b in zip(("O", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert_close_scaled(a, b, 2 * REL_TOL[torch.float32], what)


def test_dropout_drops_something_and_the_seed_follows_torch_manual_seed() -> None:
    q = torch.randn(1, 2, 24, 16, device=DEVICE)

    def call() -> torch.Tensor:
        return triton_attention(q, q, q, dropout_p=0.5, config=CONFIG)

    torch.manual_seed(3)
    first = call()
    torch.manual_seed(3)
    assert torch.equal(call(), first)
    assert not torch.equal(call(), first)  # the generator moved on: a new key
    assert not torch.allclose(first, triton_attention(q, q, q, config=CONFIG))


def test_the_api_sends_dropout_to_triton_with_the_calls_key():
    """flash_attention(backend="triton") draws one key per call, as every backend does, so under one seed the
    Triton call and the dense oracle drop the same weights (values and gradients)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, n, 32, generator=g, device=DEVICE) for h, n in ((4, 37), (2, 53), (2, 53)))
    results = {}
    for backend in ("triton", "dense"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(7)
        O = fa.flash_attention(*leaves, causal=True, window=(9, 0), dropout_p=0.3, backend=backend)
        results[backend] = (O, *torch.autograd.grad(O.square().sum(), leaves))
    for name, got, expected in zip(("O", "dq", "dk", "dv"), results["triton"], results["dense"], strict=True):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4, msg=name)
