"""What the GPU tests and the GPU suite launch, as data: the cases of ``tests/triton/gpu_cases.py`` (which
imports them from here) and the calls of ``benchmarks/run_gpu_suite.sh``'s benchmarks, so that
``flashattn-teach kernels --specializations`` (:mod:`.specializations`) can capture and compile every kernel
specialisation a GPU run would build, without a GPU and without importing ``tests/``.

    CASES              tests/triton/test_triton_gpu.py's calls (forward and, where it ships, backward)
    determinism_case   its two backward checks (deterministic twice; default against deterministic)
    peak_memory_case   its peak-memory check (fp16, D = 64, causal, N = 2k, 4k, 8k)
    BENCH_TRIMMED      bench_attention.py --trimmed: bf16, D = 64 and 128, causal and not, N = 2k and 8k,
                       B N = 16k tokens, H = 2048 / D; providers triton, triton-ptr, triton-nows, triton-det
    VARIANT_ROWS       bench_gpu_variants.py's Triton rows: window, softcap, seqlens_k through triton_attention;
                       varlen, fp8 (forward only) and sinks through the public API with backend="triton"
    FIRST_LIGHT_MASKED benchmarks/first_light_cases.py's padding-mask, window, softcap and seqlens_k cases
    FIRST_LIGHT_MORE   its SDPA drop-in padding mask and its warp-specialised group (the switch on)
    FIRST_LIGHT_SCORE_MODS  its score_mod cases (flex_attention's route)
    TESTS_MORE         test_triton_fp8.py's GPU cases, test_triton_cuda_graph.py's training step
    decode_calls       every decode step (:mod:`.decode_cases`); BLOCK_MASK_CALLS: create_block_mask on CUDA

:func:`suite_calls` lists them all as :class:`Call` values, each named, for the capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .decode_cases import DecodeCall, decode_calls
from .flex_cases import BLOCK_MASK_CALLS, BlockMaskCall

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class GpuCase:
    """One call of ``triton_attention`` and its backward, judged against float64 attention."""

    dtype: torch.dtype
    D: int
    N_q: int
    N_k: int
    causal: bool = False
    causal_align: str = "top_left"
    H_kv: int = 2
    group: int = 1  # query heads per key/value head
    B: int = 1
    bnhd: bool = False  # inputs stored (B, N, H, D) and passed as their transpose(1, 2) views
    dlse: bool = False  # the loss also depends on lse

    @property
    def H_q(self) -> int:
        return self.H_kv * self.group

    @property
    def name(self) -> str:
        mask = f"causal_{'tl' if self.causal_align == 'top_left' else 'br'}" if self.causal else "full"
        parts = [DTYPE_NAMES[self.dtype], f"d{self.D}", mask, f"q{self.N_q}k{self.N_k}", f"h{self.H_q}:{self.H_kv}"]
        return "-".join(parts + ["bnhd"] * self.bnhd + ["dlse"] * self.dlse)


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TL, BR = "top_left", "bottom_right"
C = GpuCase
# Within a block (dtype, head dim), cases with the same causal flag, GQA or not, and offset class (a
# multiple of 16 or not) share one JIT specialisation (see the module docstring). Shapes: 129/33
# bottom-right leaves 96 query rows without a key (offset -96, a multiple of 16), 300/44 leaves 256;
# 100/37 bottom-right leaves 63 (offset -63); 37/100 top-left leaves keys 37..99 unseen by any query.
CASES: list[GpuCase] = [
    # bf16, head dim 64
    C(BF16, 64, 129, 129),
    C(BF16, 64, 100, 37, bnhd=True, dlse=True),
    C(BF16, 64, 17, 17, causal=True),
    C(BF16, 64, 100, 37, causal=True),
    C(BF16, 64, 37, 100, causal=True, bnhd=True),
    C(BF16, 64, 129, 33, causal=True, causal_align=BR, dlse=True),
    C(BF16, 64, 33, 129, causal=True, causal_align=BR),
    C(BF16, 64, 129, 129, causal=True, group=4),
    C(BF16, 64, 129, 33, causal=True, causal_align=BR, group=4, bnhd=True),
    C(BF16, 64, 129, 129, causal=True, H_kv=1, group=4),  # MQA: one more dK/dV specialisation (H_kv = 1)
    # bf16, head dim 128
    C(BF16, 128, 129, 129),
    C(BF16, 128, 100, 37, bnhd=True, dlse=True),
    C(BF16, 128, 17, 17, causal=True),
    C(BF16, 128, 100, 37, causal=True),
    C(BF16, 128, 37, 100, causal=True, bnhd=True),
    C(BF16, 128, 129, 33, causal=True, causal_align=BR, dlse=True),
    C(BF16, 128, 300, 44, causal=True, causal_align=BR),  # the first two query blocks of 128 see nothing
    C(BF16, 128, 100, 37, causal=True, causal_align=BR, dlse=True),
    C(BF16, 128, 37, 100, causal=True, causal_align=BR),
    C(BF16, 128, 129, 129, causal=True, group=4),
    C(BF16, 128, 129, 33, causal=True, causal_align=BR, group=4),
    C(BF16, 128, 129, 129, causal=True, H_kv=1, group=4),
    # bf16, the other head dims: causal bottom-right with empty rows
    C(BF16, 40, 100, 37, causal=True, causal_align=BR),
    C(BF16, 80, 100, 37, causal=True, causal_align=BR, dlse=True),
    C(BF16, 80, 37, 100, causal=True, causal_align=BR, bnhd=True),
    C(BF16, 96, 100, 37, causal=True, causal_align=BR, bnhd=True),
    C(BF16, 96, 37, 100, causal=True, causal_align=BR, dlse=True),
    C(BF16, 256, 100, 37, causal=True, causal_align=BR, dlse=True),
    C(BF16, 256, 37, 100, causal=True, causal_align=BR, bnhd=True),
    C(BF16, 100, 100, 37, causal=True, causal_align=BR, dlse=True),  # 200-byte rows: no TMA, the fallback tiles
    # bf16, long and single-query (a decode step against a key/value cache, in both alignments)
    C(BF16, 128, 4096, 4096, causal=True, dlse=True),
    C(BF16, 128, 1, 129, causal=True, causal_align=BR),
    C(BF16, 128, 1, 129, causal=True),
    C(BF16, 128, 129, 1, causal=True, causal_align=BR, H_kv=1),  # N_k = 1 and H_q = H_kv = 1: constants
    C(BF16, 64, 1, 300, causal=True, causal_align=BR, B=2, group=4),  # a batched GQA decode step
    # fp16, head dim 64
    C(FP16, 64, 129, 129, causal=True),
    C(FP16, 64, 37, 100, causal=True, bnhd=True),
    C(FP16, 64, 129, 33, causal=True, causal_align=BR, dlse=True),
    C(FP16, 64, 300, 44, causal=True, causal_align=BR, bnhd=True),
    C(FP16, 64, 129, 129, causal=True, group=4),
    C(FP16, 64, 129, 33, causal=True, causal_align=BR, group=4),
    C(FP16, 64, 17, 17, causal=True, H_kv=1, group=4),
    # fp16, head dim 128
    C(FP16, 128, 17, 17, causal=True),
    C(FP16, 128, 100, 37, causal=True),
    C(FP16, 128, 129, 33, causal=True, causal_align=BR, bnhd=True, dlse=True),
    C(FP16, 128, 100, 37, causal=True, causal_align=BR, dlse=True),
    C(FP16, 128, 37, 100, causal=True, causal_align=BR),
    C(FP16, 128, 129, 129, group=4),
    C(FP16, 128, 100, 37, group=4, bnhd=True),
    # fp16, the other head dims: not causal
    C(FP16, 40, 100, 37),
    C(FP16, 80, 129, 129),
    C(FP16, 80, 100, 37, bnhd=True, dlse=True),
    C(FP16, 96, 129, 129, dlse=True),
    C(FP16, 96, 100, 37, bnhd=True),
    C(FP16, 256, 129, 129),
    C(FP16, 256, 100, 37, bnhd=True, dlse=True),
    # fp16, long and single-query
    C(FP16, 64, 4096, 4096, causal=True),
    C(FP16, 64, 1, 1),
    # fp32
    C(FP32, 64, 129, 129, causal=True, group=4),
    C(FP32, 64, 129, 33, causal=True, causal_align=BR, group=4, dlse=True),
    C(FP32, 40, 100, 37, causal=True, causal_align=BR),
    C(FP32, 80, 100, 37, bnhd=True, dlse=True),
    C(FP32, 80, 17, 17),
    C(FP32, 128, 17, 17, causal=True),
    C(FP32, 128, 129, 33, causal=True, causal_align=BR, dlse=True),
    C(FP32, 128, 37, 100, causal=True, bnhd=True),
    C(FP32, 160, 17, 17),  # refused by name
]
del C

DETERMINISM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PEAK_MEMORY_SEQS = (2048, 4096, 8192)


def determinism_case(dtype: torch.dtype) -> GpuCase:
    """The GQA causal call whose backward the determinism checks run twice (and with both backwards)."""
    return GpuCase(dtype, 64, 1000, 1000, causal=True, H_kv=2, group=4, B=2)


def peak_memory_case(N: int) -> GpuCase:
    """One call of the peak-memory check: fp16, D = 64, 8 heads, causal, forward and backward."""
    return GpuCase(FP16, 64, N, N, causal=True, H_kv=8)


@dataclass(frozen=True)
class BenchGrid:
    """``bench_attention.py --trimmed``'s grid: a cell's ``B = tokens // N`` and ``H = hidden // D``."""

    dtypes: tuple[torch.dtype, ...] = (BF16,)
    head_dims: tuple[int, ...] = (64, 128)
    causal: tuple[bool, ...] = (False, True)
    seq_lens: tuple[int, ...] = (2048, 8192)
    tokens: int = 16 * 1024
    hidden: int = 2048
    providers: tuple[str, ...] = ("triton", "triton-ptr", "triton-nows", "triton-det")


