"""The FP8 (e4m3) forward on the CPU: its emulation against a float64 oracle of the dequantised inputs, its
one rounding checked by an independent dense formula, and the checks of its arguments.

FA3's convention (flashattn_teach._validate.fp8): the inputs meant are ``q_fp8 * q_descale[b, h_kv]`` and
likewise for k and v. The oracle here is torch's SDPA in float64 on those dequantised inputs; the figure of
merit is the error of bfloat16 attention (torch's SDPA in bf16) on the same inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashattn_teach as fa
from flashattn_teach.errors import AttentionError, AttentionTypeError, AttentionValueError

E4M3 = torch.float8_e4m3fn


def quantised(B: int, H: int, H_kv: int, N_q: int, N_k: int, D: int, seed: int = 0, D_v: int | None = None):
    """``q8, k8, v8`` e4m3 and their descales ``(B, H_kv)``, quantised per (batch, kv head) as FA3's users
    do (descale = amax / 448, the largest e4m3 value)."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, N_q, D), (B, H_kv, N_k, D), (B, H_kv, N_k, D_v or D))
    out = []
    for shape in shapes:
        t = torch.randn(shape, generator=g)
        per = t.reshape(B, H_kv, -1)  # the query heads of kv head h_kv share its factor
        d = per.abs().amax(-1) / 448.0  # (B, H_kv)
        out += [(per / d[..., None]).reshape(shape).to(E4M3), d]
    return out  # q8, qd, k8, kd, v8, vd


def dequantised(t8: torch.Tensor, d: torch.Tensor, H_q: int) -> torch.Tensor:
    """``t8 * d`` in float64, its heads repeated up to ``H_q`` (the oracle's GQA)."""
    B, H = t8.shape[:2]
    x = (t8.double().reshape(B, d.shape[1], -1) * d.double()[..., None]).reshape(t8.shape)
    return x.repeat_interleave(H_q // H, dim=1)


@pytest.mark.parametrize(
    ("B", "H", "H_kv", "N", "D", "causal"),
    [(1, 4, 2, 128, 64, True), (2, 2, 2, 113, 128, False), (1, 2, 1, 203, 64, True)],
)
def test_fp8_emulation_error_is_bounded_by_eight_times_bf16s(B, H, H_kv, N, D, causal) -> None:
    q8, qd, k8, kd, v8, vd = quantised(B, H, H_kv, N, N, D)
    Q, K, V = dequantised(q8, qd, H), dequantised(k8, kd, H), dequantised(v8, vd, H)
    ref = F.scaled_dot_product_attention(Q, K, V, is_causal=causal)
    ref_lse = torch.logsumexp(
        (Q @ K.transpose(-2, -1) * D**-0.5).masked_fill(
            torch.ones(N, N, dtype=torch.bool).triu(1) if causal else torch.zeros(N, N, dtype=torch.bool), -torch.inf
        ),
        dim=-1,
    )
    O, lse = fa.flash_attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)
    bf16 = F.scaled_dot_product_attention(Q.bfloat16(), K.bfloat16(), V.bfloat16(), is_causal=causal).double()
    assert O.dtype == torch.bfloat16 and lse.dtype == torch.float32
    err, err_bf16 = (O.double() - ref).abs(), (bf16 - ref).abs()
    # e4m3 weights (3 mantissa bits against bf16's 7): measured 2 to 6x bf16's error at most, about 6x on average
    assert err.max() <= 8 * err_bf16.max()
    assert err.mean() <= 8 * err_bf16.mean()
    # lse sums the unrounded weights: only fp32 arithmetic stands between it and the oracle
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=0)
    # negative control: the weights are rounded, so the output is further from the oracle than bf16's
    assert err.mean() > 2 * err_bf16.mean()


def test_fp8_emulation_with_sinks_matches_the_sink_column_oracle() -> None:
    B, H, H_kv, N, D = 1, 4, 2, 96, 64
    q8, qd, k8, kd, v8, vd = quantised(B, H, H_kv, N, N, D, seed=4)
    Q, K, V = dequantised(q8, qd, H), dequantised(k8, kd, H), dequantised(v8, vd, H)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 6.0])
    S = (Q @ K.transpose(-2, -1) * D**-0.5).masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -torch.inf)
    with_sink = torch.cat([S, sinks.double().reshape(1, H, 1, 1).expand(B, H, N, 1)], dim=-1)  # (B, H, N, N + 1)
    ref = with_sink.softmax(-1)[..., :N] @ V
    ref_lse = torch.logsumexp(with_sink, dim=-1)
    O, lse = fa.flash_attention(
        q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, sinks=sinks, return_lse=True
    )
    bf16 = fa.flash_attention(Q.bfloat16(), K.bfloat16(), V.bfloat16(), causal=True, sinks=sinks).double()
    err, err_bf16 = (O.double() - ref).abs(), (bf16 - ref).abs()
    assert err.max() <= 8 * err_bf16.max()
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=0)
    # negative control: without its sink the oracle is far from the output (head 3's sink takes most weight)
    no_sink = S.softmax(-1) @ V
    assert (O.double() - no_sink).abs().max() > 100 * err_bf16.max()


