"""Real-GPU checks of the Triton kernels with the shipped configurations; skipped without CUDA.

The cases and the checks live in ``gpu_cases.py`` (no pytest there), so that ``benchmarks/gpu_checks.py`` runs
the same ones on a machine without pytest. Accuracy follows flash-attn's rule: the kernel's error against a
float64 reference may be at most twice the error of plain PyTorch computing in the same low precision, plus
a small floor; fp32 is held to a tolerance suited to its tf32x3 dots. Nothing here touches CUDA at import.
"""

from __future__ import annotations

import gpu_cases
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("case", gpu_cases.CASES, ids=[c.name for c in gpu_cases.CASES])
def test_shipped_kernels_match_float64_attention(case: gpu_cases.GpuCase) -> None:
    gpu_cases.check_case(case)


@pytest.mark.parametrize("dtype", gpu_cases.DETERMINISM_DTYPES, ids=gpu_cases.DTYPE_NAMES.get)
def test_backward_is_bitwise_deterministic_on_gpu(dtype: torch.dtype) -> None:
    gpu_cases.check_backward_is_bitwise_deterministic(dtype)


@pytest.mark.parametrize("dtype", gpu_cases.DETERMINISM_DTYPES, ids=gpu_cases.DTYPE_NAMES.get)
def test_default_backward_matches_the_deterministic_one_on_gpu(dtype: torch.dtype) -> None:
    gpu_cases.check_default_backward_matches_deterministic(dtype)


def test_peak_memory_grows_linearly_in_sequence_length() -> None:
    gpu_cases.check_peak_memory_grows_linearly()
