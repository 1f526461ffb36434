"""The first light's checks on a GPU: each calls a public function of the library as a user would, with the
options that select one path, and returns every output's error against float64 attention with its bound.

The bound is flash-attn's rule, as ``tests/triton/gpu_cases.py`` states it: for fp16 and bf16,
``err(ours) <= 2 err(plain PyTorch in the same dtype) + 1e-4 max(1, |ref|)`` per output (O, lse, dq, dk, dv),
``err`` the largest absolute error over the entries where the float64 answer is finite; lse is also held to
fp32's tolerance. fp32 is held to ``FP32_TOL`` (its dots are tf32x3). FP8's "same precision" is the library's
CPU emulation of the FP8 kernel's roundings. The shapes and helpers come from ``gpu_cases.py`` (its ``GpuCase``
list is the core of the first light); nothing here touches CUDA at import.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "triton"))

import gpu_cases  # noqa: E402
import graph_cases  # noqa: E402
from gpu_cases import FP32_TOL, GpuCase, forward_backward, make_inputs, max_error, scale_of  # noqa: E402

import flashattn_teach as fa  # noqa: E402
from first_light_runner import Error, Skip  # noqa: E402

ATOL = 1e-4  # the rule's floor, relative to max(1, |ref|)
YARDSTICK = 0.25  # the most plain PyTorch's error may be, relative to max(1, |ref|): rounding, not semantics
DEVICE = "cuda"
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def bounds(ours: dict[str, Tensor], ref: dict[str, Tensor], plain: dict[str, Tensor] | None) -> list[Error]:
    """Every output's error and bound: the rule against ``plain`` (same precision), fp32's without it."""
    errors = []
    for name, got in ours.items():
        err, scale = max_error(got, ref[name]), scale_of(ref[name])
        if plain is None:
            errors.append(Error(name, err, FP32_TOL[name] * scale))
            continue
        err_plain = max_error(plain[name], ref[name])
        errors.append(Error(name, err, 2 * err_plain + ATOL * scale))
        # the yardstick itself: plain PyTorch off by a sizeable fraction computes another attention (a wrong
        # mask in the check), and would let anything pass
        errors.append(Error(f"{name} (plain PyTorch's own error)", err_plain, YARDSTICK * scale))
        if name == "lse":
            errors.append(Error("lse (fp32 tolerance)", err, FP32_TOL["lse"] * scale))
    return errors


def double(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.double()


# ------------------------------------------------------------------------------------ the core cases


def core(c: GpuCase) -> list[Error]:
    """One of ``gpu_cases.CASES`` through ``flash_attention(backend="triton")``: forward and, where it ships,
    backward; rows that see no key must give O = 0, lse = -inf, dq = 0 (an AssertionError otherwise)."""
    q, k, v, dO, dlse = make_inputs(c, DEVICE)
    backward = gpu_cases.backward_ships(c)

    def ours(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return fa.flash_attention(
            q, k, v, causal=c.causal, causal_align=c.causal_align, enable_gqa=c.group > 1, return_lse=True,
            backend="triton",
        )  # fmt: skip

    def dense(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return fa.dense_attention(
            q, k, v, causal=c.causal, causal_align=c.causal_align, enable_gqa=c.group > 1, return_lse=True
        )

    def plain(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return gpu_cases.plain_attention(q, k, v, causal=c.causal, causal_align=c.causal_align)

    got = forward_backward(ours, q, k, v, dO, dlse, backward)
    ref = forward_backward(dense, q.double(), k.double(), v.double(), dO.double(), double(dlse), backward)
    gpu_cases.check_nothing_seen_gives_zeros(c, got)
    same = None if c.dtype == torch.float32 else forward_backward(plain, q, k, v, dO, dlse, backward)
    return bounds(got, ref, same)


def ships(c: GpuCase) -> bool:
    """Whether the forward ships for the case's dtype and head dim (the refusals are the GPU tests' business)."""
    return c.D <= gpu_cases.max_head_dim(c.dtype, backward=False)


# ---------------------------------------------------------------------- masks, window, softcap, score_mod


@dataclass(frozen=True)
class MaskedCase:
    """A bf16/fp16 call with the variants that change which keys a row sees or its scores. ``keep``: keys
    kept per batch element by a bool ``attn_mask`` (a padding mask; 0 leaves a whole element without a key);
    ``seqlens_k``: the same by ``seqlens_k``."""

    name: str
    dtype: torch.dtype = torch.bfloat16
    D: int = 128
    N_q: int = 200
    N_k: int = 300
    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float | None = None
    keep: tuple[int, int] | None = None
    seqlens_k: tuple[int, int] | None = None
    score_mod: ScoreMod | None = None
    sdpa: bool = False  # through the drop-in, scaled_dot_product_attention (its default backend; no lse)
    B: int = 2
    H_q: int = 8
    H_kv: int = 2

    def padding(self) -> Tensor:
        """``(B, 1, 1, N_k)``: the bool key-padding mask of ``keep`` (True: the key is there)."""
        assert self.keep is not None
        keys = torch.arange(self.N_k, device=DEVICE)
        return (keys < torch.tensor(self.keep, device=DEVICE)[:, None]).reshape(self.B, 1, 1, self.N_k)

    def visible(self) -> Tensor:
        """``(B, 1, N_q, N_k)``: which keys each query row sees, written out from the definitions."""
        i = torch.arange(self.N_q, device=DEVICE)[:, None]
        j = torch.arange(self.N_k, device=DEVICE)[None, :]
        seen = torch.ones(self.B, 1, self.N_q, self.N_k, dtype=torch.bool, device=DEVICE)
        if self.causal:
            seen &= j <= i
        if self.window is not None:
            left, right = self.window
            seen &= (j >= i - left) if left >= 0 else True
            seen &= (j <= i + right) if right >= 0 else True
        for lengths in (self.keep, self.seqlens_k):
            if lengths is not None:
                seen &= j < torch.tensor(lengths, device=DEVICE)[:, None, None, None]
        return seen


def plain_masked(q: Tensor, k: Tensor, v: Tensor, c: MaskedCase) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` by the definition with every op in the inputs' dtype (softcap, score_mod, masks)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    S = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, N_q, D) @ (B, H, D, N_k)
    if c.softcap is not None:
        S = c.softcap * torch.tanh(S / c.softcap)
    if c.score_mod is not None:
        b, h, qi, kj = (torch.arange(n, device=q.device) for n in S.shape)
        S = c.score_mod(S, b[:, None, None, None], h[None, :, None, None], qi[:, None], kj[None, :]).to(q.dtype)
    S = S.masked_fill(~c.visible(), float("-inf"))
    empty = torch.isneginf(S).all(dim=-1, keepdim=True)  # (B, H, N_q, 1)
    S = S.masked_fill(empty, 0.0)
    P = torch.softmax(S, dim=-1).masked_fill(empty, 0.0)
    return torch.matmul(P, v), torch.logsumexp(S, dim=-1).masked_fill(empty.squeeze(-1), float("-inf"))


def masked(c: MaskedCase) -> list[Error]:
    """``flash_attention(backend="triton")`` with the case's variants (``flex_attention`` for a score_mod,
    ``scaled_dot_product_attention`` if ``c.sdpa``), forward and backward, against float64 attention."""
    g = GpuCase(c.dtype, c.D, c.N_q, c.N_k, c.causal, H_kv=c.H_kv, group=c.H_q // c.H_kv, B=c.B)
    q, k, v, dO, _ = make_inputs(g, DEVICE)
    mask = None if c.keep is None else c.padding()  # (B, 1, 1, N_k): a key-padding mask
    lengths = None if c.seqlens_k is None else torch.tensor(c.seqlens_k, device=DEVICE)

    def ours(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if c.sdpa:  # lse is not returned: a stand-in, left out of the comparison
            O = fa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=c.causal, enable_gqa=True)
            return O, torch.zeros(O.shape[:-1], device=O.device)
        if c.score_mod is not None:
            with warnings.catch_warnings():  # return_lse's FutureWarning, as torch's
                warnings.simplefilter("ignore", FutureWarning)
                out = fa.flex_attention(q, k, v, score_mod=c.score_mod, enable_gqa=True, return_lse=True)
            assert isinstance(out, tuple)
            return out[0], out[1]
        return fa.flash_attention(
            q, k, v, causal=c.causal, window=c.window, softcap=c.softcap, attn_mask=mask, seqlens_k=lengths,
            return_lse=True, backend="triton",
        )  # fmt: skip

    def dense(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return fa.dense_attention(
            q, k, v, causal=c.causal, window=c.window, softcap=c.softcap, attn_mask=mask, seqlens_k=lengths,
            score_mod=c.score_mod, enable_gqa=True, return_lse=True,
        )  # fmt: skip

    got = forward_backward(ours, q, k, v, dO, None)
    ref = forward_backward(dense, q.double(), k.double(), v.double(), dO.double(), None)
    empty_rows = ~c.visible().any(dim=-1)  # (B, 1, N_q)
    assert (got["O"].masked_select(empty_rows[..., None]) == 0).all(), "O: not 0 at rows that see no key"
    same = forward_backward(lambda q, k, v: plain_masked(q, k, v, c), q, k, v, dO, None)
    if c.sdpa:
        del got["lse"]
    return bounds(got, ref, same)


def head_bias(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """A score_mod: a per-head bias and a distance penalty (ALiBi-like), as FlexAttention's examples."""
    return score + 0.1 * h - 0.02 * (q_idx - kv_idx).abs()


