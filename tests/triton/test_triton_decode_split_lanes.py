"""The Triton decode kernel at a query/key head dim of 129 to 192 as two lane groups (128 + 64, ``BLOCK_D2``),
against a float64 oracle written out here.

DeepSeek's MLA shape (``D = 192``, ``D_v = 128``) and ``D = 160 = D_v`` (a second group of 32 real lanes
in 64, values padded to 256), on contiguous and paged caches (shuffled block tables, pages of 7 and 16),
GQA, one new query and four (chunked prefill, causal), several splits, sinks; the pages other than the new
slots must stay bitwise untouched. A spy on the launch checks the lane groups the kernel got, and a
negative control shows the oracle check fails for the kernel run without its second group. In the
interpreter (``TEST_DECODE_CONFIG``, 16 x 16 tiles), in float16: the interpreter's bf16 dots are wrong and
the fp32 kernel stops at head dim 128. Compiled ahead of time for sm_90 and sm_80: no spills at ``D = 192``
in bf16 (contiguous and paged), and fewer MMAs and instructions per key block than the padded build.
"""

from __future__ import annotations

import math

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _triton_cases import DEVICE, REL_TOL, assert_close_scaled  # noqa: E402

from cli_in_turn import run_in_turn  # noqa: E402
from flashattn_teach.serving import launch as decode_launch  # noqa: E402
from flashattn_teach.serving.checks import DecodeStep  # noqa: E402
from flashattn_teach.triton.configs import ARCHS  # noqa: E402
from flashattn_teach.triton.kernels import decode as decode_kernels  # noqa: E402

B, H_KV, GROUP = 2, 2, 2
SEQLENS = [13, 38]  # old entries: one cache ends inside a 16-key block, the other spans three
CAPACITY = 48  # keys per batch element at least
GARBAGE = 10**6  # block-table entries past a sequence's pages: never to be read
DTYPE = torch.float16


def decode_problem(*, D, D_v, n_new, page_size, seed=0):
    """``(q, k_cache, v_cache, k, v, block_table, dense_k, dense_v)``: the caches' contents as dense
    ``(B, H_kv, N_max, .)`` tensors (float64, the new entries already in them) and, for ``page_size``,
    scattered into shuffled pages with one spare page; otherwise the caches are copies of the dense ones."""
    g = torch.Generator().manual_seed(seed)
    rounded = lambda *shape: torch.randn(*shape, generator=g).to(DTYPE)  # noqa: E731
    q, k, v = rounded(B, H_KV * GROUP, n_new, D), rounded(B, H_KV, n_new, D), rounded(B, H_KV, n_new, D_v)
    if page_size is None:
        k_cache, v_cache = rounded(B, H_KV, CAPACITY, D), rounded(B, H_KV, CAPACITY, D_v)
        dense_k, dense_v, table = k_cache.double(), v_cache.double(), None
    else:
        max_blocks = math.ceil(CAPACITY / page_size)
        num_blocks = B * max_blocks + 1
        k_cache, v_cache = rounded(num_blocks, H_KV, page_size, D), rounded(num_blocks, H_KV, page_size, D_v)
        table = torch.randperm(num_blocks, generator=g)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
        # (B, max_blocks, H_kv, page_size, .) -> (B, H_kv, max_blocks * page_size, .): key j at page j // page_size
        dense_k = k_cache[table.long()].transpose(1, 2).flatten(2, 3).double()
        dense_v = v_cache[table.long()].transpose(1, 2).flatten(2, 3).double()
        for b, n in enumerate(SEQLENS):
            table[b, math.ceil((n + n_new) / page_size) :] = GARBAGE
    for b, n in enumerate(SEQLENS):  # what the step appends
        dense_k[b, :, n : n + n_new], dense_v[b, :, n : n + n_new] = k[b].double(), v[b].double()
    return q, k_cache, v_cache, k, v, table, dense_k, dense_v


