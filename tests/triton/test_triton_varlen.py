"""Packed variable-length sequences in the Triton kernels (``VARLEN``): ``O``, ``lse`` and the gradients
of ``q, k, v`` against the float64 dense oracle of :func:`flashattn_teach.flash_attention_varlen`, with
empty sequences, a one-row one, lengths that cut tiles, ``len_q != len_k`` both ways, and grouped-query
heads; plain, causal in both alignments, a window, softcap with per-sequence ALiBi slopes. The three
kernels with ``VARLEN`` compile ahead of time for sm_90 (fp16, head dim 64) without spills.
"""

from __future__ import annotations

import subprocess

import pytest

from sass_cache import AOT_PYTHON, aot_env

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _triton_cases import DEVICE, REL_TOL, assert_close_scaled  # noqa: E402

import flashattn_teach as fa  # noqa: E402
from flashattn_teach.triton import varlen as triton_varlen  # noqa: E402

# (len_q, len_k) per sequence: empty, one query row, tiles cut in both axes, more queries than keys
# (bottom-right causal then leaves rows that see nothing), keys but no queries
LENGTHS = [(0, 3), (1, 9), (17, 33), (30, 20), (0, 5)]
H_Q, H_KV, D = 4, 2, 16

CASES = {
    "plain": {},
    "causal_bottom_right": {"causal": True, "causal_align": "bottom_right"},
    "causal_top_left": {"causal": True, "causal_align": "top_left"},
    "window": {"window": (5, 2), "causal_align": "bottom_right"},
    "softcap_alibi": {"softcap": 2.0, "alibi_slopes": "per_sequence"},
}


def _packed(dtype: torch.dtype, seed: int = 0):
    """``q, k, v`` packed ``(total, H, D)``, ``cu_seqlens`` int32 and the longest lengths."""
    g = torch.Generator().manual_seed(seed)
    lq = torch.tensor([a for a, _ in LENGTHS])
    lk = torch.tensor([b for _, b in LENGTHS])
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), lq.cumsum(0)]).to(torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), lk.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(lq.sum()), H_Q, D, generator=g)
    k = torch.randn(int(lk.sum()), H_KV, D, generator=g)
    v = torch.randn(int(lk.sum()), H_KV, D, generator=g)
    qkv = tuple(t.to(DEVICE, dtype) for t in (q, k, v))
    return qkv, cu_q.to(DEVICE), cu_k.to(DEVICE), int(lq.max()), int(lk.max())


def _kwargs(case: str) -> dict:
    kw = dict(CASES[case])
    if kw.get("alibi_slopes") == "per_sequence":  # (B, H_q): a different slope per sequence and head
        kw["alibi_slopes"] = torch.linspace(0.05, 0.6, len(LENGTHS) * H_Q, device=DEVICE).reshape(len(LENGTHS), H_Q)
    return kw


@pytest.mark.parametrize("case", list(CASES))
def test_varlen_forward_and_backward_match_the_dense_oracle(case: str) -> None:
    dtype = torch.float32
    (q, k, v), cu_q, cu_k, max_q, max_k = _packed(dtype)
    kw = _kwargs(case)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    O, lse = triton_varlen.triton_attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, return_lse=True, **kw)
    dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    (O * dO).sum().backward()

    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_kw = {n: (a.double() if isinstance(a, torch.Tensor) else a) for n, a in kw.items()}
    O_ref, lse_ref = fa.flash_attention_varlen(
        *ref_leaves, cu_q, cu_k, max_q, max_k, backend="dense", return_lse=True, **ref_kw
    )
    (O_ref * dO.double()).sum().backward()

    rel = REL_TOL[dtype]
    assert O.shape == O_ref.shape and lse.shape == lse_ref.shape == (H_Q, q.shape[0])
    assert_close_scaled(O, O_ref, rel, f"{case}: O")
    assert_close_scaled(lse, lse_ref, rel, f"{case}: lse")
    for name, t, ref in zip("qkv", leaves, ref_leaves, strict=True):
        assert t.grad is not None and ref.grad is not None
        assert_close_scaled(t.grad, ref.grad, rel, f"{case}: d{name}")


def test_varlen_backend_triton_routes_to_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    (q, k, v), cu_q, cu_k, max_q, max_k = _packed(torch.float32)
    calls = []
    real = triton_varlen.triton_varlen_forward

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_varlen, "triton_varlen_forward", spy)  # dispatch.run imports it when it runs
    O = fa.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend="triton")
    assert len(calls) == 1
    O_ref = fa.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, backend="dense")
    assert_close_scaled(O, O_ref, REL_TOL[torch.float32], "backend='triton': O")