BENCH_TRIMMED = BenchGrid()


@dataclass(frozen=True)
class Call:
    """One ``triton_attention`` call (and its backward) as a GPU run makes it: ``case``'s shapes and options,
    the forward as shipped (``forward="default"``), with its key/value loads through pointers
    (``"pointers"``, the benchmark's triton-ptr) or without warp specialisation (``"unspecialised"``,
    triton-nows); a sliding ``window``, a ``softcap``, key lengths ``seqlens_k`` per batch element."""

    name: str
    case: GpuCase
    backward: bool = True
    deterministic: bool = False
    forward: str = "default"
    window: tuple[int, int] | None = None
    softcap: float | None = None
    seqlens_k: tuple[int, ...] | None = None
    packed: tuple[int, ...] | None = None  # varlen: sequences of these lengths packed (T, H, D), N ignored
    fp8: bool = False  # q, k, v in e4m3 with descales per (batch, kv head): the FP8 forward (no backward)
    sinks: bool = False  # a sink logit per query head
    padding: tuple[int, ...] | None = None  # keys kept per batch element by a bool attn_mask (B, 1, 1, N_k)
    api: bool = False  # through flash_attention(backend="triton") rather than triton_attention
    alibi: bool = False  # ALiBi slopes per query head (the FP8 tests' variants)
    score_mod: bool = False  # through flex_attention's route with the first light's head_bias score_mod
    warp_specialize: bool = False  # with FLASHATTN_TEACH_WARP_SPECIALIZE=1 (the first light's warp-specialised group)


