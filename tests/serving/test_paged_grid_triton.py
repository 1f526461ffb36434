"""The grid of ``paged_cases.py`` (flash-attn's KV-cache test grid with paged caches) on the Triton decode
kernel in the interpreter, float32, against the same float64 oracle and the same expected pools as the CPU
backends: page sizes 1, 3, 7, 16 and 256, shuffled tables with garbage past each sequence's pages, GQA and
MQA, splits 0/1/3, new keys, chunked prefill, causal, window, ALiBi, softcap, ``cache_leftpad``, sinks, and
flash-attn's pool layout as a transposed view."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from paged_cases import CASES, run_case


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_paged_decode_on_the_triton_kernel_matches_the_oracle(case):
    # float32 on the kernel: tf32x3 dots and fp32 accumulators, well inside 2e-5 of the float64 oracle
    run_case(case, "triton", dtype=torch.float32, atol=2e-5)