def oracle(q, dense_k, dense_v, *, scale, sinks, leftpad):
    """``(O, lse)`` in float64: row n of batch element b at position ``p = L - N_new + n`` sees keys
    ``leftpad[b] <= j <= p`` (causal), plus the sink, a logit of value zero."""
    n_new = q.shape[2]
    O = torch.zeros(*q.shape[:3], dense_v.shape[-1], dtype=torch.float64)
    lse = torch.zeros(q.shape[:3], dtype=torch.float64)
    for b, n in enumerate(SEQLENS):
        L = n + n_new
        j = torch.arange(dense_k.shape[2])
        p = L - n_new + torch.arange(n_new)
        seen = (j[None, :] <= p[:, None]) & (j[None, :] >= leftpad[b])  # (N_new, N_max)
        for h in range(q.shape[1]):
            S = scale * q[b, h].double() @ dense_k[b, h // GROUP].T  # (N_new, D) @ (D, N_max) -> (N_new, N_max)
            S = torch.cat([S.masked_fill(~seen, float("-inf")), sinks[h].double().expand(n_new, 1)], dim=1)
            lse[b, h] = torch.logsumexp(S, dim=1)
            P = torch.exp(S - lse[b, h][:, None])[:, :-1]  # the sink's column carries no value
            O[b, h] = P @ dense_v[b, h // GROUP]  # (N_new, N_max) @ (N_max, D_v) -> (N_new, D_v)
    return O, lse


class LaunchSpy:
    """Stands in for ``decode_split_fwd``: records the lane groups of each launch, then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({name: kwargs[name] for name in ("BLOCK_D", "BLOCK_D2", "BLOCK_DV")})
            return self.kernel[grid](*args, **kwargs)

        return launch


def run_decode(problem, *, num_splits, leftpad):
    """The kernel on ``problem`` (new entries appended in place); checks that only the new slots changed."""
    q, k_cache, v_cache, k, v, table, _, _ = problem
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(SEQLENS):
        for t in range(k.shape[2]):
            if table is None:
                expect_k[b, :, n + t], expect_v[b, :, n + t] = k[b, :, t], v[b, :, t]
            else:
                page, slot = table[b, (n + t) // k_cache.shape[2]], (n + t) % k_cache.shape[2]
                expect_k[page, :, slot], expect_v[page, :, slot] = k[b, :, t], v[b, :, t]
    sinks = torch.linspace(-1.0, 1.5, H_KV * GROUP)
    with torch.no_grad():
        step = DecodeStep(
            causal=True, scale=q.shape[-1] ** -0.5, window=(-1, -1), softcap=None, num_splits=num_splits,
            backend="triton", cache_seqlens=torch.tensor(SEQLENS, dtype=torch.int32, device=DEVICE),
            block_table=None if table is None else table.to(DEVICE),
            cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device=DEVICE), sinks=sinks.to(DEVICE),
        )  # fmt: skip
        O, lse = decode_launch.triton_decode(*(t.to(DEVICE) for t in (q, k_cache, v_cache, k, v)), step)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v), "slots other than the new ones changed"
    return O, lse, oracle(q, problem[6], problem[7], scale=q.shape[-1] ** -0.5, sinks=sinks, leftpad=leftpad)


CASES = {  # name -> (D, D_v, page_size, N_new, num_splits, cache_leftpad)
    "192/128 contiguous, one query": (192, 128, None, 1, 2, [0, 0]),
    "192/128 pages of 7, chunked prefill": (192, 128, 7, 4, 3, [2, 9]),
    "160/160 pages of 16, one query": (160, 160, 16, 1, 1, [0, 0]),
    "160/160 contiguous, chunked prefill": (160, 160, None, 4, 3, [0, 5]),
}


@pytest.mark.parametrize("case", CASES)
def test_split_head_dims_decode_matches_the_oracle_in_two_lane_groups(case, monkeypatch):
    D, D_v, page_size, n_new, num_splits, leftpad = CASES[case]
    spy = LaunchSpy(decode_kernels.decode_split_fwd)
    monkeypatch.setattr(decode_kernels, "decode_split_fwd", spy)
    O, lse, (O_ref, lse_ref) = run_decode(
        decode_problem(D=D, D_v=D_v, n_new=n_new, page_size=page_size), num_splits=num_splits, leftpad=leftpad
    )
    assert spy.launches == [{"BLOCK_D": 128, "BLOCK_D2": 64, "BLOCK_DV": max(128, 1 << (D_v - 1).bit_length())}]
    assert O.dtype == DTYPE and O.shape == (B, H_KV * GROUP, n_new, D_v)
    assert_close_scaled(O, O_ref, REL_TOL[DTYPE], "O")
    assert_close_scaled(lse, lse_ref, REL_TOL[DTYPE], "lse")


def test_the_oracle_check_fails_for_the_kernel_without_its_second_lane_group(monkeypatch):
    # negative control: 192 as one group of 128 lanes (lanes 128..191 of q and k never read) is far off
    monkeypatch.setattr(decode_launch, "lane_groups", lambda head_dim: (128, 0))
    O, _, (O_ref, _) = run_decode(decode_problem(D=192, D_v=128, n_new=1, page_size=7), num_splits=2, leftpad=[0, 0])
    assert (O.double() - O_ref).abs().max() > 10 * REL_TOL[DTYPE]


CONFIG_DIMS = ((192, 128), (192, 192), (256, 256))


def test_other_head_dims_keep_one_lane_group(monkeypatch):
    # 128 and 256 (and 192 with values of 256, table_dim's 256 row) launch as before the split
    spy = LaunchSpy(decode_kernels.decode_split_fwd)
    monkeypatch.setattr(decode_kernels, "decode_split_fwd", spy)
    for D in (128, 256):
        run_decode(decode_problem(D=D, D_v=64, n_new=1, page_size=None), num_splits=1, leftpad=[0, 0])
    assert [launch["BLOCK_D2"] for launch in spy.launches] == [0, 0]
    assert [launch["BLOCK_D"] for launch in spy.launches] == [128, 256]
    # the tile rows: 192 / 128 its own; 192 / 192 pads the values to 256 and takes the 256 row
    split, wide, row_256 = (decode_launch.decode_config(torch.bfloat16, d, "sm90", d_v) for d, d_v in CONFIG_DIMS)
    assert (split.BLOCK_N, split.num_warps) == (64, 8) and wide == row_256


# ----------------------------------------------------------------------------- compiled ahead of time

COMPILES = {  # name -> arguments of flashattn-teach kernels-decode, each bf16 at 192 / 128
    "split": ["--loops"],
    "split, pages of 256": ["--paged", "256", "--loops"],
    "padded": ["--padded", "--loops"],
}


@pytest.fixture(scope="module")
def split_compiles():
    command = ["kernels-decode", "--case", "bfloat16:192/128"]
    commands = {(arch, name): [*command, "--arch", arch, *args] for arch in ARCHS for name, args in COMPILES.items()}
    return run_in_turn(commands, group=lambda key: key[0], PYTHONWARNINGS="ignore")  # one process an arch


@pytest.mark.parametrize("arch", ARCHS)
def test_d192_compiles_without_spills_and_saves_mmas_over_the_padded_build(arch, split_compiles):
    """bf16 192 / 128 on its own tile row: no spills (contiguous and paged), and per key-block iteration
    5/6 of the padded build's MMAs (a QK^T over 192 lanes and a PV over 128, against 256 and 128) and
    fewer instructions, on the same tile."""
    loops = {}
    for name in COMPILES:
        out, err, code = split_compiles[(arch, name)]
        assert code == 0, f"{name}: {out}\n{err[-3000:]}"
        rows = [line.split() for line in out.splitlines() if line.startswith("decode_")]
        assert rows and all(row[-1] == "ok" and row[-3] == "0" for row in rows), out
        profile = next(line for line in out.splitlines() if line.startswith("  decode_split_fwd:"))
        mma = int(profile.split("xHMMA")[0].rsplit(" ", 1)[-1])
        loops[name] = (int(profile.split()[1]), mma)
    (split, split_mma), (padded, padded_mma) = loops["split"], loops["padded"]
    assert split_mma * 6 == padded_mma * 5, loops
    assert split < padded, loops


# ----------------------------------------------------------------------------------------------- GPU


def plain_decode(q, k_cache, v_cache, lengths):
    """One new query at position L - 1 against ``k_cache[b, :, :L]`` in torch ops and the inputs' dtype (the
    softmax in fp32, or the inputs' float64; P rounded back before ``P V``), one batch element at a time."""
    G = q.shape[1] // k_cache.shape[1]
    outputs = []
    for b, L in enumerate(lengths):
        k = k_cache[b, :, :L].repeat_interleave(G, dim=0)  # (H_q, L, D)
        v = v_cache[b, :, :L].repeat_interleave(G, dim=0)  # (H_q, L, D_v)
        S = (q[b] @ k.transpose(1, 2)) * q.shape[-1] ** -0.5  # (H_q, 1, D) @ (H_q, D, L) -> (H_q, 1, L)
        P = torch.softmax(S.to(torch.promote_types(S.dtype, torch.float32)), dim=-1).to(v.dtype)
        outputs.append(P @ v)  # (H_q, 1, L) @ (H_q, L, D_v) -> (H_q, 1, D_v)
    return torch.stack(outputs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("page_size", [None, 16, 256])
def test_deepseek_head_dims_decode_on_gpu_meets_flash_attns_rule(page_size):
    """bf16, D = 192 and D_v = 128, H_q = 16 over H_kv = 4, one new query and key over caches of 1000, 4097,
    0 and 8191 entries (pages in flash-attn's layout, shuffled): error against float64 at most twice plain
    PyTorch's in bf16, plus a small floor."""
    import flashattn_teach as fa

    g = torch.Generator(device="cuda").manual_seed(0)
    lengths, Hq, Hkv, D, D_v, N = [1000, 4097, 0, 8191], 16, 4, 192, 128, 8192
    Bg = len(lengths)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v = randn(Bg, Hq, 1, D), randn(Bg, Hkv, 1, D), randn(Bg, Hkv, 1, D_v)
    k_cache, v_cache = randn(Bg, Hkv, N, D), randn(Bg, Hkv, N, D_v)
    seqlens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    kc, vc = k_cache.clone(), v_cache.clone()
    if page_size is None:
        O = fa.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, num_splits=0)
    else:
        max_blocks = N // page_size
        table = torch.randperm(Bg * max_blocks, device="cuda", generator=g).to(torch.int32).view(Bg, max_blocks)
        pools = []
        for cache in (kc, vc):  # (num_blocks, page_size, H_kv, .): page table[b, p] holds keys p * page_size...
            pool = torch.empty(Bg * max_blocks, page_size, Hkv, cache.shape[-1], device="cuda", dtype=cache.dtype)
            pool[table.long().flatten()] = (
                cache.view(Bg, Hkv, max_blocks, page_size, -1).permute(0, 2, 3, 1, 4).flatten(0, 1)
            )
            pools.append(pool.transpose(1, 2))
        O = fa.flash_attention_with_kvcache(q, *pools, k, v, cache_seqlens=seqlens, block_table=table, num_splits=0)
    for b, n in enumerate(lengths):
        kc[b, :, n], vc[b, :, n] = k[b, :, 0], v[b, :, 0]
    O_ref = plain_decode(q.double(), kc.double(), vc.double(), [n + 1 for n in lengths])
    O_low = plain_decode(q, kc, vc, [n + 1 for n in lengths])
    err = (O.double() - O_ref).abs().max().item()
    err_low = (O_low.double() - O_ref).abs().max().item()
    assert err <= 2 * err_low + 1e-4, f"error {err:.3g} vs plain PyTorch {err_low:.3g}"
