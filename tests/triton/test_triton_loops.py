"""The loop profile (``flashattn-teach kernels --loops``) and the JIT specialisation it compiles.

- SASS reading on a canned snippet: loops, the hot loop, counts by kind, the model's cycles; HMMA counted
  once per warp and HGMMA once per warpgroup, atomics counted apart and priced (a one-kernel backward's
  loop in miniature).
- The specialisation: what :mod:`flashattn_teach.tools.kernels.specialize` records equals what triton's own
  ``jit_cache_hook`` is handed for the same launcher call, with GROUP = 1 (a constant) and GROUP = 4
  (an argument), and divisibility attributes only where a size is divisible by 16 (negative control).
- A deliberately worse variant of a forward loop (scale applied to every score before the row max,
  load masks in a loop that needs none) shows more instructions per iteration than the clean one.
- ``--loops --dump`` prints the table and writes PTX and SASS named by kernel, dtype, head dim and tile.

Compiling needs TRITON_INTERPRET unset, which this process has set: the compiling parts run in two
subprocesses started together (one probe script, one CLI run), about a minute on two cores.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch
import triton
from triton import language as tl

from flashattn_teach.cli import main
from flashattn_teach.tools.kernels import loops, sass
from flashattn_teach.triton.configs import shipped_config
from sass_cache import AOT_PYTHON, aot_env

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
HERE = Path(__file__).resolve().parent


@triton.jit
def _variant_fwd(
    Q,
    K,
    V,
    O,
    stride_n,
    N_k,
    qk_scale,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_FIRST: tl.constexpr,
    MASK_LOADS: tl.constexpr,
):
    """A test-only forward loop over key blocks (contiguous (N, D) inputs, qk_scale > 0, N_k % BLOCK_N == 0).
    ``SCALE_FIRST`` multiplies every score by the scale before the row max instead of folding it into the
    exponent's FFMA; ``MASK_LOADS`` computes load masks although every block is full."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + offs_m[:, None] * stride_n + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start in tl.range(0, N_k, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kT_ptrs = K + offs_n[None, :] * stride_n + offs_d[:, None]
        v_ptrs = V + offs_n[:, None] * stride_n + offs_d[None, :]
        if MASK_LOADS:
            in_k = offs_n < N_k
            kT = tl.load(kT_ptrs, mask=in_k[None, :] & (offs_d[:, None] < D), other=0.0)
            v = tl.load(v_ptrs, mask=in_k[:, None] & (offs_d[None, :] < D), other=0.0)
        else:
            kT = tl.load(kT_ptrs)
            v = tl.load(v_ptrs)
        # S_ij: (BLOCK_M, D) @ (D, BLOCK_N) -> (BLOCK_M, BLOCK_N)
        s = tl.dot(q, kT)
        if SCALE_FIRST:
            s = s * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            # max(qk_scale * s) = qk_scale * max(s) for qk_scale > 0; exp2(qk_scale * s - m) is one FFMA
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        # (BLOCK_M, BLOCK_N) @ (BLOCK_N, D) -> (BLOCK_M, D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    tl.store(O + offs_m[:, None] * stride_n + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty))


