"""``flashattn-teach kernels --specializations``: a sample compiled for sm_90 with the installed triton (the
specialisations of the GQA decode-step backward whose one-kernel build crashed triton 3.6's ptxas), and every
specialisation the GPU tests and suite launch present in the committed table of this triton, so that the
table cannot fall behind the cases. Runs in subprocesses without ``TRITON_INTERPRET`` (the variable decides
how kernels are built for a whole process)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _triton_cases import DEVICE, DTYPES, REL_TOL, assert_close_scaled

from flashattn_teach.reference import dense_attention
from flashattn_teach.tools.kernels import specializations as spec
from flashattn_teach.tools.kernels.cases import CASES, GpuCase, suite_calls
from flashattn_teach.triton import shipped_config, triton_attention
from flashattn_teach.triton.unaligned import UNALIGNED_TILES
from sass_cache import AOT_PYTHON, aot_env

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "specializations"
CRASHED = GpuCase(torch.bfloat16, 64, 1, 300, causal=True, causal_align="bottom_right", B=2, group=4)


def _command(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = aot_env()
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    cli = [*AOT_PYTHON, "-m", "flashattn_teach.cli", "kernels", "--specializations", "--cache", str(tmp_path)]
    return subprocess.run([*cli, *args], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_the_crashed_case_is_one_of_the_gpu_cases_and_the_suite_calls() -> None:
    assert CRASHED in CASES
    assert f"tests-{CRASHED.name}" in [c.name for c in suite_calls()]


def test_the_gqa_decode_step_backward_compiles_for_sm90_without_spills_in_a_loop(tmp_path: Path) -> None:
    out = tmp_path / "sample.json"
    done = _command("--arch", "sm90", "--calls", f"tests-{CRASHED.name}", "--json", str(out), tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    kernels = sorted(r["kernel"] for r in rows)
    # N_q = 1 fills no 64-row one-kernel tile: the two backward kernels run
    assert kernels == ["backward_dkdv", "backward_dq", "backward_preprocess", "forward"], kernels
    for r in rows:
        assert r["error"] is None and not r["loop_local"], r
        assert 0 < r["smem_bytes"] <= spec.SMEM_OPT_IN["sm90"] and r["registers"] <= 255, r
        assert r["constants"].get("N_q") == "1" or r["kernel"] == "backward_preprocess", r["constants"]


def _committed() -> Path:
    import triton

    path = RESULTS / f"triton-{triton.__version__}.json"
    if not path.exists():
        pytest.skip(f"no committed table for triton {triton.__version__} in {RESULTS}")
    return path


def test_every_captured_specialisation_is_in_the_committed_table(tmp_path: Path) -> None:
    path = _committed()
    done = _command("--arch", "sm90", "sm80", "--check", str(path), tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " of " in done.stdout


def loop_problems(rows: list[dict]) -> list[tuple[str, str, object, str, str]]:
    """The rows that failed to compile or spill in their steady-state loop, named (kernel, arch, D, check, call)."""
    return [
        (r["kernel"], r["arch"], r["head_dim"], r["check"], r["calls"][0])
        for r in rows
        if r["error"] or r["loop_local"]
    ]


@pytest.mark.parametrize("version", ["3.6.0", "3.9.0"])
def test_the_committed_tables_have_no_compile_failure_and_no_spill_in_a_loop(version: str) -> None:
    path = RESULTS / f"triton-{version}.json"
    doc = json.loads(path.read_text())
    assert doc["triton"] == version and {r["arch"] for r in doc["rows"]} == {"sm90", "sm80"}
    assert loop_problems(doc["rows"]) == []
    assert all(r["smem_bytes"] <= spec.SMEM_OPT_IN[r["arch"]] for r in doc["rows"] if r["smem_bytes"] is not None)


# The calls beyond the GPU tests' own cases, each with the constant that says its kernel variant was built
WIDENED = {
    "variants-varlen": ("sm90", "forward", "VARLEN"),
    "variants-fp8": ("sm90", "forward", "FP8"),
    "variants-sinks": ("sm90", "forward", "SINKS"),
    "first-light-padding-mask": ("sm90", "backward_dq", "BOOL_MASK"),
    "first-light-window": ("sm80", "backward_dkdv", "WINDOW"),
    "first-light-seqlens-k-zero": ("sm90", "forward", "SEQLENS"),
}


@pytest.mark.parametrize("call", list(WIDENED))
def test_the_committed_36_table_holds_the_widened_calls_variant_kernels(call: str) -> None:
    assert call in [c.name for c in suite_calls()]
    arch, kernel, constant = WIDENED[call]
    rows = json.loads((RESULTS / "triton-3.6.0.json").read_text())["rows"]
    mine = [r for r in rows if call in r["calls"] and r["arch"] == arch and r["kernel"] == kernel]
    assert mine and all(r["constants"].get(constant) == "True" for r in mine), [r["constants"] for r in mine]


def test_the_fp8_row_is_refused_on_sm80_as_a_gpu_of_capability_8_refuses_it() -> None:
    doc = json.loads((RESULTS / "triton-3.6.0.json").read_text())
    assert "sm_90" in doc["refused"]["sm80"]["variants-fp8"] and "variants-fp8" not in doc["refused"]["sm90"]


def test_the_table_check_sees_a_loop_spill_and_a_compile_failure() -> None:
    # negative control: a clean row of the committed 3.6 table, then as the D = 40 dQ row read before the fix
    # (triton 3.6: 520 B, 190 local loads and stores a loop iteration) and as a ptxas crash
    clean = json.loads((RESULTS / "triton-3.6.0.json").read_text())["rows"][0]
    assert loop_problems([clean]) == []
    spilled = {**clean, "spill_bytes": 520, "loop_local": 190, "check": "spills 520 B in the loop"}
    crashed = {**clean, "error": "PTXASError: ptxas failed with error code -11", "check": "crash"}
    assert [p[3] for p in loop_problems([clean, spilled, crashed])] == ["spills 520 B in the loop", "crash"]


# Head dims whose rows the JIT cannot prove 16-element aligned take unaligned.py's thinner tiles; the
# interpreter runs those configurations (bf16 only on a GPU) against float64 attention, causal bottom-right
# with rows that see no key and a ragged last key block.
def _key(arch: str, dtype: torch.dtype, D: int) -> tuple[str, str, int]:
    return (arch, "fp32" if dtype == torch.float32 else "16-bit", 64 if D == 40 else 128)


UNALIGNED = [(a, t, d) for a in ("sm90", "sm80") for t in DTYPES for d in (40, 100) if _key(a, t, d) in UNALIGNED_TILES]


@pytest.mark.parametrize(("arch", "dtype", "D"), UNALIGNED, ids=[f"{a}-{str(t)[6:]}-d{d}" for a, t, d in UNALIGNED])
def test_the_unaligned_head_dim_tiles_match_float64_attention(arch: str, dtype: torch.dtype, D: int) -> None:
    config = shipped_config(D, dtype, arch)
    assert config != shipped_config(_key(arch, dtype, D)[2], dtype, arch), "not the padded row's tiles"
    g = torch.Generator().manual_seed(D)
    H, N_q, N_k = 2, 100, 37  # offset -63: 63 rows see no key
    q = torch.randn(1, H, N_q, D, generator=g)
    k, v = (torch.randn(1, H, N_k, D, generator=g) for _ in range(2))
    dO = torch.randn(1, H, N_q, D, generator=g)
    low = [t.to(DEVICE, dtype).requires_grad_(True) for t in (q, k, v)]
    O = triton_attention(*low, causal=True, causal_align="bottom_right", config=config)
    O.backward(dO.to(DEVICE, dtype))
    ref = [t.detach().double().cpu().requires_grad_(True) for t in low]
    ref_O = dense_attention(*ref, causal=True, causal_align="bottom_right")
    ref_O.backward(dO.double())
    assert_close_scaled(O, ref_O, REL_TOL[dtype], "O")
    for name, a, b in zip(("dq", "dk", "dv"), (t.grad for t in low), (t.grad for t in ref), strict=True):
        assert a is not None and b is not None
        assert_close_scaled(a, b, 2 * REL_TOL[dtype], name)


def test_a_ptxas_crash_is_reported_by_its_signal_not_its_repro_command() -> None:
    # triton 3.6's PTXASError for the hd64 GQA N_q = 1 one-kernel backward, as it was (error code -11: SIGSEGV)
    message = "PTXAS error: `ptxas` failed with error code -11\n`ptxas` stderr:\n\nRepro command: ptxas -v x.ptx\n"
    got = spec._last_line(RuntimeError(message))
    assert got == "RuntimeError: PTXAS error: `ptxas` failed with error code -11"


def test_a_compile_that_killed_its_process_is_recorded_on_the_rerun(tmp_path: Path) -> None:
    class Stub:
        key = "0123456789abcdef"

    path = tmp_path / spec._triton_version() / "sm90" / f"{Stub.key}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pending": True}))  # what cached_compile leaves while it compiles
    result = spec.cached_compile(Stub(), "sm90", tmp_path)  # type: ignore[arg-type]
    assert result["error"] == "the compiling process died (no exception)"
    assert json.loads(path.read_text())["pending"] is False


@pytest.mark.parametrize("D", [64, 128])
def test_the_mask_forward_tile_matches_float64_attention(D: int) -> None:
    # the sm_90 16-bit forward a call with an attn_mask gets (unaligned.MASK_FORWARD_TILES), run in the
    # interpreter on fp16 with a padding mask that leaves one batch element without keys
    config = shipped_config(D, torch.float16, "sm90", variants=True, attn_mask=True)
    forward = config.forward.unspecialised()  # a mask is never warp-specialised (tma.ws_reason)
    assert forward != shipped_config(D, torch.float16, "sm90", variants=True).forward.unspecialised()
    assert (forward.BLOCK_M, forward.BLOCK_N, forward.num_warps) == (128, 32, 8) and not forward.ws
    g = torch.Generator().manual_seed(D)
    B, H, N_q, N_k = 2, 2, 150, 77
    q = torch.randn(B, H, N_q, D, generator=g)
    k, v = (torch.randn(B, H, N_k, D, generator=g) for _ in range(2))
    mask = (torch.arange(N_k) < torch.tensor([40, 0])[:, None]).reshape(B, 1, 1, N_k)
    low = [t.to(DEVICE, torch.float16) for t in (q, k, v)]
    O = triton_attention(*low, attn_mask=mask.to(DEVICE), config=replace(config, forward=forward))
    ref = dense_attention(*(t.double().cpu() for t in low), attn_mask=mask)
    assert_close_scaled(O[0], ref[0], REL_TOL[torch.float16], "O")
    assert (O[1] == 0).all()  # no key: O = 0


# The calls the capture reaches through the decode planner, the FP8 tests, the flex route, the CUDA-graph steps
# and the first light's warp-specialised group: each with a kernel it must build and constants that say so
REACHED = {
    "decode-bench-b1-n131072-ours": ("sm90", "decode_combine", {}),
    "decode-bench-b4-n16384-ours-paged16": ("sm80", "decode_split_fwd", {"PAGED": "True", "WIDE_PAGES": "False"}),
    "decode-first-light-paged-hd64-page16": ("sm90", "decode_split_fwd", {"PAGED": "True", "HEAD_DIM": "64"}),
    "decode-tests-llama-fp16-s7-window-softcap-alibi": (
        "sm80",
        "decode_split_fwd",
        {"SOFTCAP": "True", "ALIBI": "True"},
    ),
    "decode-tests-deepseek-192-128-page256": ("sm90", "decode_split_fwd", {"BLOCK_D2": "64", "WIDE_PAGES": "True"}),
    "decode-tests-paged-llama-page7-paged-leftpad-sinks": (
        "sm90",
        "decode_split_fwd",
        {"LEFTPAD": "True", "SINKS": "True"},
    ),
    "decode-tests-cuda-graph-step": ("sm80", "decode_split_fwd", {"PAGED": "False"}),
    "tests-fp8-variants-bottom-right": ("sm90", "forward", {"FP8": "True", "WINDOW": "True"}),
    "tests-cuda-graph-training-step": ("sm80", "backward_dq", {"CAUSAL": "True"}),
    "tests-block-mask-document": ("sm80", "block_kinds_kernel", {"BLOCK_M": "64", "BLOCK_N": "32"}),
    "first-light-score-mod-head-bias": ("sm90", "backward_dkdv", {"MASK_MOD": "None"}),
    "first-light-ws-window": ("sm90", "forward", {"WS": "True", "WINDOW": "True"}),
}


@pytest.mark.parametrize("call", list(REACHED))
def test_the_committed_36_table_holds_the_reached_calls_kernels(call: str) -> None:
    assert call in [c.name for c in suite_calls()]
    arch, kernel, constants = REACHED[call]
    rows = json.loads((RESULTS / "triton-3.6.0.json").read_text())["rows"]
    mine = [r for r in rows if call in r["calls"] and r["arch"] == arch and r["kernel"] == kernel]
    assert mine, f"no {kernel} row of {call} on {arch}"
    assert any(all(r["constants"].get(n) == v for n, v in constants.items()) for r in mine), [
        r["constants"] for r in mine
    ]


def test_the_score_mod_rows_carry_the_translated_function() -> None:
    rows = json.loads((RESULTS / "triton-3.6.0.json").read_text())["rows"]
    mine = [r for r in rows if "first-light-score-mod-head-bias-hd128" in r["calls"] and r["kernel"] == "forward"]
    assert {r["arch"] for r in mine} == {"sm90", "sm80"}
    assert all("usermod" in r["constants"]["SCORE_MOD"] for r in mine), [r["constants"] for r in mine]


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_the_decode_rows_take_the_arch_tiles_not_the_interpreters(arch: str) -> None:
    # decode_config(bf16, 128, arch): 64 keys a block, 4 warps, 3 stages on sm_90 and 2 on sm_80; the
    # interpreter's TEST_DECODE_CONFIG (16 keys, one stage) would mean the capture missed the CUDA path
    from flashattn_teach.serving.launch import TEST_DECODE_CONFIG, decode_config

    want = decode_config(torch.bfloat16, 128, arch)
    assert want.BLOCK_N != TEST_DECODE_CONFIG.BLOCK_N
    rows = json.loads((RESULTS / "triton-3.6.0.json").read_text())["rows"]
    mine = [r for r in rows if r["arch"] == arch and r["kernel"] == "decode_split_fwd" and r["head_dim"] == 128]
    assert mine and all(r["BLOCK_N"] == want.BLOCK_N and r["num_stages"] == want.num_stages for r in mine)


def test_as_if_on_gpu_plans_the_decode_kernel_with_the_archs_sm_count() -> None:
    from flashattn_teach.dispatch import planner
    from flashattn_teach.serving import launch as decode_launch
    from flashattn_teach.serving.splitkv import cuda_num_splits
    from flashattn_teach.tools.kernels.capture_calls import SM_COUNT, as_if_on_gpu

    q, cache = torch.zeros(1, 32, 1, 128, dtype=torch.float16), torch.zeros(1, 8, 16, 128, dtype=torch.float16)
    assert planner.plan_decode("auto", q, cache, cache).backend != "triton"  # CPU tensors: a CPU path
    got = {}
    for arch in ("sm90", "sm80"):
        with as_if_on_gpu(arch):
            assert planner.plan_decode("auto", q, cache, cache).backend == "triton"
            got[arch] = decode_launch.default_num_splits(q, cache, 131072)
        want = cuda_num_splits(B=1, H_kv=8, N_q=1, group=4, N_k=131072, D=128, sm_count=SM_COUNT[arch])
        assert got[arch] == want
    assert got["sm90"] != got["sm80"]  # 132 SMs against 108: the split count follows the arch
    assert decode_launch.default_num_splits(q, cache, 131072) == 1  # restored: 1 on the CPU
