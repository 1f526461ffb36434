"""The GPU checks of the Triton kernels with the shipped configurations: cases as data, checks as functions.

Each ``check_*`` function raises AssertionError on a wrong answer and nothing here imports pytest, so
``tests/triton/test_triton_gpu.py`` (under pytest) and ``benchmarks/gpu_checks.py`` (a bare GPU machine,
without it) run the same cases. Nothing touches CUDA at import time. The cases themselves (``CASES``, the
determinism and peak-memory calls) live in ``flashattn_teach/tools/kernels/cases.py``, where
``flashattn-teach kernels --specializations`` reads them to compile every kernel they launch ahead of time.

Every case calls ``triton_attention(...)`` without ``config``, so on CUDA it runs the configuration users
get (``configs.shipped_config`` of its head dim, dtype and GPU generation). The cases cover:

- ``N_q != N_k`` in both causal alignments, with query rows that see no key (``O = 0``, ``lse = -inf``,
  ``dq = 0``, nothing NaN) and key columns no query sees (``dk = dv = 0``);
- GQA 4:1 and MQA (``H_kv = 1``) values and gradients, with ``enable_gqa=True``;
- ``(B, N, H, D)`` storage passed as its ``transpose(1, 2)`` view;
- head dims 40, 64, 80, 96, 128 and 256 in fp16 and bf16, forward and backward (the hd256 backward runs
  split dK and dV programs; it has not yet run on a GPU);
- N in {1, 17, 129, 4096}, and decode steps (N_q = 1) with one key/value head, N_k = 1 and B = 2, which
  the JIT compiles with those integers as constants (an N_q = 1 dK/dV fault was found that way);
  ``lse`` and a gradient into it;
- fp32 up to head dim 128, and at head dim 160, which does not ship, a refusal naming the head dim
  (likewise any head dim whose backward does not ship: the forward is checked and a gradient refused);
- a head dim whose rows are not 16-byte multiples (bf16, D = 100), which TMA cannot read: the rows that
  ask for TMA run their pointer ``fallback`` tiles.

Accuracy, against float64 attention of the same (rounded) inputs:

- fp16, bf16: flash-attn's rule, ``err(ours) <= 2 err(plain PyTorch in the same dtype) + 1e-4 max(1, |ref|)``
  for O, lse, dq, dk and dv, where ``err`` is the largest absolute error over the finite entries. lse is
  also held to the fp32 bound below: the kernels sum exact products of 16-bit inputs in fp32 and keep lse
  in fp32, whereas plain PyTorch rounds every score to 16 bits, which would let a bias of 1e-3 pass.
- fp32: the kernels' dots are "tf32x3" (three TF32 products, each operand split into a high and a low TF32
  part; the dropped low x low term costs about 2^-21 relative per product, eight times fp32's rounding), so
  ``err <= FP32_TOL * max(1, |ref|)``; inputs rounded to TF32 (as a single-pass TF32 dot, 2^-11) exceed
  it about fourfold at head dim 64.

Compile budget. Triton compiles each kernel once per specialisation: constexprs (dtype, head dim, tile,
causal), and, per integer argument, whether it equals 1 (then it becomes a constant) or is divisible by 16
(likewise per pointer). The cases are chosen so that several share one specialisation: N = 17, 37, 100,
129 and 300 fall in the same class (neither 1 nor a multiple of 16); a ``(B, N, H, D)`` view has the same
stride classes as a contiguous tensor when D % 16 == 0; a bottom-right diagonal offset ``N_k - N_q`` that
is a multiple of 16 shares the top-left one's (0). Counted for an earlier version of these cases: about
a hundred compilations; on an H200 the whole run took 29 s with 8 pytest-xdist workers and a cold Triton
cache (``benchmarks/gpu_checks.py`` prints the count a run compiled).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from flashattn_teach.errors import AttentionValueError
from flashattn_teach.masks.causal import causal_mask
from flashattn_teach.reference import dense_attention
from flashattn_teach.tools.kernels.cases import (  # the cases as data, which the specialisation capture reads too
    CASES,
    DETERMINISM_DTYPES,
    DTYPE_NAMES,
    PEAK_MEMORY_SEQS,
    GpuCase,
    determinism_case,
    peak_memory_case,
)
from flashattn_teach.triton import triton_attention
from flashattn_teach.triton.configs import max_head_dim

OUTPUTS = ("O", "lse", "dq", "dk", "dv")
# Largest error allowed for fp32 inputs, relative to max(1, max |ref|); see the module docstring.
FP32_TOL = {"O": 1e-4, "lse": 1e-4, "dq": 3e-4, "dk": 3e-4, "dv": 3e-4}


def plain_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, causal_align: str) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` by the definition with every op in the inputs' dtype, as plain PyTorch computes it.

    GQA repeats each key/value head over its group; a row that sees no key gets ``O = 0``, ``lse = -inf``
    (softmax over only ``-inf`` would be NaN).
    """
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    S = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, N_q, D) @ (B, H, D, N_k)
    if causal:
        S = S.masked_fill(~causal_mask(q.shape[2], k.shape[2], causal_align, device=q.device), float("-inf"))
    empty = torch.isneginf(S).all(dim=-1, keepdim=True)  # (B, H, N_q, 1)
    S = S.masked_fill(empty, 0.0)
    P = torch.softmax(S, dim=-1).masked_fill(empty, 0.0)
    lse = torch.logsumexp(S, dim=-1).masked_fill(empty.squeeze(-1), float("-inf"))
    return torch.matmul(P, v), lse  # (B, H, N_q, N_k) @ (B, H, N_k, D) -> (B, H, N_q, D)


