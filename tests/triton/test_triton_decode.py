"""The Triton decode kernels (split-KV, :mod:`flashattn_teach.triton.kernels.decode`): ``O`` and ``lse`` of
``flash_attention_with_kvcache(..., backend="triton")`` against the float64 dense oracle (the same call
with ``backend="dense"`` on float64 copies), with per-batch cache lengths that include an empty cache and
lengths that cut key blocks, 1 to more splits than key blocks, one and several new queries, grouped-query
heads, a window, softcap and ALiBi; the in-place append; the routing; and, compiled ahead of time for sm_90
and sm_80, no spills. In the interpreter the key blocks are 16 keys (``TEST_DECODE_CONFIG``), so the
caches here span up to three blocks. A GPU test (skipped without CUDA) runs Llama's decode shapes in
fp16 and bf16 against flash-attn's rule.
"""

from __future__ import annotations

import subprocess

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _triton_cases import DEVICE, ON_GPU, REL_TOL, assert_close_scaled  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flashattn_teach as fa  # noqa: E402
from flashattn_teach import dispatch  # noqa: E402
from flashattn_teach.serving import launch as decode_launch  # noqa: E402
from flashattn_teach.triton.configs import ARCHS  # noqa: E402
from sass_cache import AOT_PYTHON, aot_env  # noqa: E402

B, H_KV, N_MAX = 3, 2, 40
# old entries per batch element: an empty cache, and lengths that end inside a 16-key block, or with 3 new
# entries (L = 32) on a block boundary, where the diagonal's block is whole and must still be masked
SEQLENS = [0, 17, 29]


def problem(*, group=2, n_new=1, n_new_kv=0, D=16, D_v=16, dtype=torch.float32, seed=0, layout="bhnd"):
    """``q, k_cache, v_cache, k, v`` (``k, v`` None without new entries); ``layout="bnhd"``: caches stored
    ``(B, N_max, H_kv, D)`` and passed as transposed views (strided, as many inference engines keep them)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    q = randn(B, H_KV * group, n_new, D)
    if layout == "bnhd":
        k_cache, v_cache = randn(B, N_MAX, H_KV, D).transpose(1, 2), randn(B, N_MAX, H_KV, D_v).transpose(1, 2)
    else:
        k_cache, v_cache = randn(B, H_KV, N_MAX, D), randn(B, H_KV, N_MAX, D_v)
    new = (randn(B, H_KV, n_new_kv, D), randn(B, H_KV, n_new_kv, D_v)) if n_new_kv else (None, None)
    return q, k_cache, v_cache, *new


def wide(t):
    return None if t is None else t.detach().double().cpu()


def check_against_oracle(args, *, what, rel=None, **options):
    """Run ``backend="triton"`` and the float64 dense oracle on copies of the same inputs; compare O, lse
    and the caches after the append; causal unless ``options`` say otherwise (a language model's step)."""
    q, k_cache, v_cache, k, v = args
    options = {"causal": True, **options}
    seqlens = torch.tensor(SEQLENS, device=DEVICE)
    ref_cache = (wide(k_cache), wide(v_cache))
    ref_options = {n: wide(a) if isinstance(a, torch.Tensor) else a for n, a in options.items()}
    O, lse = fa.flash_attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, backend="triton", return_lse=True, **options
    )
    O_ref, lse_ref = fa.flash_attention_with_kvcache(
        wide(q),
        *ref_cache,
        wide(k),
        wide(v),
        cache_seqlens=seqlens.cpu(),
        backend="dense",
        return_lse=True,
        **ref_options,
    )
    assert O.dtype == q.dtype and lse.dtype == torch.float32 and O.shape == O_ref.shape and lse.shape == lse_ref.shape
    rel = REL_TOL[q.dtype] if rel is None else rel
    assert_close_scaled(O, O_ref, rel, f"{what}: O")
    assert_close_scaled(lse, lse_ref, rel, f"{what}: lse")
    assert torch.equal(wide(k_cache), ref_cache[0]) and torch.equal(wide(v_cache), ref_cache[1]), f"{what}: caches"
    return O, lse


