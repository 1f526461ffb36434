"""A static loop profile: what one iteration of a kernel's hot loop costs, read from its SASS, and the
speed a small model of an SM predicts from it. No GPU needed; see docs/loop-profile.md.

Per warp and iteration of the steady-state loop (:func:`flashattn_teach.tools.kernels.sass.hot_loops`; the
shortest one when a kernel has several stages, since the unmasked stage does a subset of a masked
stage's work) the profile counts instructions by kind. One iteration of a program (CTA) with ``W`` warps
then costs, on one SM:

    issue   = W * instructions / 4                   4 schedulers, each issuing 1 warp-instruction a cycle
    mufu    = W * 32 * MUFU instructions / 16        16 special-function results a cycle (exp2, rcp, lg2)
    tensor  = sum over tensor-core instructions of executions * max(M*N*K / FMA_RATE,
                                                                    operand bytes read from shared memory / 128)
    atomic  = W * sum over atomics (RED, ATOM) of 32 lanes * bytes a lane / 128     (an assumption, below)

Executions: an HGMMA (warpgroup MMA) is issued by each of a warpgroup's 4 warps but runs once for the
warpgroup, ``W / 4`` of them an iteration; an HMMA (``mma.sync``, which Triton emits where a product is too
small for a warpgroup MMA, M < 64, also on sm_90) runs once per warp that issues it, ``W`` of them
(:func:`flashattn_teach.tools.kernels.sass.mma_issuers`). An HGMMA reads B, and A unless A sits in
registers, from shared memory at 128 bytes a cycle, so a thin ``HGMMA.64x16x16`` runs at half speed.

Atomics (the one-kernel backward's float32 dQ adds, ``REDG.E.ADD.F32x4``) are an ASSUMPTION, not a
measurement: each warp-instruction is charged its bytes (32 lanes x 16 B) at 128 B a cycle, the SM's
L1/shared-memory data path (32 banks x 4 B a cycle, CUDA C++ Programming Guide, shared memory; on sm_80 and
sm_90 L1 and shared memory are one unit, NVIDIA's A100 and H100 architecture whitepapers), added to the
loop's serial work (not overlapped); the L2's reduction throughput, which NVIDIA does not publish, is
assumed to keep up. No GPU has timed a loop with atomics yet.

In Triton's single-warpgroup-role loop (no warp specialisation) a warpgroup waits for each matmul
(``WARPGROUP.DEPBAR``) before the softmax that reads it, so the model does not overlap tensor-core time
with the rest, while the exponentials overlap the other instructions' issue:

    cycles  = tensor + max(issue, mufu) + atomic
    ceiling = FLOPs / max(tensor, issue, mufu, atomic)   perfect overlap (a warp-specialised kernel's goal)

``estimate = CALIBRATION * FLOPs / cycles * SMs * clock``. The H100-class figures (H100 SXM / H200:
132 SMs at the 1.83 GHz of NVIDIA's 989 TFLOP/s dense-bf16 rating, i.e. 2048 bf16 FMA a cycle per SM;
16 MUFU a cycle per SM, 4 per scheduler, from the CUDA C++ Programming Guide's throughput table for
compute capability 9.0) are datasheet numbers; HMMA is priced at the same rate as HGMMA (an upper figure:
``mma.sync`` is not documented to reach the warpgroup MMA's rate on sm_90). ``CALIBRATION`` is fitted to
the non-specialised triton kernels measured on an H200 with triton 3.6 (benchmarks/results/gpu/2026-11-30-h200):
measured / model was 0.75 (forward hd128), 0.74 (forward hd64), 0.73 (backward hd128), 0.82 (backward hd64).

A warp-specialised kernel (:func:`flashattn_teach.tools.kernels.sass.partitions`: a producer warpgroup
issuing TMA copies, consumer warpgroups each owning ``64`` rows of the query block) is charged per program
iteration (one key block for the whole program):

    tensor  = sum over consumers of their matmuls     (one SM's tensor cores serve every warpgroup)
    issue   = sum over partitions of warps * instructions / 4;  mufu and atomic alike
    chain   = max over consumers of tensor_c + max(issue_c, mufu_c) + atomic_c
    cycles  = max(tensor, issue, mufu, atomic, chain, producer's issue)

A consumer's loop waits for its own matmuls, so its work is serial (``chain``), but nothing orders it
against the other consumer's: the model assumes PERFECT alternation, one consumer's softmax under the
other's matmuls, and producer copies that keep ahead (no L2 term). That model is UNCALIBRATED: no
warp-specialised kernel has been timed, and ``SPECIALIZED_CALIBRATION`` is ``CALIBRATION`` borrowed from
kernels modelled with no overlap at all; every figure it gives says so (:attr:`LoopProfile.basis`), beside
the no-overlap figure of the same loops (:meth:`LoopProfile.serial_tflops`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .sass import (
    WARPGROUP_MMA,
    Instruction,
    Partition,
    atomic_bytes,
    count_kinds,
    disassemble,
    hot_loops,
    mma_issuers,
    mma_shape,
    mma_shapes,
    parse,
    partitions,
)

CALIBRATION = 0.75  # measured / modelled TFLOP/s, H200 + triton 3.6, 2026-11-30 (see docstring)
CALIBRATED_ON = "H200 2026-11-30, non-specialised kernels"
SPECIALIZED_CALIBRATION = CALIBRATION  # NOT fitted: borrowed; its figures are labelled uncalibrated
UNCALIBRATED = f"uncalibrated: warp-specialised, factor {SPECIALIZED_CALIBRATION} borrowed from the {CALIBRATED_ON}"


@dataclass(frozen=True)
class SMModel:
    """Throughputs of one streaming multiprocessor, and how many a chip has."""

    name: str
    sms: int
    clock_ghz: float
    schedulers: int  # warp schedulers per SM, each issuing one warp-instruction a cycle
    fma_per_clock: dict[str, int]  # dense tensor-core FMAs a cycle per SM, by input type
    mufu_per_clock: int  # special-function results a cycle per SM
    smem_bytes_per_clock: int  # shared-memory bandwidth per SM
    lsu_bytes_per_clock: int  # global-memory data a cycle through the SM's L1 path (atomics; an assumption)
    measured: bool  # whether CALIBRATION was fitted on this GPU's measurements

    def tflops(self, flops: float, cycles: float) -> float:
        """Chip-wide TFLOP/s when every SM does ``flops`` in ``cycles``."""
        return flops / cycles * self.sms * self.clock_ghz * 1e-3


H100 = SMModel(
    name="H100 SXM / H200 (sm_90)",
    sms=132,
    clock_ghz=1.83,
    schedulers=4,
    fma_per_clock={"F16": 2048, "BF16": 2048, "TF32": 1024, "E4M3": 4096, "E5M2": 4096},
    mufu_per_clock=16,
    smem_bytes_per_clock=128,
    lsu_bytes_per_clock=128,
    measured=True,
)
A100 = SMModel(  # not calibrated: no A100 measurements yet
    name="A100 SXM (sm_80)",
    sms=108,
    clock_ghz=1.41,
    schedulers=4,
    fma_per_clock={"F16": 1024, "BF16": 1024, "TF32": 512},
    mufu_per_clock=16,
    smem_bytes_per_clock=128,
    lsu_bytes_per_clock=128,
    measured=False,
)
MODELS = {"sm90": H100, "sm80": A100}
_BYTES = {"F16": 2, "BF16": 2, "TF32": 4, "E4M3": 1, "E5M2": 1}
_INPUT_TYPE = re.compile(r"\.(BF16|TF32|E4M3|E5M2)\b")


def _input_type(ins: Instruction) -> str:
    """The inputs' type; fp16 inputs carry no suffix (``HGMMA.64x128x16.F32`` is fp16 in, fp32 out)."""
    m = _INPUT_TYPE.search(ins.mnemonic)
    return "F16" if m is None else m.group(1)