# -------------------------------------------------------------------------------------------- decode


def decode(paged: bool, D: int = 128, page: int = 64, dtype: torch.dtype = torch.bfloat16) -> list[Error]:
    """One decode step (a new token per sequence, GQA 4:1, lengths 0, 300 and 1000, bf16) through
    ``flash_attention_with_kvcache(backend="triton")`` on a contiguous or a paged cache (shuffled pages);
    the new keys must land at ``cache_seqlens[b]`` and O, lse match float64 attention over each sequence."""
    B, H_q, H_kv, N_max = 3, 8, 2, 1024
    lengths = [0, 300, 1000]
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)

    k_cache, v_cache = randn(B, H_kv, N_max, D), randn(B, H_kv, N_max, D)
    q, k_new, v_new = randn(B, H_q, 1, D), randn(B, H_kv, 1, D), randn(B, H_kv, 1, D)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for b, L in enumerate(lengths):
        want_k[b, :, L], want_v[b, :, L] = k_new[b, :, 0], v_new[b, :, 0]
    if paged:
        per_seq = N_max // page
        order = torch.randperm(B * per_seq, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        table = order.reshape(B, per_seq).to(torch.int32)  # (B, pages per sequence): page ids of the pool

        def pool_of(cache: Tensor) -> Tensor:  # (B, H_kv, N_max, D) -> (pages, H_kv, page, D) through the table
            pool = torch.empty(B * per_seq, H_kv, page, D, dtype=cache.dtype, device=DEVICE)
            pool[table.long().flatten()] = cache.reshape(B, H_kv, per_seq, page, D).transpose(1, 2).flatten(0, 1)
            return pool

        k_pool, v_pool = pool_of(k_cache), pool_of(v_cache)
        O, lse = fa.flash_attention_with_kvcache(
            q, k_pool, v_pool, k_new, v_new, cache_seqlens=seqlens, block_table=table, causal=True,
            return_lse=True, backend="triton",
        )  # fmt: skip
        assert torch.equal(k_pool, pool_of(want_k)) and torch.equal(v_pool, pool_of(want_v)), "pages written wrong"
    else:
        O, lse = fa.flash_attention_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True, return_lse=True, backend="triton"
        )
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), "the new keys landed elsewhere"
    refs, plains = [], []
    for b, L in enumerate(lengths):
        kb, vb = want_k[b : b + 1, :, : L + 1], want_v[b : b + 1, :, : L + 1]
        refs.append(
            fa.dense_attention(q[b : b + 1].double(), kb.double(), vb.double(), enable_gqa=True, return_lse=True)
        )
        plains.append(gpu_cases.plain_attention(q[b : b + 1], kb, vb, causal=False, causal_align="top_left"))
    ref = {"O": torch.cat([r[0] for r in refs]), "lse": torch.cat([r[1] for r in refs])}
    same = {"O": torch.cat([p[0] for p in plains]), "lse": torch.cat([p[1] for p in plains])}
    return bounds({"O": O, "lse": lse}, ref, same)