@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_one_new_query_over_ragged_caches_in_any_number_of_splits(num_splits):
    # batch element 0 has no key at all: O = 0, lse = -inf (checked by the comparison), no NaN
    O, lse = check_against_oracle(problem(), what=f"{num_splits} splits", num_splits=num_splits)
    assert torch.all(O[0] == 0) and torch.all(torch.isneginf(lse[0]))


def test_more_splits_than_key_blocks_leave_empty_splits_that_the_combine_ignores():
    # the launcher caps num_splits at the blocks of N_max; launch_decode runs 8 splits over at most 3 blocks
    q, k_cache, v_cache, _, _ = problem()
    seqlens = torch.tensor(SEQLENS, dtype=torch.int32, device=DEVICE)
    options = {"causal": True, "scale": 0.25, "window": (-1, -1), "softcap": None, "alibi_slopes": None}
    config = decode_launch.TEST_DECODE_CONFIG
    O, lse = decode_launch.launch_decode(q, k_cache, v_cache, seqlens, 0, num_splits=8, config=config, **options)
    O_ref, lse_ref = fa.flash_attention_with_kvcache(
        wide(q), wide(k_cache), wide(v_cache), cache_seqlens=seqlens.cpu(), causal=True, scale=0.25,
        backend="dense", return_lse=True,
    )  # fmt: skip
    assert_close_scaled(O, O_ref, REL_TOL[q.dtype], "8 splits: O")
    assert_close_scaled(lse, lse_ref, REL_TOL[q.dtype], "8 splits: lse")


def test_new_entries_are_appended_in_place_and_several_queries_see_them_causally():
    # 3 new queries and keys: row i at position L_b - 3 + i sees keys up to itself (bottom-right causal)
    check_against_oracle(problem(n_new=3, n_new_kv=3), what="append, N_new=3", num_splits=2)


def test_query_heads_times_new_queries_beyond_one_row_block_and_strided_caches():
    # G x N_new = 4 x 5 = 20 rows: two row blocks of 16; D = 24 and D_v = 40 padded to 32 and 64 lanes
    args = problem(group=4, n_new=5, n_new_kv=2, D=24, D_v=40, layout="bnhd")
    check_against_oracle(args, what="G=4, N_new=5, strided", num_splits=3)


@pytest.mark.parametrize(
    ("window", "causal"), [((20, 0), True), ((3, 2), False), ((-1, 4), False)], ids=["causal_left20", "3_2", "right4"]
)
def test_window(window, causal):
    # (20, 0) over L = 30: keys [8, 30) in two splits, the first a whole block that row 1 (left bound 9) cuts
    check_against_oracle(
        problem(n_new=2, n_new_kv=1), what=f"window {window}", window=window, causal=causal, num_splits=2
    )


def test_softcap_and_alibi_per_batch_element():
    slopes = torch.linspace(0.05, 0.9, B * H_KV * 2, device=DEVICE).reshape(B, H_KV * 2)  # (B, H_q)
    args = problem(n_new=2, n_new_kv=1)
    check_against_oracle(args, what="softcap, ALiBi", softcap=3.0, alibi_slopes=slopes, num_splits=2)


def test_float16_and_a_negative_scale():
    check_against_oracle(problem(dtype=torch.float16, n_new_kv=1), what="fp16", scale=-0.3, num_splits=2)