def mma_cycles(ins: Instruction, model: SMModel) -> float:
    """SM cycles one tensor-core instruction occupies (math or shared-memory operands, whichever is slower)."""
    M, N, K = mma_shape(ins)
    dtype = _input_type(ins)
    compute = M * N * K / model.fma_per_clock[dtype]
    if ins.opcode not in WARPGROUP_MMA:
        return compute  # HMMA reads registers only
    a_in_shared = ins.operands.split(",")[1].strip().startswith("gdesc")
    smem_bytes = (N * K + (M * K if a_in_shared else 0)) * _BYTES[dtype]
    return max(compute, smem_bytes / model.smem_bytes_per_clock)


def atomic_cycles(ins: Instruction, model: SMModel) -> float:
    """SM cycles one warp's atomic or reduction instruction occupies: its 32 lanes' bytes at the L1 path's
    ``lsu_bytes_per_clock`` (an assumption; see the module docstring)."""
    return 32 * atomic_bytes(ins) / model.lsu_bytes_per_clock


def loop_costs(body: tuple[Instruction, ...], warps: int, model: SMModel) -> tuple[int, float, float]:
    """``(tensor-core FMAs, tensor cycles, atomic cycles)`` of one iteration of ``body`` run by ``warps``
    warps: each tensor-core instruction executes ``warps / mma_issuers`` times (once a warpgroup for HGMMA,
    once a warp for HMMA), each atomic once a warp."""
    mmas = [(warps // mma_issuers(i), i) for i in body if i.kind == "mma"]
    fmas = sum(n * math.prod(mma_shape(i)) for n, i in mmas)
    tensor = sum(n * mma_cycles(i, model) for n, i in mmas)
    atomic = warps * sum(atomic_cycles(i, model) for i in body if i.kind == "atomic")
    return fmas, tensor, atomic


@dataclass(frozen=True)
class PartitionProfile:
    """One warpgroup region's steady-state loop in a warp-specialised kernel: counts per warp, costs on one SM."""

    role: str  # "consumer" or "producer"
    warps: int
    registers: int | None  # set by its USETMAXREG
    barriers: tuple[int, ...]  # named barrier ids in its loop
    cta_barriers: int  # CTA-wide barriers in its loop
    instructions: int  # per warp and iteration
    counts: dict[str, int]
    mma: dict[str, int]  # tensor-core instructions per warp by shape
    mma_fmas: int  # its tensor-core FMAs an iteration
    tensor_cycles: float  # its own matmuls
    issue_cycles: float  # its share of the SM's issue slots: warps * instructions / 4
    mufu_cycles: float
    atomic_cycles: float
    own_issue_cycles: float  # how long its warps take to issue the loop: a scheduler per warp up to 4

    @property
    def chain(self) -> float:
        """Its serial work an iteration: its matmuls, then its softmax (its loop waits for each matmul)."""
        return self.tensor_cycles + max(self.own_issue_cycles, self.mufu_cycles) + self.atomic_cycles


def partition_profile(part: Partition, model: SMModel) -> PartitionProfile:
    body = part.loop.body
    counts = count_kinds(body)
    fmas, tensor, atomic = loop_costs(body, part.warps, model)
    return PartitionProfile(
        role=part.role,
        warps=part.warps,
        registers=part.registers,
        barriers=part.barriers,
        cta_barriers=part.cta_barriers,
        instructions=len(body),
        counts=dict(counts),
        mma=dict(mma_shapes(body)),
        mma_fmas=fmas,
        tensor_cycles=tensor,
        issue_cycles=part.warps * len(body) / model.schedulers,
        mufu_cycles=part.warps * 32 * counts["mufu"] / model.mufu_per_clock,
        atomic_cycles=atomic,
        own_issue_cycles=len(body) * math.ceil(part.warps / model.schedulers),
    )


@dataclass(frozen=True)
class LoopProfile:
    """One iteration of a kernel's steady-state loop: counts per warp, costs per program on one SM."""

    kernel: str
    num_warps: int
    instructions: int  # per warp and iteration
    counts: dict[str, int]  # by kind of :data:`flashattn_teach.tools.kernels.sass.KINDS`, plus mufu_ex2, uniform_int
    mma: dict[str, int]  # tensor-core instructions per warp by shape, {"HGMMA.64x128x16": 16}
    mma_fmas: int  # tensor-core FMAs an iteration of the whole program
    tensor_cycles: float
    issue_cycles: float
    mufu_cycles: float
    atomic_cycles: float  # atomics' data path, an assumption (module docstring)
    loop_sizes: tuple[int, ...]  # instructions of every hot loop (stages), in address order
    model: SMModel = field(repr=False)
    # warp-specialised kernels: every warpgroup region's loop (then the fields above are the first
    # consumer's counts per warp, and the costs the sums over partitions); empty otherwise
    partitions: tuple[PartitionProfile, ...] = ()

    @property
    def specialized(self) -> bool:
        return bool(self.partitions)

    @property
    def serial_cycles(self) -> float:
        """Matmuls, then the rest, nothing overlapped: the model of a loop without warp specialisation."""
        return self.tensor_cycles + max(self.issue_cycles, self.mufu_cycles) + self.atomic_cycles

    @property
    def cycles(self) -> float:
        """Modelled SM cycles an iteration (see the module docstring): :attr:`serial_cycles`, or for a
        warp-specialised kernel the largest of the SM-wide costs and each partition's serial chain."""
        if not self.partitions:
            return self.serial_cycles
        chains = (p.chain if p.role == "consumer" else p.own_issue_cycles for p in self.partitions)
        return max(self.tensor_cycles, self.issue_cycles, self.mufu_cycles, self.atomic_cycles, *chains)

    @property
    def calibrated(self) -> bool:
        """Whether the factor applied was fitted on kernels of this kind (not warp-specialised) on this GPU."""
        return not self.partitions and self.model.measured

    @property
    def calibration(self) -> float:
        return CALIBRATION if self.calibrated else SPECIALIZED_CALIBRATION

    @property
    def basis(self) -> str:
        """What the estimate rests on, to print beside it: ``calibrated on ...`` or ``uncalibrated: ...``."""
        if self.partitions:
            return UNCALIBRATED
        if not self.model.measured:
            borrowed = f"factor {CALIBRATION} borrowed from the {CALIBRATED_ON}"
            return f"uncalibrated: no {self.model.name} measured, {borrowed}"
        return f"calibrated on the {CALIBRATED_ON}"

    @property
    def bound(self) -> str:
        """The largest of the costs."""
        costs = {
            "tensor": self.tensor_cycles,
            "issue": self.issue_cycles,
            "mufu": self.mufu_cycles,
            "atomic": self.atomic_cycles,
        }
        return max(costs, key=costs.__getitem__)

    def estimate_tflops(self, flops: float | None = None) -> float:
        """TFLOP/s for ``flops`` an iteration (default: the loop's own tensor-core FLOPs), times the factor;
        calibrated only where :attr:`calibrated` (say :attr:`basis` wherever it is printed)."""
        flops = 2 * self.mma_fmas if flops is None else flops
        return self.calibration * self.model.tflops(flops, self.cycles)

    def serial_tflops(self, flops: float | None = None) -> float:
        """As :meth:`estimate_tflops` with nothing overlapped (:attr:`serial_cycles`): for a warp-specialised
        kernel, the figure if its consumers did not overlap each other at all."""
        flops = 2 * self.mma_fmas if flops is None else flops
        return self.calibration * self.model.tflops(flops, self.serial_cycles)

    def ceiling_tflops(self) -> float:
        """Tensor-core TFLOP/s with every cost perfectly overlapped (no factor: a ceiling, not an estimate)."""
        costs = (self.tensor_cycles, self.issue_cycles, self.mufu_cycles, self.atomic_cycles)
        return self.model.tflops(2 * self.mma_fmas, max(costs))

    def summary(self) -> str:
        c = self.counts
        mma = " ".join(f"{n}x{shape}" for shape, n in sorted(self.mma.items()))
        return (
            f"{self.kernel}: {self.instructions} instructions per warp per iteration ({self.num_warps} warps"
            + ("; warp-specialised, the first consumer's counts" if self.partitions else "")
            + "); "
            f"{mma}; MUFU.EX2 {c['mufu_ex2']}; FFMA {c['ffma']} FMUL {c['fmul']} FADD {c['fadd']}; "
            f"LDG {c['ldg']} LDGSTS {c['ldgsts']} TMA {c['tma']} LDS {c['lds']} LDSM {c['ldsm']}; "
            f"BAR {c['bar']} SYNCS {c['sync']} WARPGROUP {c['wgmma_wait']}; RED/ATOM {c['atomic']}; "
            f"integer {c['int']}; LDL/STL {c['local']}; cycles tensor {self.tensor_cycles:.0f} issue "
            f"{self.issue_cycles:.0f} mufu {self.mufu_cycles:.0f} atomic {self.atomic_cycles:.0f} -> "
            f"{self.estimate_tflops():.0f} TFLOP/s estimated, {self.basis} ({self.ceiling_tflops():.0f} "
            "with perfect overlap)"
        )

    def partition_lines(self) -> list[str]:
        """For a warp-specialised kernel, a line per warpgroup region (counts per warp) and one of the model;
        none for another kernel."""
        if not self.partitions:
            return []
        lines = []
        for q in self.partitions:
            c = q.counts
            registers = "-" if q.registers is None else q.registers
            ids = ",".join(map(str, q.barriers)) or "-"
            lines.append(
                f"  {q.role:<9} warps {q.warps} setmaxnreg {registers}: {q.instructions} instr, ex2 {c['mufu_ex2']}, "
                f"tma {c['tma']}, sync {c['sync']}, named bar {c['bar_named']} (id {ids}), CTA-wide bar "
                f"{q.cta_barriers}, wgmma {c['wgmma_wait']}; cycles tensor {q.tensor_cycles:.0f} issue "
                f"{q.own_issue_cycles:.0f} mufu {q.mufu_cycles:.0f}"
                + (f" chain {q.chain:.0f}" if q.role == "consumer" else "")
            )
        lines.append(
            f"  warp-specialised, {self.num_warps} warps: cycles max(tensor {self.tensor_cycles:.0f}, issue "
            f"{self.issue_cycles:.0f}, mufu {self.mufu_cycles:.0f}, chains) = {self.cycles:.0f}, {self.bound}-bound "
            f"(no overlap: {self.serial_cycles:.0f}) -> {self.estimate_tflops():.0f} TFLOP/s estimated, "
            f"{self.basis} ({self.serial_tflops():.0f} with no overlap; {self.ceiling_tflops():.0f} ceiling)"
        )
        return lines


def profile_sass(text: str, num_warps: int, arch: str = "sm90", kernel: str = "") -> LoopProfile | None:
    """The profile of the steady-state loop in ``cuobjdump -sass`` output; None if no loop holds a matmul.
    ``num_warps`` is the launch's; a warp-specialised kernel's partitions carry their own warp counts."""
    model = MODELS[arch]
    instructions = parse(text)
    hot = hot_loops(instructions)
    if not hot:
        return None
    parts = tuple(partition_profile(part, model) for part in partitions(instructions))
    if any(p.role == "consumer" for p in parts):
        return _specialized_profile(parts, kernel, tuple(len(lp.body) for lp in hot), model)
    body = min(hot, key=lambda lp: len(lp.body)).body
    fmas, tensor, atomic = loop_costs(body, num_warps, model)
    counts = count_kinds(body)
    return LoopProfile(
        kernel=kernel,
        num_warps=num_warps,
        instructions=len(body),
        counts=dict(counts),
        mma=dict(mma_shapes(body)),
        mma_fmas=fmas,
        tensor_cycles=tensor,
        issue_cycles=num_warps * len(body) / model.schedulers,
        mufu_cycles=num_warps * 32 * counts["mufu"] / model.mufu_per_clock,
        atomic_cycles=atomic,
        loop_sizes=tuple(len(lp.body) for lp in hot),
        model=model,
    )


def _specialized_profile(
    parts: tuple[PartitionProfile, ...], kernel: str, loop_sizes: tuple[int, ...], model: SMModel
) -> LoopProfile:
    consumers = [p for p in parts if p.role == "consumer"]
    return LoopProfile(
        kernel=kernel,
        num_warps=sum(p.warps for p in parts),
        instructions=consumers[0].instructions,
        counts=consumers[0].counts,
        mma=consumers[0].mma,
        mma_fmas=sum(p.mma_fmas for p in consumers),
        tensor_cycles=sum(p.tensor_cycles for p in consumers),
        issue_cycles=sum(p.issue_cycles for p in parts),
        mufu_cycles=sum(p.mufu_cycles for p in parts),
        atomic_cycles=sum(p.atomic_cycles for p in parts),
        loop_sizes=loop_sizes,
        model=model,
        partitions=parts,
    )


def loop_profile(request, arch: str | None = None) -> LoopProfile | None:
    """Compile a :class:`flashattn_teach.tools.kernels.specialize.CompileRequest` and profile its hot loop.

    For a modified kernel: ``loop_profile(request_for_call(kernel, *sample_args, **constexprs_and_options))``
    with CPU tensors as sample arguments (see :func:`flashattn_teach.tools.kernels.specialize.request_for_call`).
    """
    compiled = request.compile()
    text, _ = disassemble(compiled.asm["cubin"])
    arch = arch or f"sm{request.target.arch}"
    return profile_sass(text, request.options.num_warps, arch, kernel=request.name)
