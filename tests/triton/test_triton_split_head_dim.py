"""A query/key head dim of two lane groups (192 = 128 + 64, DeepSeek's MLA prefill; 160 = 128 + 32 real
lanes of 64): the Triton forward and backward give the float64 oracle's O, lse, dQ, dK and dV, and the
launcher takes the split path (``BLOCK_D = 128, BLOCK_D2 = 64``) rather than padding to 256.

The oracle is written out here (softmax of a float64 score matrix), not the code under test. The negative
control: an answer that ignores the second lane group (lanes 128 and up of Q and K) is far outside the
tolerance, so the comparison would see a dropped group.
"""

from __future__ import annotations

import math

import pytest
import torch
from _triton_cases import DEVICE, REL_TOL, assert_close_scaled

from flashattn_teach.triton import AttentionConfig, KernelConfig, launch, triton_attention
from flashattn_teach.triton.configs import lane_groups, shipped_config, table_dim
from flashattn_teach.triton.kernels import backward_dkdv, backward_dq, forward

# small tiles of two shapes in the interpreter: several key and query blocks on short sequences
CONFIG = AttentionConfig.uniform(32, 16)


def oracle(q, k, v, causal: bool, group: int, scale: float | None = None, softcap: float | None = None):
    """O and lse in float64, bottom-right causal (key c visible to row r iff c <= r + N_k - N_q); the
    softcap as Gemma 2's, ``softcap * tanh(scale * q.k / softcap)``."""
    q, k, v = (t.double().cpu() for t in (q, k, v))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    N_q, N_k = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale  # (B, H, N_q, D) @ (B, H, D, N_k) -> (B, H, N_q, N_k)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        visible = torch.arange(N_k)[None, :] <= torch.arange(N_q)[:, None] + (N_k - N_q)
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse  # (B, H, N_q, N_k) @ (B, H, N_k, D_v)


def tensors(D: int, D_v: int, dtype: torch.dtype, group: int, N_q: int = 37, N_k: int = 45):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2 * group, N_q, D, generator=g)
    k = torch.randn(1, 2, N_k, D, generator=g)
    v = torch.randn(1, 2, N_k, D_v, generator=g)
    dO = torch.randn(1, 2 * group, N_q, D_v, generator=g)
    return tuple(t.to(DEVICE, dtype) for t in (q, k, v, dO))


class _Spy:
    """Stands in for a ``@triton.jit`` kernel and records the constexprs of each launch."""

    def __init__(self, kernel, seen: list[dict]) -> None:
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch_it(*args, **kwargs):
            # BLOCK_D2 rides in the flags record F (triton/flags.py)
            self.seen.append(
                {"HEAD_DIM": kwargs["HEAD_DIM"], "BLOCK_D": kwargs["BLOCK_D"], "BLOCK_D2": kwargs["F"].BLOCK_D2}
            )
            return self.kernel[grid](*args, **kwargs)

        return launch_it


@pytest.fixture
def launches(monkeypatch) -> list[dict]:
    seen: list[dict] = []
    for module, name in ((forward, "attn_fwd"), (backward_dkdv, "attn_bwd_dkdv"), (backward_dq, "attn_bwd_dq")):
        monkeypatch.setattr(module, name, _Spy(getattr(module, name), seen))
    return seen


def test_lane_groups_split_129_to_192_only() -> None:
    assert lane_groups(192) == lane_groups(129) == (128, 64)
    assert [lane_groups(d) for d in (64, 128, 193, 256)] == [(64, 0), (128, 0), (256, 0), (256, 0)]
    # the MLA shape has a row of its own; wider values take the 256 row
    assert table_dim(192, 128) == 192 and table_dim(192, 192) == 256 and table_dim(128, 192) == 256
    assert shipped_config(192, torch.bfloat16, "sm90", head_dim_v=128) != shipped_config(192, torch.bfloat16, "sm90")