def test_fp8_emulation_rounds_each_tiles_weights_to_e4m3() -> None:
    """With one key tile the emulation is a dense formula, computed here independently: the weights are
    rounded to e4m3 after the running max (the row max) is subtracted, ``l`` sums them unrounded."""
    from flashattn_teach._options import make_options
    from flashattn_teach._validate.fp8 import check_fp8
    from flashattn_teach.reference.fp8 import fp8_forward

    B, H, H_kv, N, D = 1, 2, 1, 48, 64
    q8, qd, k8, kd, v8, vd = quantised(B, H, H_kv, N, N, D, seed=3)
    kd = -kd  # a negative factor flips the scores' sign: the max is taken after it
    descale = check_fp8(q8, k8, v8, (qd, kd, vd), refused={})
    opts = make_options(q8, k8, v8, enable_gqa=True, descale=descale)
    O, _ = fp8_forward(q8, k8, v8, opts, block_m=16, block_n=N)
    S = (q8.float() @ k8.float().repeat_interleave(2, 1).transpose(-2, -1)) * (D**-0.5 * qd * kd).reshape(1, 1, 1, 1)
    P = torch.exp(S - S.amax(-1, keepdim=True))
    want = (P.to(E4M3).float() @ v8.float().repeat_interleave(2, 1)) / P.sum(-1, keepdim=True) * vd.reshape(1, 1, 1, 1)
    # O is the formula's fp32 value rounded to bf16: within half a bf16 ulp (2^-8 relative) and a sum order
    within_bf16 = lambda x: ((O.float() - x).abs() <= x.abs() * 2**-8 + 1e-5).float().mean()  # noqa: E731
    assert within_bf16(want) == 1.0
    # negative control: without rounding the weights most of the outputs fall outside that bound
    unrounded = (P @ v8.float().repeat_interleave(2, 1)) / P.sum(-1, keepdim=True) * vd.reshape(1, 1, 1, 1)
    assert within_bf16(unrounded) < 0.5


def test_every_cpu_backend_runs_the_one_emulation_with_masks() -> None:
    q8, qd, k8, kd, v8, vd = quantised(2, 2, 1, 37, 70, 64, seed=1)
    seqlens = torch.tensor([70, 0])  # the second batch element sees no key
    kwargs = dict(
        causal=True, causal_align="bottom_right", window=(20, 0), softcap=5.0, seqlens_k=seqlens,
        alibi_slopes=torch.tensor([0.1, 0.3]), q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True,
    )  # fmt: skip
    results = {
        b: fa.flash_attention(q8, k8, v8, backend=b, **kwargs) for b in ("auto", "query_major", "dense", "parallel")
    }
    O, lse = results["auto"]
    for b, (O_b, lse_b) in results.items():
        assert torch.equal(O_b, O) and torch.equal(lse_b, lse), b
    assert torch.all(O[1] == 0) and torch.all(lse[1] == -torch.inf)  # no key: O = 0, lse = -inf
    assert torch.isfinite(lse[0]).all() and O[0].abs().sum() > 0


