"""The first light's case list, as data: groups of cases, each group run in its own process (see
``first_light_runner.py``), with the budget the plan gives it. Nothing here touches CUDA at import.

The core groups are ``tests/triton/gpu_cases.py``'s ``CASES`` (the shipped GPU test cases: N_q != N_k in both
causal alignments with rows that see no key, GQA 4:1 and MQA, (B, N, H, D) views, decode-shaped calls),
sorted by dtype and head dim and run through ``flash_attention(backend="triton")``; the others add what that
list lacks: a padding mask, window and softcap, a score_mod, decode on contiguous and paged caches, FP8,
the deterministic backward twice, and CUDA-graph captures. The ``warp-specialised`` group runs a sample of
them with FLASHATTN_TEACH_WARP_SPECIALIZE=1, where the specialised forward's loops have zero or one key block
(rows without keys, N_k < BLOCK_N, ``seqlens_k = 0``). The ``timings`` groups are the headline rows.

Budgets: a process costs about 5 s to import torch and start CUDA; a case about 0.5 s once the precompile
has compiled its kernels. A case's ``timeout_s`` is generous (its kernels may still need compiling): past it,
the case is a HANG.
"""

from __future__ import annotations

from functools import partial

import torch

import first_light_checks as checks
import first_light_timings as timings
from first_light_runner import Case, Group

CASES, GpuCase = checks.gpu_cases.CASES, checks.GpuCase  # tests/triton/gpu_cases.py's, on the path checks set

NEEDS_CUDA = True
PRECOMPILE_BUDGET_S = 75.0  # one process per case, as many at once as the machine has cores
REPORT_BUDGET_S = 5.0  # writing the JSON and the table
TIMEOUT_S = 40.0  # a case's hang detector (it may still compile its kernels)
WS_ENV = (("FLASHATTN_TEACH_WARP_SPECIALIZE", "1"),)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def core(cases: list[GpuCase], suffix: str = "") -> tuple[Case, ...]:
    return tuple(Case(c.name + suffix, partial(checks.core, c), TIMEOUT_S) for c in cases if checks.ships(c))


def pick(dtype: torch.dtype, dims: tuple[int, ...]) -> list[GpuCase]:
    return [c for c in CASES if c.dtype == dtype and c.D in dims]


MASKED = (
    checks.MaskedCase("padding-mask", keep=(300, 0)),  # the second element has no key at all
    checks.MaskedCase("padding-mask-hd64-causal", D=64, causal=True, keep=(250, 37)),
    checks.MaskedCase("sdpa-drop-in-padding-mask", N_q=300, keep=(300, 111), sdpa=True),
    checks.MaskedCase("window", window=(64, 16)),
    checks.MaskedCase("softcap", softcap=30.0, causal=True),
    checks.MaskedCase("window-softcap-fp16", dtype=FP16, D=64, window=(100, 0), softcap=20.0),
    checks.MaskedCase("seqlens-k", seqlens_k=(300, 41)),
)
SCORE_MODS = (
    checks.MaskedCase("score-mod-head-bias", D=64, score_mod=checks.head_bias),
    checks.MaskedCase("score-mod-head-bias-hd128", N_q=300, N_k=300, score_mod=checks.head_bias),
)
# Where a warp-specialised loop has zero or one iteration: rows without keys, N_k < BLOCK_N, seqlens_k = 0.
WS_CORE = [
    GpuCase(BF16, 64, 129, 129),
    GpuCase(BF16, 64, 129, 33, causal=True, causal_align="bottom_right", dlse=True),
    GpuCase(BF16, 128, 17, 17, causal=True),
    GpuCase(BF16, 128, 300, 44, causal=True, causal_align="bottom_right"),
    GpuCase(BF16, 128, 1, 129, causal=True, causal_align="bottom_right"),
    GpuCase(BF16, 128, 129, 129, causal=True, group=4),
    GpuCase(FP16, 256, 100, 37, bnhd=True, dlse=True),
    GpuCase(BF16, 128, 4096, 4096, causal=True),
]
WS_MASKED = (checks.MaskedCase("seqlens-k-zero", seqlens_k=(0, 300)), checks.MaskedCase("window", window=(64, 16)))