def _bench_calls(grid: BenchGrid) -> list[Call]:
    out = []
    for dt in grid.dtypes:
        for d in grid.head_dims:
            for causal in grid.causal:
                for n in grid.seq_lens:
                    h = max(1, grid.hidden // d)
                    case = GpuCase(dt, d, n, n, causal=causal, H_kv=h, B=max(1, grid.tokens // n))
                    name = f"bench-{case.name}"
                    out += [
                        Call(f"{name}-triton", case),
                        Call(f"{name}-triton-ptr", case, forward="pointers"),
                        Call(f"{name}-triton-nows", case, forward="unspecialised"),
                        Call(f"{name}-triton-det", case, deterministic=True),
                    ]
    return out


# bench_gpu_variants.py's rows that go through triton_attention: bf16, B = 4, H = 16, N = 4096, D = 128
_VARIANT_CASE = GpuCase(BF16, 128, 4096, 4096, H_kv=16, B=4)
_CAUSAL_VARIANT_CASE = GpuCase(BF16, 128, 4096, 4096, causal=True, H_kv=16, B=4)
VARIANT_ROWS: list[Call] = [
    Call("variants-window", _VARIANT_CASE, window=(256, 0)),
    Call("variants-softcap", GpuCase(BF16, 128, 4096, 4096, causal=True, H_kv=16, B=4), softcap=30.0),
    Call("variants-seqlens_k", _VARIANT_CASE, seqlens_k=(4096, 3000, 2000, 1000)),
    Call("variants-varlen", _CAUSAL_VARIANT_CASE, packed=(4096, 3000, 2000, 1000, 4096, 2192)),
    Call("variants-fp8", _CAUSAL_VARIANT_CASE, backward=False, fp8=True),
    Call("variants-sinks", _CAUSAL_VARIANT_CASE, window=(128, 0), sinks=True),  # GPT-OSS's sliding layers
]


# benchmarks/first_light_cases.py's masked cases (first_light_checks.MaskedCase: B = 2, H_q = 8, H_kv = 2,
# N_q = 200, N_k = 300, D = 128 bf16 unless named), through flash_attention(backend="triton"), forward and backward
_FL = GpuCase(BF16, 128, 200, 300, H_kv=2, group=4, B=2)
FIRST_LIGHT_MASKED: list[Call] = [
    Call("first-light-padding-mask", _FL, padding=(300, 0), api=True),
    Call(
        "first-light-padding-mask-hd64-causal",
        GpuCase(BF16, 64, 200, 300, causal=True, H_kv=2, group=4, B=2),
        padding=(250, 37),
        api=True,
    ),
    Call("first-light-window", _FL, window=(64, 16), api=True),
    Call(
        "first-light-softcap", GpuCase(BF16, 128, 200, 300, causal=True, H_kv=2, group=4, B=2), softcap=30.0, api=True
    ),
    Call(
        "first-light-window-softcap-fp16",
        GpuCase(FP16, 64, 200, 300, H_kv=2, group=4, B=2),
        window=(100, 0),
        softcap=20.0,
        api=True,
    ),
    Call("first-light-seqlens-k", _FL, seqlens_k=(300, 41), api=True),
    Call("first-light-seqlens-k-zero", _FL, seqlens_k=(0, 300), api=True),
]


def head_bias(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor):
    """first_light_checks.head_bias: a per-head bias and a distance penalty."""
    return score + 0.1 * h - 0.02 * (q_idx - kv_idx).abs()


# the first light's sdpa-drop-in-padding-mask (scaled_dot_product_attention passes its bool mask on) and its
# warp-specialised group (WS_CORE, WS_MASKED) run with FLASHATTN_TEACH_WARP_SPECIALIZE=1
_WS_CORE = [
    GpuCase(BF16, 64, 129, 129),
    GpuCase(BF16, 64, 129, 33, causal=True, causal_align=BR, dlse=True),
    GpuCase(BF16, 128, 17, 17, causal=True),
    GpuCase(BF16, 128, 300, 44, causal=True, causal_align=BR),
    GpuCase(BF16, 128, 1, 129, causal=True, causal_align=BR),
    GpuCase(BF16, 128, 129, 129, causal=True, group=4),
    GpuCase(FP16, 256, 100, 37, bnhd=True, dlse=True),
    GpuCase(BF16, 128, 4096, 4096, causal=True),
]
FIRST_LIGHT_MORE: list[Call] = [
    Call(
        "first-light-sdpa-drop-in-padding-mask",
        GpuCase(BF16, 128, 300, 300, H_kv=2, group=4, B=2),
        padding=(300, 111),
        api=True,
    ),
    *(Call(f"first-light-ws-{c.name}", c, api=True, warp_specialize=True) for c in _WS_CORE),
    Call("first-light-ws-seqlens-k-zero", _FL, seqlens_k=(0, 300), api=True, warp_specialize=True),
    Call("first-light-ws-window", _FL, window=(64, 16), api=True, warp_specialize=True),
]

FIRST_LIGHT_SCORE_MODS: list[Call] = [
    Call("first-light-score-mod-head-bias", GpuCase(BF16, 64, 200, 300, H_kv=2, group=4, B=2), score_mod=True),
    Call("first-light-score-mod-head-bias-hd128", GpuCase(BF16, 128, 300, 300, H_kv=2, group=4, B=2), score_mod=True),
]

# tests/triton/test_triton_fp8.py's GPU cases (sm_90; D = 64, descales per (batch, kv head)), forward only,
# and test_triton_cuda_graph.py's training step (bf16, causal, hd128, B = 2, H = 4, N = 384)
_FP8_GQA = GpuCase(BF16, 64, 45, 45, causal=True, H_kv=2, group=2, B=2)
TESTS_MORE: list[Call] = [
    Call("tests-fp8-causal-gqa-negative-descale", _FP8_GQA, backward=False, fp8=True),
    Call(
        "tests-fp8-variants-bottom-right",
        GpuCase(BF16, 64, 23, 50, causal=True, causal_align=BR, H_kv=1, group=2, B=2),
        backward=False,
        fp8=True,
        window=(19, 0),
        softcap=4.0,
        seqlens_k=(50, 0),
        alibi=True,
    ),
    Call("tests-fp8-sinks-gqa", _FP8_GQA, backward=False, fp8=True, sinks=True),
    Call("tests-cuda-graph-training-step", GpuCase(BF16, 128, 384, 384, causal=True, H_kv=4, B=2), api=True),
]


def suite_calls() -> list[Call | DecodeCall | BlockMaskCall]:
    """Every call the GPU tests and the suite's benchmarks make, named (``tests-``, ``bench-``, ``variants-``,
    ``first-light-``, ``decode-``: :mod:`.decode_cases`)."""
    calls: list[Call | DecodeCall | BlockMaskCall] = [Call(f"tests-{c.name}", c) for c in CASES]
    for dt in DETERMINISM_DTYPES:
        c = determinism_case(dt)
        calls += [Call(f"tests-deterministic-{c.name}", c, deterministic=True), Call(f"tests-default-{c.name}", c)]
    calls += [Call(f"tests-peak-memory-{peak_memory_case(n).name}", peak_memory_case(n)) for n in PEAK_MEMORY_SEQS]
    calls += (
        _bench_calls(BENCH_TRIMMED)
        + VARIANT_ROWS
        + FIRST_LIGHT_MASKED
        + FIRST_LIGHT_MORE
        + FIRST_LIGHT_SCORE_MODS
        + TESTS_MORE
    )
    return calls + BLOCK_MASK_CALLS + decode_calls()