def test_fp8_arguments_are_checked_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    q8, qd, k8, _, v8, vd = quantised(1, 2, 1, 16, 16, 64)
    call = lambda q=q8, k=k8, v=v8, **kw: fa.flash_attention(q, k, v, **kw)  # noqa: E731
    with pytest.raises(AttentionTypeError, match=r"v torch\.bfloat16"):
        call(v=v8.bfloat16())
    with pytest.raises(AttentionTypeError, match="float8_e5m2"):
        call(q=q8.float().to(torch.float8_e5m2))
    with pytest.raises(AttentionTypeError, match=r"q_descale given"):
        call(q=q8.bfloat16(), k=k8.bfloat16(), v=v8.bfloat16(), q_descale=qd)
    with pytest.raises(AttentionValueError, match="4-D"):
        call(q=q8[0], k=k8[0], v=v8[0])
    with pytest.raises(AttentionValueError, match=r"k_descale must have shape \(B, H_kv\) = \(1, 1\)"):
        call(k_descale=torch.ones(1, 2))
    with pytest.raises(AttentionTypeError, match="v_descale must be float32"):
        call(v_descale=vd.double())
    for option, value in (("dropout_p", 0.1), ("attn_mask", torch.ones(16, 16, dtype=torch.bool))):
        with pytest.raises(AttentionValueError, match=f"does not take {option}"):
            call(**{option: value})
    with pytest.raises(AttentionValueError, match="does not take score_mod"):
        call(score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(AttentionValueError, match="no backward, but q_descale requires grad"):
        call(q_descale=qd.clone().requires_grad_())
    with torch.no_grad():
        call(q_descale=qd.clone().requires_grad_())  # no gradient asked for: runs
    with pytest.raises(AttentionTypeError, match="FP8 forward only"):  # no descale to give: refused
        fa.scaled_dot_product_attention(q8, k8, v8)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors, no interpreter: the kernel cannot run them
    with pytest.raises(AttentionError, match="backend='triton' cannot run this FP8 call: the Triton kernels need CUDA"):
        call(backend="triton")


def test_emulation_depends_on_the_key_tiles_only() -> None:
    """``P_ij`` is rounded after the running max of its key tile is subtracted: other key tiles give other
    roundings, while the query tiles, whose rows are independent, change nothing (bitwise)."""
    from flashattn_teach._options import make_options
    from flashattn_teach._validate.fp8 import check_fp8
    from flashattn_teach.reference.fp8 import fp8_forward

    q8, qd, k8, kd, v8, vd = quantised(1, 2, 2, 100, 100, 64, seed=5)
    opts = make_options(
        q8, k8, v8, causal=True, window=(40, 0), descale=check_fp8(q8, k8, v8, (qd, kd, vd), refused={})
    )
    O_16, lse_16 = fp8_forward(q8, k8, v8, opts, block_m=16, block_n=32)
    O_256, lse_256 = fp8_forward(q8, k8, v8, opts, block_m=256, block_n=32)
    assert torch.equal(O_16, O_256) and torch.equal(lse_16, lse_256)
    O_other, _ = fp8_forward(q8, k8, v8, opts, block_m=16, block_n=16)
    assert not torch.equal(O_other, O_16)


def test_fp8_emulation_ignores_autocast() -> None:
    """The emulation's products are fp32 as the tensor cores' are: a caller's CPU autocast to bfloat16 must not
    lower them (it did: lse 1000x further from the oracle)."""
    q8, qd, k8, kd, v8, vd = quantised(1, 2, 2, 64, 64, 64, seed=2)
    d = dict(q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)
    O0, lse0 = fa.flash_attention(q8, k8, v8, **d)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        O1, lse1 = fa.flash_attention(q8, k8, v8, **d)
    assert torch.equal(O0, O1) and torch.equal(lse0, lse1)


def test_the_decode_api_refuses_float8_caches_by_name() -> None:
    q, k_cache = (torch.randn(1, 2, n, 16).to(E4M3) for n in (1, 10))
    with pytest.raises(AttentionTypeError, match="no FP8 path"):
        fa.flash_attention_with_kvcache(q, k_cache, k_cache, cache_seqlens=5)
    with pytest.raises(AttentionTypeError, match=r"k_cache is torch\.float8_e4m3fn"):
        fa.flash_attention_with_kvcache(q.bfloat16(), k_cache, k_cache.bfloat16(), cache_seqlens=5)


def test_explain_plans_an_fp8_call_as_flash_attention_runs_it() -> None:
    q8, qd, k8, kd, v8, vd = quantised(1, 2, 1, 16, 16, 64)
    p = fa.explain(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    assert p.backend == "query_major" and "FP8 emulation" in p.reason
    with pytest.raises(AttentionValueError, match="dropout_p"):
        fa.explain(q8, k8, v8, dropout_p=0.1, q_descale=qd, k_descale=kd, v_descale=vd)


def test_a_call_that_is_not_fp8_is_answered_before_its_refusals_are_gathered() -> None:
    from flashattn_teach._validate.fp8 import check_fp8, fp8_call
    from flashattn_teach.api.attention import check_descales

    q8, qd, k8, _, v8, _ = quantised(1, 2, 1, 16, 16, 64)
    q, k, v = q8.bfloat16(), k8.bfloat16(), v8.bfloat16()
    # dropout and a mask would be refused in an FP8 call; here the call is not FP8: None, no refusal
    options = {"q_descale": None, "k_descale": None, "v_descale": None, "dropout_p": 0.1}
    options |= {"attn_mask": torch.ones(16, 16, dtype=torch.bool), "score_mod": None, "mask_mod": None}
    assert check_descales(q, k, v, options | {"block_mask": None}) is None  # type: ignore[arg-type]
    # fp8_call is check_fp8's own question: a descale given or a float8 input makes the call FP8
    for inputs, descales in (((q, k, v), (None, qd, None)), ((q, k8, v), (None, None, None))):
        assert fp8_call(*inputs, descales)
        with pytest.raises(AttentionTypeError, match="FP8 call"):
            check_fp8(*inputs, descales, refused={})
    assert not fp8_call(q, k, v, (None, None, None))
    assert check_fp8(q, k, v, (None, None, None), refused={"dropout_p": True}) is None