def probe() -> dict:
    """Run in a subprocess without TRITON_INTERPRET: the JIT specialisations and the variants' profiles."""
    from triton import knobs

    from flashattn_teach._validate.inputs import AttentionShapes
    from flashattn_teach.tools.kernels import specialize
    from flashattn_teach.triton import launch
    from flashattn_teach.triton.configs import shipped_config

    def by_hook(run) -> list[dict]:
        """What triton's own jit_cache_hook is handed (and told to skip compiling) for ``run()``."""
        seen = []

        def hook(*, compile, **_):
            seen.append(compile)
            return True

        saved_driver, saved_hook = triton.runtime.driver._active, knobs.runtime.jit_cache_hook
        triton.runtime.driver.set_active(
            specialize._CompileOnlyDriver(triton.backends.compiler.GPUTarget("cuda", 90, 32))
        )
        knobs.runtime.jit_cache_hook = hook
        try:
            run()
        finally:
            knobs.runtime.jit_cache_hook = saved_hook
            triton.runtime.driver._active = saved_driver
        return seen

    out: dict = {"triton": triton.__version__, "specialisations": {}}
    cfg = shipped_config(128, torch.bfloat16, "sm90")
    for group, N in ((1, 8192), (4, 8192), (1, 8190)):
        s = AttentionShapes((2,), 16, 16 // group, N, N, 128, 128, 4, 128**-0.5)
        q = torch.empty(2, 16, N, 128, dtype=torch.bfloat16)
        k = torch.empty(2, 16 // group, N, 128, dtype=torch.bfloat16)
        o, do = torch.empty_like(q), torch.empty_like(q)
        lse = torch.empty(2, 16, N)

        def run(q=q, k=k, o=o, do=do, lse=lse, s=s):
            launch.forward(q, k, k, s, causal=False, causal_align="top_left", config=cfg)
            for deterministic in (True, False):  # the two-kernel backward, then the one-kernel one
                launch.backward(
                    q, k, k, o, lse, do, None, s, causal=False, causal_align="top_left", config=cfg,
                    deterministic=deterministic,
                )  # fmt: skip

        ours = specialize.requests_for(run, "sm90")
        theirs = by_hook(run)
        out["specialisations"][f"group={group} N={N}"] = [
            {
                "name": r.name,
                "same_as_jit": r.signature == h["signature"]
                and r.constexprs == h["constants"]
                and r.attrs == h["configs"][0]
                and r.options.num_warps == h["num_warps"]
                and r.options.num_stages == h["num_stages"],
                "signature": r.flat_signature(),  # a record's fields as stride.Q.stride_d
                "constants": {k: str(v) for k, v in r.constants().items()},
                "divisible_by_16": r.divisible_by_16(),
            }
            for r, h in zip(ours, theirs, strict=True)
        ]
    x = torch.empty(1024, 64, dtype=torch.bfloat16)
    for name, flags in (("clean", (False, False)), ("worse", (True, True))):
        request = specialize.request_for_call(
            _variant_fwd, x, x, x, x, 64, 1024, 0.18, 64, 128, 64, *flags, num_warps=4, num_stages=2
        )
        p = loops.loop_profile(request)
        assert p is not None
        out[name] = {"instructions": p.instructions, "counts": p.counts, "mma": p.mma}
    return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[dict, subprocess.CompletedProcess, Path]:
    env = aot_env()
    dump = tmp_path_factory.mktemp("dump")
    code = f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import test_triton_loops as t; "
    code += "print(json.dumps(t.probe()))"
    probe_run = subprocess.Popen(
        [*AOT_PYTHON, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    cli = [*AOT_PYTHON, "-m", "flashattn_teach.cli", "kernels", "--arch", "sm90", "--kernel", "forward"]
    cli += ["--dtype", "bfloat16", "--head-dim", "16", "--loops", "--dump", str(dump)]
    cli_run = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=600)
    out, err = probe_run.communicate(timeout=600)
    assert probe_run.returncode == 0, err[-3000:]
    return json.loads(out.splitlines()[-1]), cli_run, dump


CANNED = """
        Function : toy
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R2, 0x1, PT ;
        /*0020*/                   IMAD.MOV.U32 R3, RZ, RZ, RZ ;
        /*0030*/                   LDGSTS.E.BYPASS.128 [R4], desc[UR4][R6.64] ;
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT ;
        /*0050*/                   HGMMA.64x64x16.F32.BF16 R88, R152, gdesc[UR16].tnspB, R88, gsb0 ;
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0070*/                   FFMA R5, R24, R0, -R6 ;
        /*0080*/                   MUFU.EX2 R5, R5 ;
        /*0090*/                   FMUL R7, R5, R8 ;
        /*00a0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00b0*/                   IADD3 R2, R2, 0x1, RZ ;
        /*00c0*/               @P0 BRA 0x30 ;
        /*00d0*/                   LDL R9, [R1] ;
        /*00e0*/                   FADD R9, R9, 1 ;
        /*00f0*/               @P1 BRA 0xd0 ;
        /*0100*/                   EXIT ;
        /*0110*/                   BRA 0x110;
"""


def test_sass_reader_finds_the_loop_with_the_matmuls_and_counts_it_by_kind() -> None:
    instructions = sass.parse(CANNED)
    assert len(instructions) == 18 and instructions[12].predicate == "@P0"
    assert [(lp.start, lp.end) for lp in sass.loops(instructions)] == [(0x30, 0xC0), (0xD0, 0xF0)]
    (hot,) = sass.hot_loops(instructions)  # the second loop holds no matmul; the final BRA is no loop
    counts = sass.count_kinds(hot.body)
    assert len(hot.body) == 10
    assert counts["mma"] == 2 and counts["mufu_ex2"] == 1 and counts["ffma"] == counts["fmul"] == 1
    assert counts["ldgsts"] == 1 and counts["bar"] == 1 and counts["wgmma_wait"] == 1 and counts["int"] == 1
    assert counts["control"] == 1 and counts["local"] == 0
    assert sass.mma_shapes(hot.body) == {"HGMMA.64x128x16": 1, "HGMMA.64x64x16": 1}


def test_model_charges_issue_slots_exponentials_and_tensor_cores_per_program() -> None:
    p = loops.profile_sass(CANNED, num_warps=8, arch="sm90")
    assert p is not None
    assert p.instructions == 10 and p.loop_sizes == (10,)
    assert p.issue_cycles == 8 * 10 / 4
    assert p.mufu_cycles == 8 * 32 / 16
    # two warpgroups; 64x128x16 reads A and B from shared memory (6 KB / 128 B < 64 math cycles),
    # 64x64x16 reads B only (2 KB / 128 B = 16 < 32 math cycles)
    assert p.tensor_cycles == 2 * (64 + 32)
    assert p.mma_fmas == 2 * (64 * 128 * 16 + 64 * 64 * 16)
    assert p.cycles == p.tensor_cycles + max(p.issue_cycles, p.mufu_cycles)
    # fp16 inputs carry no type suffix
    thin = "/*0000*/ HGMMA.64x16x16.F32 R1, gdesc[UR4], R1 ;\n/*0010*/ @P0 BRA 0x0 ;"
    thin_profile = loops.profile_sass(thin, num_warps=4)
    assert thin_profile is not None and thin_profile.tensor_cycles == (64 * 16 + 16 * 16) * 2 / 128  # not 8


# the one-kernel backward's loop in miniature (hd128 32 x 128 tile, 8 warps, as triton builds it for sm_90):
# warpgroup MMAs for the products with M = 64, an HMMA per warp for the dQ partial (M = 32 < 64, too small for
# a warpgroup MMA), and the float32 reduction of that partial into dQ
FUSED = """
        /*0000*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT ;
        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0030*/                   HMMA.16816.F32.BF16 R40, R4, R8, R40 ;
        /*0040*/                   HMMA.16816.F32.BF16 R44, R4, R10, R44 ;
        /*0050*/                   REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU desc[UR50][R164.64], R152 ;
        /*0060*/                   RED.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR50][R20.64], R16 ;
        /*0070*/               @P0 BRA 0x0 ;
"""


def test_hmma_runs_once_per_warp_and_hgmma_once_per_warpgroup() -> None:
    p = loops.profile_sass(FUSED, num_warps=8, arch="sm90")
    assert p is not None
    hgmma, hmma = 64 * 128 * 16, 16 * 8 * 16
    # 2 warpgroups run the HGMMA once each; each of the 8 warps runs its own 2 HMMAs
    assert p.mma_fmas == 2 * hgmma + 8 * 2 * hmma
    # HGMMA: max(64 math cycles, (128 x 16 + 64 x 16) x 2 B / 128 = 48); HMMA: 2048 FMAs = 1 cycle each
    assert p.tensor_cycles == 2 * 64 + 8 * 2 * 1
    assert sass.mma_issuers(sass.parse(FUSED)[1]) == 4 and sass.mma_issuers(sass.parse(FUSED)[3]) == 1
    # on sm_80 every HMMA runs per warp too (there it is the only tensor-core instruction)
    ampere = loops.profile_sass(FUSED.replace("HGMMA.64x128x16", "HMMA.16816"), num_warps=8, arch="sm80")
    assert ampere is not None and ampere.mma_fmas == 8 * 3 * hmma
    # and no A100 has been measured: its estimate says so, the H100-class one does not
    assert not ampere.calibrated and ampere.basis.startswith("uncalibrated: no A100")
    assert p.calibrated and p.basis.startswith("calibrated on the H200")


def test_atomics_are_counted_apart_and_priced_per_warp() -> None:
    body = sass.parse(FUSED)
    counts = sass.count_kinds(body)
    assert counts["atomic"] == 2 and counts["stg"] == 0 and counts["other"] == 0
    assert [sass.atomic_bytes(i) for i in body if i.kind == "atomic"] == [16, 4]
    p = loops.profile_sass(FUSED, num_warps=8, arch="sm90")
    assert p is not None
    # each warp's REDG.F32x4 moves 32 x 16 B, its RED.F32 32 x 4 B, at 128 B a cycle (the assumption)
    assert p.atomic_cycles == 8 * (32 * 16 + 32 * 4) / 128
    assert p.cycles == p.tensor_cycles + max(p.issue_cycles, p.mufu_cycles) + p.atomic_cycles
    assert p.calibrated and "calibrated on the H200" in p.basis and "atomic 40" in p.summary()
    # without the atomics the same loop is cheaper by exactly their cycles
    plain = loops.profile_sass(FUSED.replace("REDG.E.ADD.F32x4", "NOP").replace("RED.E.ADD.F32", "NOP"), 8)
    assert plain is not None and plain.atomic_cycles == 0 and plain.cycles == p.cycles - p.atomic_cycles


@pytest.mark.parametrize("call", ["group=1 N=8192", "group=4 N=8192"])
def test_compiled_specialisation_is_the_jits(compiled, call: str) -> None:
    launched = compiled[0]["specialisations"][call]
    names = ["attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq", "attn_bwd_preprocess", "attn_bwd_dkdv"]
    assert [k["name"] for k in launched] == names
    assert all(k["same_as_jit"] for k in launched), launched
    for k in launched:
        # stride.Q.stride_d, ... (records.split), O.stride_d, ...; the two-kernel dK/dV has no dQ buffer (None)
        unit_strides = [a for a in k["signature"] if a.endswith(".stride_d")]
        if k["constants"].get("DQ_ATOMIC") == "False":
            unit_strides.remove("stride.DQ.stride_d")
        assert unit_strides and all(k["constants"][a] == "1" for a in unit_strides)
        assert "N_q" in k["divisible_by_16"]
    for dkdv in (launched[2], launched[5]):  # the dK/dV kernel, and the one-kernel backward
        if call.startswith("group=1"):
            assert dkdv["signature"]["GROUP"] == "constexpr" and dkdv["constants"]["GROUP"] == "1"
        else:
            assert dkdv["signature"]["GROUP"] == "i32" and "GROUP" not in dkdv["constants"]
    assert launched[5]["constants"]["DQ_ATOMIC"] == "True" and launched[2]["constants"]["DQ_ATOMIC"] == "False"


def test_sizes_not_divisible_by_16_get_no_divisibility_attribute(compiled) -> None:
    kernels = {k["name"]: k for k in compiled[0]["specialisations"]["group=1 N=8190"]}
    assert all(k["same_as_jit"] for k in kernels.values())
    assert "N_q" not in kernels["attn_fwd"]["divisible_by_16"]
    assert "ptr.Q" in kernels["attn_fwd"]["divisible_by_16"]  # the pointer still is


def test_worse_variant_takes_more_instructions_per_iteration(compiled) -> None:
    clean, worse = compiled[0]["clean"], compiled[0]["worse"]
    assert clean["mma"] == worse["mma"] == {"HGMMA.64x64x16": 16}  # 2 row halves x (4 + 4) k-steps
    assert worse["instructions"] > clean["instructions"], (clean, worse)
    print(f"instructions per iteration: clean {clean['instructions']}, worse {worse['instructions']}")
    assert worse["counts"]["fmul"] > clean["counts"]["fmul"]  # the scale on every score


def test_loops_table_and_dumped_ptx_and_sass(compiled) -> None:
    _, cli, dump = compiled
    assert cli.returncode == 0, cli.stderr[-3000:]
    lines = cli.stdout.splitlines()
    # the tile column reads "128x64 w4 s3", with " tma" where the forward loads by tensor descriptors and
    # " ws" where it is warp-specialised
    row, at = next(
        ([w for w in line.split() if w not in ("tma", "ws")], n)
        for n, line in enumerate(lines)
        if line.startswith("forward ") and "HGMMA." in line
    )
    assert row[1] == "bfloat16" and int(row[2]) == 16 and int(row[6]) > 0  # instructions per iteration
    assert any(line.startswith("# forward  bfloat16  D=16") and "TFLOP/s estimated" in line for line in lines)
    c = shipped_config(16, torch.bfloat16, "sm90").kernel("forward")
    assert c is not None and row[3:6] == [f"{c.BLOCK_M}x{c.BLOCK_N}", f"w{c.num_warps}", f"s{c.num_stages}"]
    specialised = getattr(c, "ws", False)
    if specialised:  # a line per partition under the row, then the model's
        assert lines[at + 1].split()[0] in ("producer", "consumer")
        assert any(line.startswith("  warp-specialised, ") for line in lines[at + 1 : at + 5])
    stem = f"forward_bf16_d16_{c.BLOCK_M}x{c.BLOCK_N}_w{c.num_warps}_s{c.num_stages}" + "_ws" * specialised
    for suffix in ("", "_noncausal"):
        assert ".version" in (dump / f"{stem}{suffix}.ptx").read_text()
        assert "HGMMA" in (dump / f"{stem}{suffix}.sass").read_text()


def test_dump_into_a_file_is_refused(tmp_path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    status = main(["kernels", "--kernel", "forward", "--head-dim", "16", "--dump", str(blocker)])
    assert status == 2
    assert f"--dump {blocker}" in capsys.readouterr().err


@pytest.mark.parametrize("other", [["--variants"], ["--mask", "bool"]])
def test_varlen_with_other_variants_is_refused(other: list[str], capsys) -> None:
    status = main(["kernels", "--kernel", "forward", "--head-dim", "16", "--varlen", *other])
    assert status == 2
    assert "--varlen combines with --dropout only" in capsys.readouterr().err