Attention = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def forward_backward(
    attention: Attention, q: Tensor, k: Tensor, v: Tensor, dO: Tensor, dlse: Tensor | None, backward: bool = True
):
    """``{O, lse, dq, dk, dv}`` of ``loss = sum(O * dO) + sum(lse * dlse)``, ``lse = -inf`` entries left out;
    only ``{O, lse}`` when not ``backward``."""
    if not backward:
        with torch.no_grad():
            O, lse = attention(q, k, v)
        return {"O": O, "lse": lse}
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    O, lse = attention(q, k, v)
    loss = (O.double() * dO.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isneginf(lse), 0.0, lse).double() * dlse.double()).sum()
    loss.backward()
    return {"O": O.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def make_inputs(c: GpuCase, device: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """``q, k, v`` (views of ``(B, N, H, D)`` storage if ``c.bnhd``), ``dO`` and ``dlse`` in ``c.dtype``."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(H: int, N: int, X: int) -> Tensor:
        if c.bnhd:  # (B, N, H, X) -> (B, H, N, X) view; strides (N H X, X, H X, 1)
            return torch.randn(c.B, N, H, X, generator=g, device=device).to(c.dtype).transpose(1, 2)
        return torch.randn(c.B, H, N, X, generator=g, device=device).to(c.dtype)

    q, dO = randn(c.H_q, c.N_q, c.D), randn(c.H_q, c.N_q, c.D)
    k, v = randn(c.H_kv, c.N_k, c.D), randn(c.H_kv, c.N_k, c.D)
    dlse = torch.randn(c.B, c.H_q, c.N_q, generator=g, device=device).to(c.dtype) if c.dlse else None
    return q, k, v, dO.contiguous(), dlse


def max_error(got: Tensor, ref: Tensor) -> float:
    """Largest ``|got - ref|`` over the entries where ``ref`` is finite."""
    finite = torch.isfinite(ref)
    return (got.double() - ref)[finite].abs().max().item() if finite.any() else 0.0


def scale_of(ref: Tensor) -> float:
    """``max(1, max |ref|)`` over the finite entries: what a relative error bound is relative to."""
    return max(1.0, max_error(torch.zeros_like(ref), ref))


def check_nothing_seen_gives_zeros(c: GpuCase, ours: dict[str, Tensor]) -> None:
    """Rows that see no key: O = 0, lse = -inf, dq = 0; keys no row sees: dk = dv = 0; no NaN anywhere."""
    seen = torch.ones(c.N_q, c.N_k, dtype=torch.bool)  # (N_q, N_k): which keys each query row sees
    if c.causal:
        seen = causal_mask(c.N_q, c.N_k, c.causal_align)
    seen = seen.to(ours["O"].device)
    rows, keys = ~seen.any(dim=1), ~seen.any(dim=0)  # (N_q,) rows without a key, (N_k,) keys without a row
    for name in ours:
        assert not torch.isnan(ours[name]).any(), f"{name}: NaN"
    assert torch.equal(torch.isneginf(ours["lse"]), rows.expand_as(ours["lse"])), "lse: -inf exactly at empty rows"
    assert torch.isfinite(ours["lse"][..., ~rows]).all(), "lse: inf at a row that sees keys"
    assert (ours["O"][:, :, rows] == 0).all(), "O: not 0 at rows that see no key"
    if "dq" not in ours:  # forward only
        return
    for name in ("dq", "dk", "dv"):
        assert torch.isfinite(ours[name]).all(), f"{name}: not finite"
    assert (ours["dq"][:, :, rows] == 0).all(), "dq: not 0 at rows that see no key"
    assert (ours["dk"][:, :, keys] == 0).all(), "dk: not 0 at keys no query sees"
    assert (ours["dv"][:, :, keys] == 0).all(), "dv: not 0 at keys no query sees"


def check_refused(call: Callable[[], object], c: GpuCase, what: str) -> None:
    """``call`` raises AttentionValueError naming ``c``'s head dimension."""
    try:
        call()
    except AttentionValueError as e:
        assert f"D={c.D}" in str(e), f"the refusal does not name the head dimension: {e}"
    else:
        raise AssertionError(f"{what} at head dim {c.D} in {c.dtype} ran; the shipped tables have no tile for it")


def backward_ships(c: GpuCase) -> bool:
    """Whether the Triton backward ships for this case's dtype and head dim (else: forward only)."""
    return c.D <= max_head_dim(c.dtype, backward=True)


def check_case(c: GpuCase, device: str = "cuda") -> None:
    """The shipped kernels' O, lse and gradients against float64 attention, by the rule for ``c.dtype``.
    Where the backward does not ship, the forward is checked and asking for a gradient must be refused
    with an error that names the head dimension; where the forward does not ship either, the call must be
    refused likewise."""
    q, k, v, dO, dlse = make_inputs(c, device)
    opts = {"causal": c.causal, "causal_align": c.causal_align, "enable_gqa": c.group > 1, "return_lse": True}
    backward = backward_ships(c)
    if not backward:
        check_refused(lambda: triton_attention(q.detach().requires_grad_(), k, v, **opts), c, "a gradient")
    if c.D > max_head_dim(c.dtype, backward=False):
        check_refused(lambda: triton_attention(q, k, v, **opts), c, "the forward")
        return
    ours = forward_backward(lambda q, k, v: triton_attention(q, k, v, **opts), q, k, v, dO, dlse, backward)
    ref = forward_backward(
        lambda q, k, v: dense_attention(q, k, v, **opts),
        *(t.double() for t in (q, k, v, dO)),
        None if dlse is None else dlse.double(),
        backward,
    )
    for name, t in ours.items():
        want = (torch.float32 if name == "lse" else c.dtype, ref[name].shape)
        assert (t.dtype, t.shape) == want, f"{name}: {t.dtype} {tuple(t.shape)}, expected {want}"
    check_nothing_seen_gives_zeros(c, ours)
    if c.dtype == torch.float32:
        for name in ours:
            err, scale = max_error(ours[name], ref[name]), scale_of(ref[name])
            assert err <= FP32_TOL[name] * scale, f"{name}: error {err:.3g} > {FP32_TOL[name]:g} x {scale:.3g}"
        return
    plain = forward_backward(
        lambda q, k, v: plain_attention(q, k, v, causal=c.causal, causal_align=c.causal_align),
        q,
        k,
        v,
        dO,
        dlse,
        backward,
    )
    for name in ours:
        err, err_pt = max_error(ours[name], ref[name]), max_error(plain[name], ref[name])
        floor = 1e-4 * scale_of(ref[name])
        assert err <= 2 * err_pt + floor, f"{name}: error {err:.3g} > 2 x plain PyTorch's {err_pt:.3g} + {floor:.2g}"
    err, scale = max_error(ours["lse"], ref["lse"]), scale_of(ref["lse"])
    assert err <= FP32_TOL["lse"] * scale, f"lse: error {err:.3g} > {FP32_TOL['lse']:g} x {scale:.3g}"


def _gqa_causal(deterministic: bool) -> Attention:
    def attention(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        out = triton_attention(q, k, v, causal=True, enable_gqa=True, return_lse=True, deterministic=deterministic)
        assert isinstance(out, tuple)
        return out

    return attention


def check_backward_is_bitwise_deterministic(dtype: torch.dtype, device: str = "cuda") -> None:
    """Two ``deterministic=True`` backward passes of the same GQA causal call give identical bits (the
    two-kernel backward, no atomics)."""
    c = determinism_case(dtype)
    q, k, v, dO, _ = make_inputs(c, device)
    first, second = (forward_backward(_gqa_causal(True), q, k, v, dO, None) for _ in range(2))
    for name in OUTPUTS:
        assert torch.equal(first[name], second[name]), f"{name}: differs between two identical calls"


def check_default_backward_matches_deterministic(dtype: torch.dtype, device: str = "cuda") -> None:
    """The default backward (one kernel, dQ by fp32 atomics where the tile ships) and the deterministic one
    are both within flash-attn's rule of float64 (fp32: its tolerance), and within it of each other."""
    c = determinism_case(dtype)
    q, k, v, dO, _ = make_inputs(c, device)
    fused, det = (forward_backward(_gqa_causal(d), q, k, v, dO, None) for d in (False, True))
    opts = {"causal": True, "enable_gqa": True, "return_lse": True}
    ref = forward_backward(lambda q, k, v: dense_attention(q, k, v, **opts), *(t.double() for t in (q, k, v, dO)), None)
    plain = None
    if dtype != torch.float32:
        plain = forward_backward(
            lambda q, k, v: plain_attention(q, k, v, causal=True, causal_align="top_left"), q, k, v, dO, None
        )
    for name in ("dq", "dk", "dv"):
        scale = scale_of(ref[name])
        bound = FP32_TOL[name] * scale if plain is None else 2 * max_error(plain[name], ref[name]) + 1e-4 * scale
        for what, err in (
            ("default vs float64", max_error(fused[name], ref[name])),
            ("deterministic vs float64", max_error(det[name], ref[name])),
            ("default vs deterministic", max_error(fused[name], det[name].double())),
        ):
            assert err <= bound, f"{name}, {what}: error {err:.3g} > {bound:.3g}"


def check_peak_memory_grows_linearly(device: str = "cuda") -> None:
    """Doubling N at most about doubles the peak memory of a forward and backward (quadratic would be 4x)."""
    peaks = []
    for N in PEAK_MEMORY_SEQS:
        c = peak_memory_case(N)
        q, k, v, dO = (torch.randn(c.B, c.H_q, N, c.D, device=device, dtype=c.dtype) for _ in range(4))
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        triton_attention(q, k, v, causal=True).backward(dO)
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
        del q, k, v, dO
    assert peaks[2] / peaks[1] < 2.5 and peaks[1] / peaks[0] < 2.5, f"peak bytes for N = 2k, 4k, 8k: {peaks}"


def all_checks(device: str = "cuda") -> list[tuple[str, Callable[[], None]]]:
    """Every check as ``(name, run)``, in the order a runner should take them."""
    checks: list[tuple[str, Callable[[], None]]] = [(c.name, lambda c=c: check_case(c, device)) for c in CASES]
    for dt in DETERMINISM_DTYPES:
        name = f"deterministic-{DTYPE_NAMES[dt]}"
        checks.append((name, lambda dt=dt: check_backward_is_bitwise_deterministic(dt, device)))
        name = f"default-vs-deterministic-{DTYPE_NAMES[dt]}"
        checks.append((name, lambda dt=dt: check_default_backward_matches_deterministic(dt, device)))
    checks.append(("peak-memory-linear", lambda: check_peak_memory_grows_linearly(device)))
    return checks
