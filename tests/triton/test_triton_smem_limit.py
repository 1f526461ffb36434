"""The compile check's shared-memory limit is what one block may use, not what an SM holds: the CUDA C++
Programming Guide's table of compute capabilities gives 227 KB per block on 9.0 and 163 KB on 8.0 (an SM
holds 228 and 164 KB; the system keeps 1 KB per resident block)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize(("arch", "per_block"), [("sm90", 227 * 1024), ("sm80", 163 * 1024)])
def test_a_kernel_over_the_per_block_limit_fails_the_check(arch, per_block) -> None:
    from flashattn_teach.tools.kernels.compile import CompileReport
    from flashattn_teach.triton.configs import KernelConfig

    def report(smem: int) -> CompileReport:
        return CompileReport(
            kernel="backward_preprocess",  # no matmul: only the limits count
            arch=arch,
            dtype=torch.bfloat16,
            head_dim=128,
            config=KernelConfig(32, 0, 4, 1),
            registers=64,
            spill_bytes=0,
            smem_bytes=smem,
            mma="none",
            seconds=0.0,
            launched_warps=4,
            request=None,  # type: ignore[arg-type]  # not read by problems()
            ptx="",
            sass="",
        )

    assert report(per_block).problems() == []
    assert report(per_block + 1).problems() == [f"{per_block + 1} bytes of shared memory > {per_block}"]
    assert report(per_block + 1024).problems()  # an SM's whole capacity does not fit one block