# ----------------------------------------------------------------------------------------------- FP8


def fp8(causal: bool, D: int = 128) -> list[Error]:
    """FlashAttention-3's FP8 forward (e4m3 inputs, per (batch, key/value head) descales, GQA 2:1) against
    float64 attention of the dequantised inputs; the same precision is the library's CPU emulation."""
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        raise Skip(f"no FP8 kernel on sm_{major}{minor}: it is built for sm_90 only")
    B, H_q, H_kv, N = 2, 4, 2, 300
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q8, k8, v8 = (
        (2 * torch.randn(B, H, N, D, generator=gen, device=DEVICE)).to(torch.float8_e4m3fn) for H in (H_q, H_kv, H_kv)
    )
    qd, kd, vd = (0.5 + torch.rand(B, H_kv, generator=gen, device=DEVICE) for _ in range(3))
    O, lse = fa.flash_attention(
        q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True, backend="triton"
    )
    emulated = fa.flash_attention(
        q8.cpu(), k8.cpu(), v8.cpu(), causal=causal, q_descale=qd.cpu(), k_descale=kd.cpu(), v_descale=vd.cpu(),
        return_lse=True, backend="online",
    )  # fmt: skip
    group = H_q // H_kv
    Q = q8.double() * qd.double().repeat_interleave(group, dim=1)[:, :, None, None]
    K, V = k8.double() * kd.double()[:, :, None, None], v8.double() * vd.double()[:, :, None, None]
    ref_O, ref_lse = fa.dense_attention(Q, K, V, causal=causal, enable_gqa=True, return_lse=True)
    same = {"O": emulated[0].to(DEVICE), "lse": emulated[1].to(DEVICE)}
    return bounds({"O": O, "lse": lse}, {"O": ref_O, "lse": ref_lse}, same)


