"""The loop profile of warp-specialised kernels (``tl.range(..., warp_specialize=True)``).

- SASS reading on a canned snippet: a producer region and a consumer region, each opened by a
  ``USETMAXREG``, their loops, registers, named barriers, and the mbarrier retry stub (a jump back from
  after an ``EXIT``) that is no loop; the model's cycles worked out by hand; its estimate labelled
  uncalibrated in every line that prints it (the plain reading of the same SASS as the control).
- A small warp-specialised forward defined here, compiled for sm_90 ahead of time (in a subprocess without
  TRITON_INTERPRET, about 10 s): its partitions are found, they cover the tile's matmuls exactly once, and
  the estimate lies between the no-overlap formula and the perfect-overlap ceiling. The same kernel
  without ``warp_specialize`` is reported as not specialised (negative control).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import triton
from triton import language as tl

from flashattn_teach.tools.kernels import loops, report, sass
from sass_cache import AOT_PYTHON, aot_env

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
HERE = Path(__file__).resolve().parent
BLOCK_M, BLOCK_N, D = 128, 64, 64


@triton.jit
def _ws_fwd(
    Q,
    K,
    V,
    O,
    N,
    qk_scale,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPECIALIZE: tl.constexpr,
):
    """A test-only forward over contiguous ``(N, D)`` rows of one head (N % BLOCK_N == 0, qk_scale > 0),
    reading through tensor descriptors made in the kernel; ``SPECIALIZE`` asks for warp specialisation."""
    i = tl.program_id(0)
    q_desc = tl.make_tensor_descriptor(Q, shape=[N, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    k_desc = tl.make_tensor_descriptor(K, shape=[N, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    v_desc = tl.make_tensor_descriptor(V, shape=[N, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    o_desc = tl.make_tensor_descriptor(O, shape=[N, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    q = q_desc.load([i * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for j in tl.range(0, N // BLOCK_N, warp_specialize=SPECIALIZE):
        k = k_desc.load([j * BLOCK_N, 0])
        # S_ij: (BLOCK_M, D) @ (D, BLOCK_N) -> (BLOCK_M, BLOCK_N)
        s = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([j * BLOCK_N, 0])
        # (BLOCK_M, BLOCK_N) @ (BLOCK_N, D) -> (BLOCK_M, D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    o_desc.store([i * BLOCK_M, 0], (acc / l_i[:, None]).to(O.dtype.element_ty))


def probe() -> dict:
    """Run in a subprocess without TRITON_INTERPRET: the profiles of the kernel with and without WS."""
    import torch

    from flashattn_teach.tools.kernels import specialize

    x = torch.empty(1024, D, dtype=torch.bfloat16)
    out: dict = {"triton": triton.__version__}
    for name, flag in (("specialized", True), ("plain", False)):
        request = specialize.request_for_call(
            _ws_fwd, x, x, x, x, 1024, 0.18, D, BLOCK_M, BLOCK_N, flag, num_warps=4, num_stages=2
        )
        compiled = request.compile()
        text, _ = sass.disassemble(compiled.asm["cubin"])
        p = loops.profile_sass(text, request.options.num_warps, "sm90", kernel=name)
        assert p is not None
        out[name] = {
            "launched_warps": compiled.metadata.num_warps,
            "warp_specialized": sass.warp_specialized(sass.parse(text)),
            "specialized": p.specialized,
            "mma_fmas": p.mma_fmas,
            "cycles": p.cycles,
            "serial_cycles": p.serial_cycles,
            "roofline_cycles": max(p.tensor_cycles, p.issue_cycles, p.mufu_cycles),
            "partitions": [
                {"role": q.role, "warps": q.warps, "registers": q.registers, "barriers": list(q.barriers)}
                | {"cta_barriers": q.cta_barriers, "counts": q.counts, "mma_fmas": q.mma_fmas}
                for q in p.partitions
            ],
            "lines": p.partition_lines(),
        }
    return out


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = aot_env()
    code = f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import test_triton_loops_ws as t; "
    code += "print(json.dumps(t.probe()))"
    run = subprocess.run([*AOT_PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


CANNED_WS = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/               @P0 BRA 0x100 ;
        /*0020*/                   USETMAXREG.DEALLOC.CTAPOOL 0x28 ;
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4+0x10], R2 ;
        /*0040*/              @!P1 BRA 0x300 ;
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0, 0x80 ;
        /*0060*/              @UP0 UTMALDG.2D [UR8], [UR10] ;
        /*0070*/               @P2 BRA 0x30 ;
        /*0080*/                   EXIT ;
        /*0100*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8 ;
        /*0110*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4+0x20], R2 ;
        /*0120*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT, gsb0 ;
        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0140*/                   MUFU.EX2 R5, R5 ;
        /*0150*/                   BAR.SYNC.DEFER_BLOCKING 0x2, 0x80 ;
        /*0160*/                   SYNCS.ARRIVE.TRANS64.ART0 RZ, [UR4+0x30], R6 ;
        /*0170*/               @P0 BRA 0x110 ;
        /*0180*/                   EXIT ;
        /*0300*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4+0x10], R2 ;
        /*0310*/              @!P1 BRA 0x300 ;
        /*0320*/                   BRA 0x50 ;
        /*0330*/                   BRA 0x330 ;
"""


