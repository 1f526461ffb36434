"""Every shipped kernel configuration compiles for sm_90 and sm_80 within the hardware's limits, also with
the variants of the mask contract (in bf16, which shares its rows with fp16, and in fp32): window,
softcap, ALiBi and seqlens_k at once, without and with dropout, a causal call with a bool or additive
padding mask (also with dropout), and packed sequences without and with dropout.

Compiled ahead of time (no GPU needed) in subprocesses without ``TRITON_INTERPRET``, which this test
process has set. The shipped kernels' report of each architecture and the 16 variant runs are 18
``flashattn-teach kernels`` commands shared by four subprocesses that start with the module, each taking
the next command not yet taken, the longest first (tests/cli_in_turn.py's ``run_shared``). The checks live in
``flashattn_teach.tools.kernels``: no spilled bytes, at most 255 registers, shared memory within 228 KB
(sm_90) or 164 KB (sm_80), and HGMMA for the forward and backward matmuls on sm_90 in fp16 and bf16.
Each kernel is the specialisation the JIT builds for a sample launcher call (``GROUP = 1`` and unit
strides as constants, sizes divisible by 16); tests/triton/test_triton_loops.py checks that it is.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cli_in_turn import run_shared
from flashattn_teach.tools.kernels.report import shipped_kernels
from flashattn_teach.triton.configs import ARCHS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize("arch", ARCHS)
def test_every_shipped_kernel_compiles_without_spills_within_limits(arch: str, compiles) -> None:
    out, err, code = compiles[(arch, "shipped")]
    assert code == 0, f"{out}\n{err[-3000:]}"
    rows = [line.split() for line in out.splitlines()[2:]]
    assert len(rows) == len(shipped_kernels(arch))
    assert all(row[-1] == "ok" for row in rows), out
    if arch == "sm90":
        for kernel in ("forward", "backward_dkdv", "backward_dq"):
            for dtype in ("float16", "bfloat16"):
                mma = {row[10] for row in rows if row[0] == kernel and row[1] == dtype}
                assert mma == {"HGMMA"}, out
            heads = {int(row[2]) for row in rows if row[0] == kernel and row[1] == "float16"}
            assert {64, 128} <= heads
        # the one-kernel backward ships at hd64 at least, on the warpgroup MMA too
        assert {row[10] for row in rows if row[0] == "backward_fused" and row[1] != "float32"} == {"HGMMA"}, out
        assert 64 in {int(row[2]) for row in rows if row[0] == "backward_fused" and row[1] == "bfloat16"}, out


# What each variant run adds to ``flashattn-teach kernels`` (at every head dim, bf16 and fp32)
VARIANT_RUNS = {
    "window_softcap_alibi_seqlens": ["--variants"],
    "and_dropout": ["--variants", "--dropout"],
    "causal_bool_mask": ["--mask", "bool"],
    "causal_additive_mask": ["--mask", "additive"],
    "packed_sequences": ["--varlen"],
    "packed_with_dropout": ["--varlen", "--dropout"],
    "bool_mask_with_dropout": ["--mask", "bool", "--dropout"],
    "additive_mask_with_dropout": ["--mask", "additive", "--dropout"],
}


@pytest.fixture(scope="module")
def compiles() -> dict[tuple[str, str], tuple[str, str, int | None]]:
    """``{(arch, "shipped" or a variant run): (table, stderr, exit status)}``, all compiled at once."""
    variant = ["kernels", "--dtype", "bfloat16", "float32"]
    commands = {(arch, "shipped"): ["kernels", "--arch", arch] for arch in ARCHS}
    commands |= {(arch, run): [*variant, "--arch", arch, *VARIANT_RUNS[run]] for arch in ARCHS for run in VARIANT_RUNS}

    def longest_first(key: tuple[str, str]) -> tuple[bool, bool, bool]:
        # the shipped reports compile all three dtypes (the most rows); sm_90's variant runs compile more rows
        # (TMA and warp-specialised ones) and larger kernels than sm_80's; packed sequences run the pointer
        # rows only
        arch, run = key
        return run != "shipped", arch != "sm90", run.startswith("packed")

    # four processes, each taking the next command no other has taken: they end within about one command of
    # each other (two fixed shares an architecture left sm_80's processes done long before sm_90's)
    return run_shared({key: commands[key] for key in sorted(commands, key=longest_first)}, processes=4)


# (arch, run, kernel, dtype, padded head dim) that spill with triton 3.6 or 3.9 although no tile tried
# avoids it (see configs._VARIANT_ROWS and _DROPOUT_ROWS); any other row must pass, and these may fail by
# spilling only
KNOWN_SPILLS = {
    *(
        ("sm90", run, "backward_dkdv", "bfloat16", 256)
        for run in (
            "and_dropout",
            "causal_additive_mask",
            "packed_with_dropout",
            "bool_mask_with_dropout",
            "additive_mask_with_dropout",
        )
    ),
    ("sm90", "packed_with_dropout", "backward_dq", "float32", 128),
}


@pytest.mark.parametrize("run", list(VARIANT_RUNS))
@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_with_variants_compile_without_spills(arch: str, run: str, compiles) -> None:
    out, err, code = compiles[(arch, run)]
    rows = [line.split() for line in out.splitlines()[2:]]
    failed = [row for row in rows if row[-1] != "ok"]
    for row in failed:
        assert (arch, run, row[0], row[1], int(row[2])) in KNOWN_SPILLS, out
        assert " ".join(row[11:]).endswith("bytes spilled to local memory"), out
    assert code == (1 if failed else 0), f"{out}\n{err[-3000:]}"
    rows = [row for row in rows if row not in failed]
    # forward, preprocess, dK/dV, dQ for bf16 at head dims 16 to 256 and fp32 to 128, and each TMA row
    # through pointers (packed sequences: only those)
    dropout = "dropout" in run
    expected = shipped_kernels(arch, (torch.bfloat16, torch.float32), variants=True, dropout=dropout)
    if run.startswith("packed"):  # packed sequences run the pointer rows only
        expected = [kernel for kernel in expected if not kernel[3].tma]
    assert len(expected) > 36 if arch == "sm90" and not run.startswith("packed") else len(expected) == 36
    assert len(rows) + len(failed) == len(expected), out
    if arch == "sm90":
        bf16 = {row[10] for row in rows if row[0] != "backward_preprocess" and row[1] == "bfloat16"}
        assert bf16 == {"HGMMA"}, out