def masked(cases: tuple[checks.MaskedCase, ...], suffix: str = "") -> tuple[Case, ...]:
    return tuple(Case(c.name + suffix, partial(checks.masked, c), TIMEOUT_S) for c in cases)


def timing_rows(rows: tuple[timings.Row, ...]) -> tuple[Case, ...]:
    """A case per row; the precompile runs one forward and backward of the library's rows (torch's own
    kernels need no compiling)."""
    return tuple(
        Case(
            r.name, partial(timings.measure, r), TIMEOUT_S, partial(timings.warm, r), not r.provider.startswith("sdpa")
        )
        for r in rows
    )


GROUPS = [
    Group("bf16-hd64", core(pick(BF16, (64,))), 12, covers="causal both alignments, N_q != N_k, GQA, MQA, views"),
    Group("bf16-hd128", core(pick(BF16, (128,))), 16, covers="as hd64, N = 4096, decode-shaped N_q = 1, N_k = 1"),
    Group("bf16-hd256-no-tma", core(pick(BF16, (40, 80, 96, 100, 256))), 11, covers="hd 40/80/96/256, hd100 (no TMA)"),
    Group("fp16", core(pick(FP16, (64, 128, 256))), 14, covers="hd 64/128/256, causal and not, GQA, MQA"),
    Group("fp32", core(pick(FP32, (40, 64, 80, 128))), 10, covers="tf32x3 dots, hd 40..128"),
    Group("masks", masked(MASKED), 10, covers="padding mask (a batch element without keys), window, softcap"),
    Group("score-mod", masked(SCORE_MODS), 8, covers="flex_attention with a score_mod, forward and backward"),
    Group(
        "decode",
        (
            Case("contiguous-hd128", partial(checks.decode, False), TIMEOUT_S),
            Case("paged-hd128", partial(checks.decode, True), TIMEOUT_S),
            Case("paged-hd64-page16", partial(checks.decode, True, 64, 16), TIMEOUT_S),
        ),
        8,
        covers="flash_attention_with_kvcache: lengths 0/300/1000, GQA, shuffled pages",
    ),
    Group(
        "fp8",
        (
            Case("e4m3-hd128", partial(checks.fp8, False), TIMEOUT_S),
            Case("e4m3-hd128-causal", partial(checks.fp8, True), TIMEOUT_S),
        ),
        8,
        covers="FP8 forward on sm_90 (SKIP elsewhere)",
    ),
    Group(
        "deterministic",
        tuple(
            Case(f"bitwise-twice-{n}", partial(checks.deterministic, dt), TIMEOUT_S)
            for n, dt in (("bf16", BF16), ("fp16", FP16))
        ),
        8,
        covers="deterministic=True backward bitwise equal twice",
    ),
    Group(
        "cuda-graph",
        (
            Case("training-step", checks.training_step_graph, TIMEOUT_S),
            Case("decode-step", checks.decode_step_graph, TIMEOUT_S),
        ),
        10,
        covers="capture and replay of a training step and a decode step",
    ),
    Group(
        "warp-specialised",
        core(WS_CORE, "-ws") + masked(WS_MASKED, "-ws"),
        12,
        env=WS_ENV,
        covers="the default forward with FLASHATTN_TEACH_WARP_SPECIALIZE=1",
    ),
    Group("timings", timing_rows(timings.ROWS), 45, part="timings", covers="hd128, hd64: N = 8192, causal 2048"),
    Group(
        "timings-ws", timing_rows(timings.WS_ROWS), 15, part="timings", env=WS_ENV, covers="warp-specialised forward"
    ),
]