@pytest.mark.parametrize(
    ("D", "D_v", "causal", "group", "dtype", "deterministic"),
    [
        (192, 128, True, 2, torch.float16, True),
        (192, 128, False, 1, torch.float16, False),
        (192, 192, True, 1, torch.float16, False),
        (160, 128, True, 1, torch.float16, True),
    ],
)
def test_split_head_dim_matches_the_float64_oracle(
    launches, D: int, D_v: int, causal: bool, group: int, dtype: torch.dtype, deterministic: bool
) -> None:
    q, k, v, dO = tensors(D, D_v, dtype, group)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    O, lse = triton_attention(
        q, k, v, causal=causal, causal_align="bottom_right", enable_gqa=True, return_lse=True, config=CONFIG,
        deterministic=deterministic,
    )  # fmt: skip
    (O * dO).sum().backward()

    qd, kd, vd = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    O_ref, lse_ref = oracle(qd, kd, vd, causal, group)
    (O_ref * dO.double().cpu()).sum().backward()
    tol = REL_TOL[dtype]
    assert_close_scaled(O, O_ref, tol, "O")
    assert_close_scaled(lse, lse_ref, tol, "lse")
    for name, got, want in (("dq", q.grad, qd.grad), ("dk", k.grad, kd.grad), ("dv", v.grad, vd.grad)):
        assert got.shape == want.shape
        assert_close_scaled(got, want, 2 * tol, name)
    # forward, then the dK/dV (or one-kernel) pass and, when deterministic, the dQ pass: all split
    assert len(launches) == (3 if deterministic else 2)
    assert all(c == {"HEAD_DIM": D, "BLOCK_D": 128, "BLOCK_D2": 64} for c in launches)

    # negative control: without the second lane group's scores the answer is far off
    q_lo = qd.detach().clone()
    q_lo[..., 128:] = 0  # the second lane group's share of every score dropped, the scale kept
    O_lo, _ = oracle(q_lo, kd.detach(), vd.detach(), causal, group)
    err = (O_lo - O_ref.detach()).abs().max().item()
    assert err > 20 * tol * max(1.0, O_ref.abs().max().item())


def test_other_head_dims_launch_one_lane_group(launches) -> None:
    q, k, v, _ = tensors(200, 128, torch.float16, 1, N_q=16, N_k=16)
    launch_out = triton_attention(q, k, v, config=CONFIG)
    assert launch_out.shape == (1, 2, 16, 128)
    assert launches == [{"HEAD_DIM": 200, "BLOCK_D": 256, "BLOCK_D2": 0}]
    assert launch.lane_groups is lane_groups


# the warp-specialised forward's source (descriptors made in the kernel, one key loop) runs in the interpreter
WS_TILE = KernelConfig(32, 16, 4, 1, tma=True, ws=True, fallback=KernelConfig(16, 16, 4, 1))


@pytest.mark.parametrize(("N_q", "N_k", "causal"), [(37, 45, True), (32, 48, False)])
def test_split_head_dim_in_the_warp_specialised_forward_matches_the_oracle(launches, monkeypatch, N_q, N_k, causal):
    ran = []
    real = launch.forward_tile
    monkeypatch.setattr(launch, "forward_tile", lambda *args: ran.append(real(*args)) or ran[-1])
    q, k, v, _ = tensors(192, 128, torch.float16, 2, N_q=N_q, N_k=N_k)
    config = AttentionConfig(forward=WS_TILE, backward_dkdv=None, backward_dq=None)
    O, lse = triton_attention(
        q, k, v, causal=causal, causal_align="bottom_right", enable_gqa=True, return_lse=True, config=config
    )
    assert ran == [(WS_TILE, True)] and launches == [{"HEAD_DIM": 192, "BLOCK_D": 128, "BLOCK_D2": 64}]
    O_ref, lse_ref = oracle(q, k, v, causal, 2)
    assert_close_scaled(O, O_ref, REL_TOL[torch.float16], "O")
    assert_close_scaled(lse, lse_ref, REL_TOL[torch.float16], "lse")


@pytest.mark.parametrize(("scale", "softcap"), [(-0.2, None), (0.3, 4.0)])
def test_split_head_dim_with_a_negative_scale_or_a_softcap_matches_the_oracle(scale, softcap) -> None:
    """A negative scale negates both lane groups of Q (``NEGATE_Q``); a softcap scales the summed scores."""
    q, k, v, dO = tensors(192, 128, torch.float16, 1, N_q=33, N_k=40)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    O, lse = triton_attention(
        q, k, v, causal=True, causal_align="bottom_right", scale=scale, softcap=softcap, return_lse=True,
        config=CONFIG, deterministic=True,
    )  # fmt: skip
    (O * dO).sum().backward()
    qd, kd, vd = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    O_ref, lse_ref = oracle(qd, kd, vd, True, 1, scale=scale, softcap=softcap)
    (O_ref * dO.double().cpu()).sum().backward()
    tol = REL_TOL[torch.float16]
    assert_close_scaled(O, O_ref, tol, "O")
    assert_close_scaled(lse, lse_ref, tol, "lse")
    for name, got, want in (("dq", q.grad, qd.grad), ("dk", k.grad, kd.grad), ("dv", v.grad, vd.grad)):
        assert_close_scaled(got, want, 2 * tol, name)