@settings(max_examples=6)
@given(
    keys=st.lists(st.one_of(st.integers(0, N_MAX), st.sampled_from([16, 32])), min_size=B, max_size=B),
    group=st.sampled_from([1, 2, 4]),
    n_new=st.integers(1, 3),
    n_new_kv=st.integers(0, 2),
    num_splits=st.integers(1, 5),
    causal=st.booleans(),
    window=st.sampled_from([None, (4, 0), (6, 3), (20, 0)]),
)
def test_the_kernel_matches_the_oracle_for_any_lengths_and_splits(
    keys, group, n_new, n_new_kv, num_splits, causal, window
):
    # L_b = keys[b] (at least the new entries): often on a block boundary, where only the masks tell rows apart
    q, k_cache, v_cache, k, v = problem(group=group, n_new=n_new, n_new_kv=n_new_kv)
    seqlens = torch.tensor([max(L - n_new_kv, 0) for L in keys], device=DEVICE)
    options = {"causal": causal, "window": window, "num_splits": num_splits, "return_lse": True}
    ref_cache = (wide(k_cache), wide(v_cache))
    O, lse = fa.flash_attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, backend="triton", **options
    )
    O_ref, lse_ref = fa.flash_attention_with_kvcache(
        wide(q), *ref_cache, wide(k), wide(v), cache_seqlens=seqlens.cpu(), backend="dense", **options
    )
    assert_close_scaled(O, O_ref, REL_TOL[q.dtype], "O")
    assert_close_scaled(lse, lse_ref, REL_TOL[q.dtype], "lse")


def test_lengths_outside_the_cache_are_clamped_by_the_kernel():
    # A CUDA cache_seqlens is not read on the host (no sync), so the kernel clamps it: 99 > N_max acts as
    # N_max. (An int or a CPU tensor is checked before the call gets here: tests/serving/test_decode_contract.py.)
    q, k_cache, v_cache, _, _ = problem()
    seqlens = torch.tensor([0, 29, 99], dtype=torch.int32, device=DEVICE)
    options = {"causal": True, "scale": 0.25, "window": (-1, -1), "softcap": None, "alibi_slopes": None}
    config = decode_launch.TEST_DECODE_CONFIG
    O, _ = decode_launch.launch_decode(q, k_cache, v_cache, seqlens, 0, num_splits=2, config=config, **options)
    O_ref = fa.flash_attention_with_kvcache(
        wide(q), wide(k_cache), wide(v_cache), cache_seqlens=torch.tensor([0, 29, N_MAX]), causal=True,
        backend="dense",
    )  # fmt: skip
    assert_close_scaled(O, O_ref, REL_TOL[q.dtype], "clamped lengths: O")


def test_auto_keeps_cpu_tensors_on_the_cpu_paths_and_triton_refuses_gradients(monkeypatch):
    calls = []
    monkeypatch.setattr(decode_launch, "launch_decode", lambda *a, **kw: calls.append(a))
    q, k_cache, v_cache, _, _ = problem()
    if not ON_GPU:
        fa.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=5)
        assert calls == []  # "auto" picks the kernel for CUDA tensors only
    with pytest.raises(fa.errors.AttentionValueError, match="q requires grad, but the Triton decode kernel"):
        fa.flash_attention_with_kvcache(q.requires_grad_(), k_cache, v_cache, cache_seqlens=5, backend="triton")
    assert dispatch.plan_decode("auto", q, k_cache, v_cache).backend != "triton"  # gradients wanted: a CPU path


def test_default_splits_fill_the_gpu_from_the_cache_capacity():
    # num_splits=0 with the caches' capacity as key length: B x H_kv = 8 programs on 132 SMs
    assert decode_launch.rows_block(4, 64) == 16 and decode_launch.rows_block(100, 64) == 64
    splits = fa.serving.splitkv.cuda_num_splits(B=1, H_kv=8, N_q=1, group=4, N_k=16384, D=128, sm_count=132)
    assert 8 < splits <= fa.serving.splitkv.MAX_SPLITS


# ----------------------------------------------------------------------------- compiled ahead of time


