"""The FP8 (e4m3) CPU emulation with torch-style broadcasting, as the bf16 call takes it: ``q`` of batch 2
against ``k, v`` of batch 1, ``k`` with one head and ``v`` with two, one query head against two key/value
heads. The descales are per (batch element, key/value head) of the call after broadcasting. Judged against
the same call on inputs expanded by hand (every size explicit: the path the oracle tests of test_fp8.py
cover), and against torch's SDPA in float64 on the dequantised inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashattn_teach as fa
from flashattn_teach.errors import AttentionValueError

E4M3 = torch.float8_e4m3fn
N_q, N_k, D = 37, 45, 32

# name: shapes of q, k, v; the call's (B, H_q, H_kv); enable_gqa
CASES = {
    "q_batch_2_kv_batch_1": ((2, 4, N_q, D), (1, 2, N_k, D), (1, 2, N_k, D), (2, 4, 2), True),
    "kv_batch_2_q_batch_1": ((1, 2, N_q, D), (2, 2, N_k, D), (2, 2, N_k, D), (2, 2, 2), False),
    "k_one_head_v_two": ((1, 2, N_q, D), (1, 1, N_k, D), (1, 2, N_k, D), (1, 2, 2), False),
    "q_one_head_kv_two": ((2, 1, N_q, D), (2, 2, N_k, D), (2, 2, N_k, D), (2, 2, 2), False),
}


def e4m3(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * 8).to(E4M3)


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_call_broadcasts_as_the_bf16_call(case: str) -> None:
    qs, ks, vs, (B, H_q, H_kv), gqa = CASES[case]
    g = torch.Generator().manual_seed(1)
    q8, k8, v8 = e4m3(qs, g), e4m3(ks, g), e4m3(vs, g)
    qd, kd, vd = (torch.rand(B, H_kv, generator=g) / 8 + 0.01 for _ in range(3))  # different per (b, h_kv)
    d = dict(q_descale=qd, k_descale=kd, v_descale=vd, enable_gqa=gqa, causal=True, return_lse=True)
    O, lse = fa.flash_attention(q8, k8, v8, **d)
    assert O.shape == (B, H_q, N_q, D)
    # the same call with every input expanded by hand to the call's sizes
    full = [t.float().expand(B, h, *t.shape[2:]).contiguous().to(E4M3) for t, h in ((q8, H_q), (k8, H_kv), (v8, H_kv))]
    O_full, lse_full = fa.flash_attention(*full, **d)
    torch.testing.assert_close(O, O_full, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_full, rtol=0, atol=0)
    # and the meaning: SDPA in float64 on the dequantised inputs, q_fp8 * q_descale[b, h // G] and alike
    G = H_q // H_kv
    Q = full[0].double() * qd.double().repeat_interleave(G, dim=1)[..., None, None]
    K, V = (t.double() * s.double()[..., None, None] for t, s in zip(full[1:], (kd, vd), strict=True))
    ref = F.scaled_dot_product_attention(
        Q, K.repeat_interleave(G, dim=1), V.repeat_interleave(G, dim=1), is_causal=True
    )
    scale = (ref - O.double()).abs().max() / ref.abs().max()
    assert scale < 0.05  # e4m3 weights: a few percent at most (test_fp8.py bounds it against bf16's error)


def test_fp8_descales_are_of_the_broadcast_call() -> None:
    """A descale of ``k``'s own (batch 1) shape where the call has batch 2 is refused by name, saying the
    sizes are the call's after broadcasting."""
    g = torch.Generator().manual_seed(2)
    q8, k8, v8 = e4m3((2, 2, 5, D), g), e4m3((1, 2, 7, D), g), e4m3((1, 2, 7, D), g)
    with pytest.raises(AttentionValueError, match=r"k_descale must have shape \(B, H_kv\) = \(2, 2\).*broadcast"):
        fa.flash_attention(q8, k8, v8, k_descale=torch.ones(1, 2))
