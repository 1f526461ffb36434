"""The decode steps the GPU tests and the GPU suite make, as data (the decode half of :mod:`.cases`), so that
``flashattn-teach kernels --specializations`` captures the split-KV decode kernels' specialisations too:

    BENCH_DECODE        bench_decode.py's grid: bf16, H_q = 32, H_kv = 8, D = 128, B in {1, 4, 16, 64}, full
                        caches of N in {1k, 4k, 16k, 64k, 128k}; providers ours, ours-1split, ours-paged16/256
    FIRST_LIGHT_DECODE  first_light_checks.decode: contiguous hd128, paged hd128 (pages of 64), paged hd64 (16)
    TEST_DECODE         the GPU tests: test_triton_decode.py's Llama shapes (fp16/bf16, splits 0, 1, 7, plain
                        and window + softcap + ALiBi), test_triton_decode_split_lanes.py's DeepSeek 192/128
                        (contiguous, pages of 16 and 256), test_triton_paged.py's Llama on pages of 16, 256, 7
                        (with leftpad and sinks), test_triton_cuda_graph.py's decode step

A step's specialisation depends on its integers (the split count among them, which on a GPU comes from the SM
count: :mod:`.capture_calls` answers it for the arch being compiled for), so every row is kept even where
two look alike. Large caches are ``torch.empty`` (address space only: nothing reads them in a capture).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BF16, FP16 = torch.bfloat16, torch.float16


@dataclass(frozen=True)
class DecodeCall:
    """One ``flash_attention_with_kvcache`` call: ``B`` steps of ``N_new`` queries against caches of capacity
    ``N_max`` holding ``lengths`` entries; ``new_kv``: ``N_new`` new keys and values appended first;
    ``page_size``: a paged pool, ``(num_blocks, H_kv, page, D)`` (``layout="head-major"``) or flash-attn's
    ``(num_blocks, page, H_kv, D)`` passed transposed (``"flash-attn"``); ``lengths_plus``: ``cache_seqlens``
    as the lengths plus this (the paged test's extras call)."""

    name: str
    dtype: torch.dtype
    B: int
    H_q: int
    H_kv: int
    N_max: int
    D: int
    lengths: tuple[int, ...]
    D_v: int | None = None
    N_new: int = 1
    new_kv: bool = True
    page_size: int | None = None
    layout: str = "head-major"
    num_splits: int = 0
    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float | None = None
    alibi: bool = False
    leftpad: tuple[int, ...] | None = None
    sinks: bool = False
    backend: str = "auto"

    @property
    def head_dim_v(self) -> int:
        return self.D if self.D_v is None else self.D_v


def _bench_decode() -> list[DecodeCall]:
    out = []
    for n in (1024, 4096, 16384, 65536, 131072):
        for b in (1, 4, 16, 64):
            base = DecodeCall(f"decode-bench-b{b}-n{n}", BF16, b, 32, 8, n, 128, (n,) * b, new_kv=False)
            out += [
                _renamed(base, "ours"),
                _renamed(base, "ours-1split", num_splits=1),
                _renamed(base, "ours-paged16", page_size=16),
                _renamed(base, "ours-paged256", page_size=256),
            ]
    return out


def _renamed(c: DecodeCall, suffix: str, **changes: object) -> DecodeCall:
    from dataclasses import replace

    return replace(c, name=f"{c.name}-{suffix}", **changes)  # type: ignore[arg-type]


BENCH_DECODE = _bench_decode()

_FL = (3, 8, 2, 1024)  # first_light_checks.decode: B, H_q, H_kv, N_max; lengths 0, 300, 1000; causal
FIRST_LIGHT_DECODE = [
    DecodeCall("decode-first-light-contiguous-hd128", BF16, *_FL, 128, (0, 300, 1000), causal=True, backend="triton"),
    DecodeCall(
        "decode-first-light-paged-hd128", BF16, *_FL, 128, (0, 300, 1000), page_size=64, causal=True, backend="triton"
    ),
    DecodeCall(
        "decode-first-light-paged-hd64-page16",
        BF16,
        *_FL,
        64,
        (0, 300, 1000),
        page_size=16,
        causal=True,
        backend="triton",
    ),
]

_LLAMA = (1000, 4097, 0, 8191)


def _test_decode() -> list[DecodeCall]:
    out = []
    for dt, dn in ((FP16, "fp16"), (BF16, "bf16")):
        for splits in (0, 1, 7):
            c = DecodeCall(f"decode-tests-llama-{dn}-s{splits}", dt, 4, 32, 8, 8192, 128, _LLAMA, num_splits=splits)
            out += [c, _renamed(c, "window-softcap-alibi", window=(2048, 0), softcap=30.0, alibi=True)]
    deepseek = DecodeCall("decode-tests-deepseek-192-128", BF16, 4, 16, 4, 8192, 192, _LLAMA, D_v=128)
    out += [deepseek] + [_renamed(deepseek, f"page{p}", page_size=p, layout="flash-attn") for p in (16, 256)]
    for p in (16, 256, 7):
        n = math.ceil(8192 / p) * p
        c = DecodeCall(f"decode-tests-paged-llama-page{p}", BF16, 4, 32, 8, n, 128, _LLAMA, num_splits=3)
        paged = _renamed(c, "paged", page_size=p, layout="flash-attn")
        extras = dict(new_kv=False, num_splits=0, leftpad=(0, 4000, 0, 100), sinks=True)
        out += [c, paged, _renamed(paged, "leftpad-sinks", lengths=tuple(x + 1 for x in _LLAMA), **extras)]
    out.append(DecodeCall("decode-tests-cuda-graph-step", BF16, 3, 8, 2, 1024, 128, (17, 500, 1000), causal=True))
    return out


TEST_DECODE = _test_decode()


def decode_calls() -> list[DecodeCall]:
    """Every decode step of the GPU tests and the suite, named ``decode-...``."""
    return TEST_DECODE + FIRST_LIGHT_DECODE + BENCH_DECODE