@pytest.fixture(scope="module")
def compile_reports() -> dict[str, subprocess.Popen]:
    env = aot_env(PYTHONWARNINGS="ignore")
    command = [*AOT_PYTHON, "-m", "flashattn_teach.cli", "kernels-decode"]
    return {
        arch: subprocess.Popen(
            [*command, "--arch", arch, "--case", "bfloat16:128", "float32:64", "float32:128"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for arch in ARCHS
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_kernels_compile_without_spills(arch, compile_reports):
    """bf16 at head dim 128 and fp32 at 64 and 128 (the most registers per thread), with a causal window, softcap
    and ALiBi: the split kernel and the combine, each within 255 registers, no spills, shared memory within
    the limit."""
    report = compile_reports[arch]
    out, err = report.communicate(timeout=600)
    assert report.returncode == 0, f"{out}\n{err[-3000:]}"
    rows = [line.split() for line in out.splitlines()[2:]]
    assert [(row[0], row[1], row[2]) for row in rows] == [
        (kernel, dtype, d)
        for dtype, d in (("bfloat16", "128"), ("float32", "64"), ("float32", "128"))
        for kernel in ("decode_split_fwd", "decode_combine")
    ], out
    assert all(row[-1] == "ok" and row[-3] == "0" for row in rows), out


# ----------------------------------------------------------------------------------------------- GPU


def plain_pytorch(q, k_cache, v_cache, lengths, *, window=(-1, -1), softcap=None, alibi_slopes=None):
    """Decode written out in torch ops, one batch element at a time, one new query at position L - 1, in the
    inputs' dtype as ``bench_gpu_variants.py``'s reference: scores and the cap rounded to it, the ALiBi bias
    and the softmax in fp32 (or the inputs' float64), P rounded back before ``P V``."""
    outputs = []
    G = q.shape[1] // k_cache.shape[1]
    for b, L in enumerate(lengths):
        k = k_cache[b, :, :L].repeat_interleave(G, dim=0)  # (H_q, L, D)
        v = v_cache[b, :, :L].repeat_interleave(G, dim=0)
        S = (q[b] @ k.transpose(1, 2)) * q.shape[-1] ** -0.5  # (H_q, 1, D) @ (H_q, D, L) -> (H_q, 1, L)
        if softcap is not None:
            S = softcap * torch.tanh(S / softcap)
        S = S.to(torch.promote_types(S.dtype, torch.float32))
        j = torch.arange(L, device=q.device)
        if alibi_slopes is not None:
            S = S - alibi_slopes[:, None, None].to(S.dtype) * (L - 1 - j).abs()
        if window[0] >= 0:
            S = S.masked_fill(j < L - 1 - window[0], float("-inf"))
        P = torch.softmax(S, dim=-1).nan_to_num(0.0).to(v.dtype)  # a row with no key: 0
        outputs.append(P @ v)  # (H_q, 1, L) @ (H_q, L, D) -> (H_q, 1, D)
    return torch.stack(outputs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("num_splits", [0, 1, 7])
def test_llama_decode_shapes_on_gpu_meet_flash_attns_rule(dtype, num_splits):
    """Llama's decode (H_q = 32, H_kv = 8, D = 128, one new query and key) over caches of 1000, 4097, 0
    and 8191 entries: error against float64 at most twice plain PyTorch's in the same dtype (plus a
    small floor), also with a window, softcap and ALiBi; the caches hold the new entries afterwards."""
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [1000, 4097, 0, 8191]
    Bg, Hq, Hkv, D, N = len(lengths), 32, 8, 128, 8192
    q, k, v = (torch.randn(Bg, H, 1, D, device="cuda", generator=g).to(dtype) for H in (Hq, Hkv, Hkv))
    k_cache, v_cache = (torch.randn(Bg, Hkv, N, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    seqlens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    slopes = torch.rand(Hq, device="cuda")
    for options in ({}, {"window": (2048, 0), "softcap": 30.0, "alibi_slopes": slopes}):
        kc, vc = k_cache.clone(), v_cache.clone()
        O = fa.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, num_splits=num_splits, **options)
        assert all(
            torch.equal(kc[b, :, n], k[b, :, 0]) and torch.equal(vc[b, :, n], v[b, :, 0]) for b, n in enumerate(lengths)
        )
        wide_options = {n: a.double() if isinstance(a, torch.Tensor) else a for n, a in options.items()}
        O_ref = plain_pytorch(q.double(), kc.double(), vc.double(), [n + 1 for n in lengths], **wide_options)
        O_low = plain_pytorch(q, kc, vc, [n + 1 for n in lengths], **options)
        err = (O.double() - O_ref).abs().max().item()
        err_low = (O_low.double() - O_ref).abs().max().item()
        assert err <= 2 * err_low + 1e-4, f"{options}: error {err:.3g} vs plain PyTorch {err_low:.3g}"