def test_partitions_of_a_canned_warp_specialised_kernel() -> None:
    instructions = sass.parse(CANNED_WS)
    assert sass.warp_specialized(instructions)
    # the retry stub's jump back to 0x50 spans an EXIT: no loop; its spin on itself is one
    assert [(lp.start, lp.end) for lp in sass.loops(instructions)] == [(0x30, 0x70), (0x110, 0x170), (0x300, 0x310)]
    producer, consumer = sass.partitions(instructions)
    assert (producer.role, producer.registers, producer.warps, producer.barriers) == ("producer", 40, 4, (0,))
    assert (consumer.role, consumer.registers, consumer.warps, consumer.barriers) == ("consumer", 232, 4, (2,))
    assert len(producer.loop.body) == 5 and len(consumer.loop.body) == 7
    assert producer.cta_barriers == consumer.cta_barriers == 0
    assert sass.count_kinds(consumer.loop.body)["bar_named"] == 1


def test_model_of_a_canned_warp_specialised_kernel() -> None:
    p = loops.profile_sass(CANNED_WS, num_warps=4)
    assert p is not None and p.specialized and p.num_warps == 8
    # 64x64x16: 32 math cycles, (64*16 + 64*16) * 2 B / 128 = 32 operand cycles
    assert p.tensor_cycles == 32
    assert p.issue_cycles == 4 * 7 / 4 + 4 * 5 / 4
    assert p.mufu_cycles == 4 * 32 * 1 / 16
    # the consumer's chain: its matmul, then max(7 issue cycles, 8 MUFU cycles)
    assert p.cycles == 32 + 8
    assert p.serial_cycles == 32 + 12
    # without the register resizes it reads as one role: the serial model, the shortest matmul loop
    plain = loops.profile_sass(CANNED_WS.replace("USETMAXREG", "NOP"), num_warps=4)
    assert plain is not None and not plain.specialized and plain.partition_lines() == []
    assert plain.cycles == plain.serial_cycles == 32 + max(4 * 7 / 4, 4 * 32 / 16)


def test_warp_specialised_estimates_say_uncalibrated_wherever_printed() -> None:
    ws = loops.profile_sass(CANNED_WS, num_warps=4)
    plain = loops.profile_sass(CANNED_WS.replace("USETMAXREG", "NOP"), num_warps=4)
    assert ws is not None and plain is not None
    assert not ws.calibrated and ws.basis.startswith("uncalibrated") and "borrowed" in ws.basis
    assert plain.calibrated and ws.basis != plain.basis and "uncalibrated" not in plain.basis  # control
    assert "uncalibrated" in ws.partition_lines()[-1] and "uncalibrated" in ws.summary()
    assert "uncalibrated" not in plain.summary()
    # the no-overlap figure stands beside it: the consumers' work serialised
    assert ws.serial_tflops() < ws.estimate_tflops()
    # the kernels command's per-pass lines, one forward specialised and one not
    tile = SimpleNamespace(BLOCK_M=128, BLOCK_N=64)
    lines = {
        d: report.pass_estimates([(SimpleNamespace(kernel="forward", dtype="bf16", head_dim=d, config=tile), p)])[0]
        for d, p in ((64, ws), (128, plain))
    }
    assert "TFLOP/s estimated, uncalibrated" in lines[64] and "no overlap of its consumers" in lines[64]
    assert "TFLOP/s estimated, calibrated on the H200" in lines[128] and "uncalibrated" not in lines[128]
    row = report._loop_row(
        SimpleNamespace(kernel="forward", dtype="bf16", head_dim=64, config="128x64", registers=232, smem_bytes=0), ws
    )
    assert row.endswith("(TF/s uncalibrated: warp-specialised)")


def test_warp_specialised_kernel_is_read_by_partition(compiled) -> None:
    ws = compiled["specialized"]
    assert ws["warp_specialized"] and ws["specialized"]
    assert ws["launched_warps"] > 4  # the producer's warps come on top of the 4 asked for
    roles = sorted(q["role"] for q in ws["partitions"])
    assert roles == ["consumer", "consumer", "producer"], ws["partitions"]
    assert sum(q["warps"] for q in ws["partitions"]) == ws["launched_warps"]
    for q in ws["partitions"]:
        assert q["registers"] is not None and q["barriers"] and q["cta_barriers"] == 0
        if q["role"] == "producer":
            assert q["counts"]["tma"] > 0 and q["counts"]["mma"] == 0
        else:
            assert q["counts"]["mma"] > 0 and q["counts"]["mufu_ex2"] > 0
    consumers = [q for q in ws["partitions"] if q["role"] == "consumer"]
    assert consumers[0]["barriers"] != consumers[1]["barriers"]  # each synchronises its own warpgroup
    # the consumers split the rows: S_ij and P_ij V_j of the whole tile, once
    assert ws["mma_fmas"] == 2 * BLOCK_M * BLOCK_N * D
    assert ws["roofline_cycles"] <= ws["cycles"] < ws["serial_cycles"]
    assert any(line.strip().startswith("warp-specialised") for line in ws["lines"])


def test_plain_kernel_is_not_specialised(compiled) -> None:
    plain = compiled["plain"]
    assert not plain["warp_specialized"] and not plain["specialized"] and plain["partitions"] == []
    assert plain["launched_warps"] == 4 and plain["lines"] == []
    assert plain["cycles"] == plain["serial_cycles"]
    assert plain["mma_fmas"] == 2 * BLOCK_M * BLOCK_N * D