def test_varlen_backend_triton_refuses_what_the_kernels_cannot_run() -> None:
    (q, k, v), cu_q, cu_k, max_q, max_k = _packed(torch.float32)
    with pytest.raises(fa.errors.AttentionValueError, match="float64"):
        fa.flash_attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, max_q, max_k, backend="triton")
    slopes = torch.full((H_Q,), 0.25, device=DEVICE, requires_grad=True)  # only the dense path differentiates
    with pytest.raises(NotImplementedError, match="alibi_slopes requires grad"):
        fa.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes=slopes, backend="triton")


# Compiles the varlen forward, dK/dV and dQ kernels for sm_90 (fp16, head dim 64, causal, two packed
# sequences) as the launcher would, and prints each kernel's problems (spills, registers, shared memory).
_AOT_SCRIPT = """
import torch
from flashattn_teach.triton.configs import shipped_config
from flashattn_teach.tools.kernels.report import compile_kernel
from flashattn_teach.tools.kernels.specialize import sample_varlen
var = sample_varlen()
for kernel in ("forward", "backward_dkdv", "backward_dq"):
    c = getattr(shipped_config(64, torch.float16, "sm90", variants=True), kernel)
    r = compile_kernel(kernel, "sm90", torch.float16, 64, c, variants=var)
    print(kernel, r.mma, r.problems())
"""


def test_varlen_kernels_compile_for_sm90_without_spills() -> None:
    env = aot_env(PYTHONWARNINGS="ignore")
    done = subprocess.run([*AOT_PYTHON, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = done.stdout.split("\n")[:3]
    assert [row.split(" ", 2) for row in rows] == [
        [kernel, "HGMMA", "[]"] for kernel in ("forward", "backward_dkdv", "backward_dq")
    ], done.stdout


@pytest.mark.parametrize("lengths", [([0, 0], [3, 4]), ([2, 3], [0, 0])], ids=["no_queries", "no_keys"])
def test_varlen_without_queries_or_keys(lengths: tuple[list[int], list[int]]) -> None:
    """No query rows (an empty O, dK = dV = 0) or no keys (O = 0, lse = -inf, dQ = 0)."""
    g = torch.Generator().manual_seed(0)
    lq, lk = lengths
    cu_q = torch.tensor([0, lq[0], lq[0] + lq[1]], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, lk[0], lk[0] + lk[1]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(lq), H_Q, D, generator=g).to(DEVICE).requires_grad_()
    k = torch.randn(sum(lk), H_KV, D, generator=g).to(DEVICE).requires_grad_()
    v = torch.randn(sum(lk), H_KV, D, generator=g).to(DEVICE).requires_grad_()
    O, lse = triton_varlen.triton_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), return_lse=True)
    O.sum().backward()
    assert O.shape == (sum(lq), H_Q, D) and lse.shape == (H_Q, sum(lq))
    assert torch.all(O == 0) and torch.all(torch.isneginf(lse))
    for t in (q, k, v):
        assert t.grad is not None and torch.all(t.grad == 0)


@pytest.mark.parametrize("case", ["plain", "causal_bottom_right"])
def test_varlen_dropout_draws_the_cpu_paths_mask(case: str) -> None:
    """For the same seed the kernels drop the weights the CPU path drops (the packed counters of
    ``flashattn_teach.api.varlen``), in the forward and in the backward's redraw: a single differing bit moves
    ``O`` or a gradient by about a weight, far above the tolerance."""
    dtype = torch.float32
    (q, k, v), cu_q, cu_k, max_q, max_k = _packed(dtype)
    kw = _kwargs(case)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)
    O = triton_varlen.triton_attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, dropout_p=0.5, **kw)
    dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    (O * dO).sum().backward()

    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)
    O_ref = fa.flash_attention_varlen(
        *ref_leaves, cu_q.cpu(), cu_k.cpu(), max_q, max_k, dropout_p=0.5, backend="query_major", **kw
    )
    (O_ref * dO.cpu().double()).sum().backward()

    rel = REL_TOL[dtype]
    assert_close_scaled(O.cpu(), O_ref, rel, f"{case}: O")
    assert not torch.allclose(O_ref, fa.flash_attention_varlen(*ref_leaves, cu_q.cpu(), cu_k.cpu(), max_q, max_k, **kw))
    for name, t, ref in zip("qkv", leaves, ref_leaves, strict=True):
        assert t.grad is not None and ref.grad is not None
        assert_close_scaled(t.grad.cpu(), ref.grad, rel, f"{case}: d{name}")
