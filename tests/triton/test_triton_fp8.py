"""The FP8 build of the forward kernel against the CPU emulation (flashattn_teach.reference.fp8), at the
same tiles, in the interpreter and on an sm_90 GPU.

The interpreter runs e4m3 (stored as uint8; its dots upcast exactly), but triton 3.9's interpreter converts
fp32 to narrow floats with its own bit arithmetic (``triton.runtime.interpreter._convert_float``), which
differs from the GPU's round-to-nearest-even ``cvt``: fp32 -> e4m3 rounds half up, flushes e4m3 subnormals
to zero and loses the carry when rounding up crosses a power of two (0.123 becomes 0.0625, not 0.125);
fp32 -> bf16 truncates. The kernel casts ``P_ij`` to e4m3 and ``O_i`` to bf16, so :func:`rne_casts`
replaces those two conversions with torch's (round to nearest even, as the hardware) for these tests.
:func:`test_the_check_sees_the_weights_rounding` is the control: the same comparison against an emulation
that does not round the weights fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashattn_teach as fa
from flashattn_teach._options import make_options
from flashattn_teach._validate.fp8 import check_fp8
from flashattn_teach.errors import AttentionValueError
from flashattn_teach.reference import fp8 as emulation
from flashattn_teach.triton import fp8 as fp8_launch
from flashattn_teach.triton.configs import TEST_CONFIG
from flashattn_teach.triton.fp8 import fp8_forward_config

E4M3 = torch.float8_e4m3fn
GPU = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9), reason="needs an sm_90 GPU"
)


@pytest.fixture
def rne_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's fp32 -> e4m3 and fp32 -> bf16 conversions done as the GPU does them (see above)."""
    if torch.cuda.is_available():
        return
    import triton.language as tl
    from triton.runtime import interpreter

    own = interpreter._convert_float
    as_torch = {tl.float8e4nv: (E4M3, torch.uint8), tl.bfloat16: (torch.bfloat16, torch.uint16)}

    def convert(x, src, dst, rounding):
        if src == tl.float32 and dst in as_torch:
            dtype, bits = as_torch[dst]
            return torch.from_numpy(np.ascontiguousarray(x)).to(dtype).view(bits).numpy().reshape(x.shape)
        return own(x, src, dst, rounding)

    monkeypatch.setattr(interpreter, "_convert_float", convert)
    monkeypatch.setattr(fp8_launch, "INTERPRETER_ROUNDS_AS_GPU", True)  # what the refusal waits for


def inputs(B, H, H_kv, N_q, N_k, D, device, seed=0, negative=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g) for s in ((B, H, N_q, D), (B, H_kv, N_k, D), (B, H_kv, N_k, D)))
    q8, k8, v8 = (t.to(E4M3).to(device) for t in (q, k, v))
    qd, kd, vd = (torch.rand(B, H_kv, generator=g).add(0.5).to(device) for _ in range(3))
    if negative:
        kd[0] = -kd[0]  # batch element 0: scale * qd * kd < 0, its sign moved into Q by the kernel
    return q8, k8, v8, (qd, kd, vd)


def emulated(q8, k8, v8, descales, block_n, **kwargs):
    descale = check_fp8(q8, k8, v8, descales, refused={})
    opts = make_options(q8, k8, v8, enable_gqa=True, descale=descale, **kwargs)
    return emulation.fp8_forward(q8.cpu(), k8.cpu(), v8.cpu(), cpu_options(opts, descale), block_n=block_n)


def cpu_options(opts, descale):
    from dataclasses import replace

    return replace(opts, descale=type(descale)(descale.q.cpu(), descale.k.cpu(), descale.v.cpu()))


CASES = {
    "causal_gqa_negative_descale": (dict(causal=True), (2, 4, 2, 45, 45), True),
    "variants_bottom_right": (
        dict(
            causal=True,
            causal_align="bottom_right",
            window=(19, 0),
            softcap=4.0,
            seqlens_k=torch.tensor([50, 0]),
            alibi_slopes=torch.tensor([0.25, 0.5]),
        ),
        (2, 2, 1, 23, 50),
        False,
    ),
    # attention sinks, one far above the scores: the state starts at the sink in both (init_state, SINKS)
    "sinks_gqa": (dict(causal=True, sinks=torch.tensor([-1.0, 0.5, 2.0, 6.0])), (2, 4, 2, 45, 45), False),
}


def run_case(name: str, device: str, block_n: int):
    kwargs, (B, H, H_kv, N_q, N_k), negative = CASES[name]
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    q8, k8, v8, (qd, kd, vd) = inputs(B, H, H_kv, N_q, N_k, 64, device, negative=negative)
    O, lse = fa.flash_attention(
        q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, backend="triton", return_lse=True, **kwargs
    )
    O_e, lse_e = emulated(q8, k8, v8, (qd, kd, vd), block_n, **kwargs)
    return O.cpu(), lse.cpu(), O_e, lse_e


def assert_matches(O, lse, O_e, lse_e) -> None:
    assert O.dtype == torch.bfloat16
    # lse sums unrounded weights: fp32 arithmetic only; O: the same e4m3 weights, one bf16 ulp for sum order
    torch.testing.assert_close(lse, lse_e, atol=1e-5, rtol=0)
    torch.testing.assert_close(O.float(), O_e.float(), atol=1e-4, rtol=2**-7)


def test_the_interpreter_is_refused_where_its_e4m3_casts_are_its_own() -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter test runs without a GPU")
    q8, k8, v8, (qd, kd, vd) = inputs(1, 2, 1, 16, 16, 64, "cpu")
    with pytest.raises(AttentionValueError, match="interpreter rounds fp32 to e4m3"):
        fa.flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, backend="triton")


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_kernel_matches_the_emulation_in_the_interpreter(name: str, rne_casts) -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter test runs without a GPU")
    O, lse, O_e, lse_e = run_case(name, "cpu", TEST_CONFIG.forward.BLOCK_N)
    assert_matches(O, lse, O_e, lse_e)
    if name.startswith("variants"):
        assert torch.all(O[1] == 0) and torch.all(lse[1] == -torch.inf)  # seqlens_k = 0: no key


def test_the_check_sees_the_weights_rounding(rne_casts, monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter test runs without a GPU")
    monkeypatch.setattr(emulation, "round_e4m3", lambda P: P)  # an emulation that keeps P in fp32
    O, lse, O_e, lse_e = run_case("causal_gqa_negative_descale", "cpu", TEST_CONFIG.forward.BLOCK_N)
    with pytest.raises(AssertionError):
        assert_matches(O, lse, O_e, lse_e)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("name", list(CASES))
def test_fp8_kernel_matches_the_emulation_on_sm90(name: str) -> None:
    block_n = fp8_forward_config(64, variants=name.startswith("variants")).forward.BLOCK_N  # the launch's tile
    O, lse, O_e, lse_e = run_case(name, "cuda", block_n)
    assert_matches(O, lse, O_e, lse_e)