# ------------------------------------------------------------------------ determinism and CUDA graphs


def deterministic(dtype: torch.dtype) -> list[Error]:
    """Two ``deterministic=True`` backward passes of one GQA causal call: bitwise equal (bound 0), and
    within the rule of float64 attention."""
    c = GpuCase(dtype, 64, 1000, 1000, causal=True, H_kv=2, group=4, B=2)
    q, k, v, dO, _ = make_inputs(c, DEVICE)

    def ours(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return fa.flash_attention(q, k, v, causal=True, deterministic=True, return_lse=True, backend="triton")

    def dense(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return fa.dense_attention(q, k, v, causal=True, enable_gqa=True, return_lse=True)

    def plain(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return gpu_cases.plain_attention(q, k, v, causal=True, causal_align="top_left")

    first, second = (forward_backward(ours, q, k, v, dO, None) for _ in range(2))
    errors = [
        Error(f"{name} run 1 vs 2", 0.0 if torch.equal(first[name], second[name]) else float("inf"), 0.0)
        for name in gpu_cases.OUTPUTS
    ]
    ref = forward_backward(dense, q.double(), k.double(), v.double(), dO.double(), None)
    same = None if dtype == torch.float32 else forward_backward(plain, q, k, v, dO, None)
    return errors + bounds(first, ref, same)


def training_step_graph() -> None:
    """A training step's attention captured in a CUDA graph and replayed on new values (graph_cases.py)."""
    graph_cases.check_training_step_replays(DEVICE)


def decode_step_graph() -> None:
    """A decode step captured in a CUDA graph and replayed with new values and lengths (graph_cases.py)."""
    graph_cases.check_decode_step_replays(DEVICE)
