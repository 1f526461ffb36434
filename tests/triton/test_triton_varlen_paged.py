"""``flash_attention_varlen(..., block_table=)`` on the Triton varlen kernels (the pages gathered into the
packed layout first, then ``backend="triton"``), against the float64 oracle of ``varlen_paged_cases.py``:
float32 and float16 (the interpreter refuses bfloat16), page sizes 1, 7 and 16, both pool layouts, shuffled
tables with garbage past the used pages, GQA, a sequence with no keys; bottom-right causal with sinks, a
window, softcap with per-sequence ALiBi; and the gradients into ``q`` and the pools in float32.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _triton_cases import DEVICE, REL_TOL, assert_close_scaled  # noqa: E402

import flashattn_teach as fa  # noqa: E402
from varlen_paged_cases import H_Q, LENGTHS, oracle, paged_varlen  # noqa: E402

SINKS = [0.5, -1.0, 2.0, 0.0]
CASES = {
    "causal_sinks": ({"causal": True, "sinks": True}, torch.float32, 7, "bnhd"),
    "window": ({"window": (4, 1)}, torch.float16, 16, "bhnd"),
    "softcap_alibi": ({"softcap": 3.0, "alibi": True}, torch.float16, 1, "bnhd"),
}


def _kwargs(spec: dict, dtype: torch.dtype) -> tuple[dict, dict]:
    kw, ref = dict(spec), dict(spec)
    if kw.pop("alibi", False):  # (B, H_q): a slope per sequence and head, float32 as the kernels take them
        kw["alibi_slopes"] = torch.linspace(0.05, 0.6, len(LENGTHS) * H_Q, device=DEVICE).reshape(len(LENGTHS), H_Q)
        ref["alibi"] = kw["alibi_slopes"].cpu().double()
    if kw.pop("sinks", False):
        kw["sinks"] = torch.tensor(SINKS, device=DEVICE, dtype=dtype)
        ref["sinks"] = kw["sinks"].cpu().double()
    return kw, ref


@pytest.mark.parametrize("case", list(CASES))
def test_paged_varlen_on_triton_matches_the_float64_oracle(case: str) -> None:
    spec, dtype, page_size, layout = CASES[case]
    p = paged_varlen(page_size=page_size, layout=layout, dtype=dtype, device=DEVICE)
    kw, ref_kw = _kwargs(spec, dtype)
    O, lse = fa.flash_attention_varlen(*p.args(), block_table=p.block_table, backend="triton", return_lse=True, **kw)
    O_ref, lse_ref = oracle(p, **ref_kw)
    assert O.dtype == dtype and O.shape == O_ref.shape and lse.shape == lse_ref.shape
    assert_close_scaled(O, O_ref, REL_TOL[dtype], f"{case}: O")
    assert_close_scaled(lse, lse_ref, REL_TOL[dtype], f"{case}: lse")


def test_paged_varlen_on_triton_differentiates_into_q_and_the_pools() -> None:
    p = paged_varlen(page_size=7, layout="bnhd", device=DEVICE)
    sinks = torch.tensor(SINKS, device=DEVICE)
    leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k_pages, p.v_pages)]
    O = fa.flash_attention_varlen(
        *leaves, *p.args()[3:], block_table=p.block_table, causal=True, sinks=sinks, backend="triton"
    )
    dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    (O * dO).sum().backward()
    ref = [t.detach().cpu().double().requires_grad_() for t in (p.q, p.k_pages, p.v_pages)]
    O_ref, _ = oracle(p, q=ref[0], k_pages=ref[1], v_pages=ref[2], causal=True, sinks=sinks.cpu().double())
    (O_ref * dO.cpu().double()).sum().backward()
    assert_close_scaled(O, O_ref, REL_TOL[torch.float32], "O")
    for name, got, want in zip(("q", "k_pages", "v_pages"), leaves, ref, strict=True):
        assert got.grad is not None and want.grad is not None
        assert_close_scaled(got.grad, want.grad, REL_TOL[torch.float32], f"d{name}")
