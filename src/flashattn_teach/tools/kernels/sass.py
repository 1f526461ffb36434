"""Reading SASS, the GPU's machine code: instructions, loops, and counts by kind.

``cuobjdump -sass K.cubin`` prints one instruction a line, each with its byte address::

        /*1970*/                   DEPBAR.LE SB0, 0x0 ;
        /*4470*/               @P0 BRA 0x1970 ;

A loop is a branch back to a lower (or equal) address: its body is every instruction from the target to
the branch, both included. Counting them statically gives the work of one iteration *per warp* (every
warp of the program executes every instruction once an iteration; a lane masked off by a predicate still
takes the issue slot). A forward branch inside a body (an ``if`` in the loop) is counted as if taken
both ways; Triton's steady-state attention loops have none. The hot loop of a kernel is an innermost
loop that holds its tensor-core instructions (HGMMA on sm_90, HMMA on sm_80).

Instruction kinds follow the opcode, i.e. the mnemonic before its first dot (``HGMMA`` in
``HGMMA.64x128x16.F32.BF16``); :data:`KINDS` lists them.

A warp-specialised kernel (``tl.range(..., warp_specialize=True)``) runs different code in different
warpgroups: the SASS branches on the warp id into regions that each start by resizing their register file
(``USETMAXREG.DEALLOC`` for the producer, which only issues TMA copies, ``USETMAXREG.TRY_ALLOC`` for the
consumers, which run the matmuls and the softmax) and synchronise within a warpgroup through named
barriers (``BAR.SYNC 0x2, 0x80``: barrier 2, 128 threads) and across warpgroups through mbarriers
(``SYNCS``). :func:`partitions` finds each region's steady-state loop.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# kind -> opcodes; an opcode in none of them counts as "other" (moves, shuffles, special registers...)
KINDS: dict[str, tuple[str, ...]] = {
    "mma": ("HGMMA", "QGMMA", "HMMA"),  # QGMMA: the warpgroup MMA on e4m3/e5m2 inputs
    "mufu": ("MUFU",),
    "ffma": ("FFMA",),
    "fmul": ("FMUL",),
    "fadd": ("FADD",),
    "fp_other": ("FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "FSWZADD"),
    "convert": ("F2FP", "F2F", "F2I", "I2F", "I2FP"),
    "ldg": ("LDG",),
    "ldgsts": ("LDGSTS",),  # cp.async: global -> shared without registers (sm_80+)
    "tma": ("UTMALDG", "UBLKCP", "UTMAPF"),  # tensor memory accelerator copies (sm_90)
    "lds": ("LDS",),
    "ldsm": ("LDSM",),  # ldmatrix
    "sts": ("STS", "STSM"),
    "stg": ("STG", "UTMASTG"),
    "atomic": ("RED", "REDG", "ATOM", "ATOMG"),  # reductions and atomics to global memory (dQ's float32 adds)
    "local": ("LDL", "STL"),  # spills
    "bar": ("BAR",),  # CTA-wide barrier (__syncthreads)
    "sync": ("SYNCS",),  # mbarrier arrive / wait (sm_90)
    "wgmma_wait": ("WARPGROUP",),  # WARPGROUP.ARRIVE / WARPGROUP.DEPBAR: wgmma fences and waits
    "wait_other": ("DEPBAR", "LDGDEPBAR", "MEMBAR", "FENCE", "WARPSYNC", "ERRBAR", "CCTL"),
    "int": (
        "IMAD",
        "IADD3",
        "IADD",
        "LEA",
        "ISETP",
        "SHF",
        "SHL",
        "SHR",
        "LOP3",
        "LOP",
        "IMNMX",
        "VIMNMX",
        "SEL",
        "IABS",
        "PRMT",
        "IMUL",
        "FLO",
        "POPC",
        "BMSK",
        "PLOP3",
        "P2R",
        "R2P",
        "UIMAD",
        "UIADD3",
        "ULEA",
        "UISETP",
        "USHF",
        "ULOP3",
        "USEL",
        "UIMNMX",
        "UPRMT",
        "UPLOP3",
    ),
    "control": ("BRA", "BSSY", "BSYNC", "EXIT", "RET", "CALL", "NOP", "YIELD", "JMP", "BREAK"),
}
_KIND_OF = {op: kind for kind, ops in KINDS.items() for op in ops}

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?P<body>[^;]*);", re.IGNORECASE)
_BRANCH_TARGET = re.compile(r"^\s*(?:0x)?([0-9a-f]+)\b", re.IGNORECASE)
_HGMMA_SHAPE = re.compile(r"^[HQ]GMMA\.(\d+)x(\d+)x(\d+)")
_NAMED_BARRIER = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s*,\s*(0x[0-9a-f]+|\d+)\b", re.IGNORECASE)
_LAST_NUMBER = re.compile(r"(0x[0-9a-f]+|\d+)\s*$", re.IGNORECASE)
WARPGROUP_MMA = ("HGMMA", "QGMMA")  # sm_90's warpgroup MMA: 16-bit and TF32 inputs, fp8 inputs
_HMMA_SHAPE = re.compile(r"^HMMA\.(16)(8)(\d+)")  # HMMA.16816 is m16 n8 k16, HMMA.1688 m16 n8 k8
_VECTOR = re.compile(r"\.(?:F32|S32|U32)x(\d)\b")  # REDG.E.ADD.F32x4: four float32 a lane


@dataclass(frozen=True)
class Instruction:
    address: int
    predicate: str  # "@P0", "@!P1" or ""
    mnemonic: str  # with modifiers: "HGMMA.64x128x16.F32.BF16"
    operands: str

    @property
    def opcode(self) -> str:
        """The mnemonic without modifiers: "HGMMA"."""
        return self.mnemonic.split(".", 1)[0]

    @property
    def kind(self) -> str:
        return _KIND_OF.get(self.opcode, "other")


@dataclass(frozen=True)
class Loop:
    """Instructions ``[start, end]`` by address; ``end`` is the backward branch."""

    start: int
    end: int
    body: tuple[Instruction, ...]

    def contains(self, other: Loop) -> bool:
        return self.start <= other.start and other.end <= self.end and other != self


def parse(sass: str) -> list[Instruction]:
    """The instructions of ``cuobjdump -sass`` output (one kernel), in address order."""
    out = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        words = m.group("body").split(None, 1)
        predicate = words.pop(0) if words and words[0].startswith("@") else ""
        if not words:
            continue
        mnemonic, _, operands = words[0].partition(" ")
        rest = words[1] if len(words) > 1 else ""
        out.append(Instruction(int(m.group(1), 16), predicate, mnemonic, (operands + " " + rest).strip()))
    return sorted(out, key=lambda ins: ins.address)


def loops(instructions: list[Instruction]) -> list[Loop]:
    """Every loop: a ``BRA`` to an address at or below its own. The unconditional ``BRA`` to itself that
    ends every kernel (after ``EXIT``, a trap for runaway warps) is not a loop, nor is a branch back from
    code placed after an ``EXIT``: an mbarrier wait that fails its first try jumps to a retry stub at the
    end of the kernel, which jumps back; the span between holds an ``EXIT``, which no loop body does."""
    out = []
    for ins in instructions:
        if ins.opcode != "BRA":
            continue
        m = _BRANCH_TARGET.match(ins.operands)
        if m is None:
            continue
        target = int(m.group(1), 16)
        if target > ins.address or (target == ins.address and not ins.predicate):
            continue
        body = tuple(i for i in instructions if target <= i.address <= ins.address)
        if not any(i.opcode == "EXIT" for i in body):
            out.append(Loop(target, ins.address, body))
    return out


def hot_loops(instructions: list[Instruction]) -> list[Loop]:
    """Innermost loops holding tensor-core instructions, in address order (for Triton's attention kernels,
    program order: the unmasked stage first, then the masked one)."""
    found = loops(instructions)
    innermost = [lp for lp in found if not any(lp.contains(other) for other in found)]
    return sorted((lp for lp in innermost if any(i.kind == "mma" for i in lp.body)), key=lambda lp: lp.start)


def mma_shape(ins: Instruction) -> tuple[int, int, int]:
    """``(M, N, K)`` of one tensor-core instruction: of a warpgroup (4 warps) for HGMMA, of a warp for HMMA."""
    for pattern in (_HGMMA_SHAPE, _HMMA_SHAPE):
        m = pattern.match(ins.mnemonic)
        if m is not None:
            return int(m.group(1)), int(m.group(2)), int(m.group(3))
    raise ValueError(f"not a tensor-core instruction with a shape: {ins.mnemonic}")


def mma_issuers(ins: Instruction) -> int:
    """How many warps issue one execution of a tensor-core instruction: 4 for a warpgroup MMA (HGMMA,
    QGMMA: one execution for the warpgroup, whichever of its warps issue it), 1 for HMMA, which each warp
    runs on its own (``mma.sync``; Triton emits it where a product is too small for a warpgroup MMA,
    M < 64, also on sm_90)."""
    return 4 if ins.opcode in WARPGROUP_MMA else 1


def atomic_bytes(ins: Instruction) -> int:
    """Bytes one lane of an atomic or reduction instruction adds: 16 for ``REDG.E.ADD.F32x4``, 8 for a
    ``.64`` operation, 4 otherwise (``RED.E.ADD.F32``)."""
    m = _VECTOR.search(ins.mnemonic)
    if m is not None:
        return 4 * int(m.group(1))
    if ".128" in ins.mnemonic:
        return 16
    return 8 if ".64" in ins.mnemonic or ".F64" in ins.mnemonic else 4


def mma_shapes(body: tuple[Instruction, ...] | list[Instruction]) -> Counter[str]:
    """How many tensor-core instructions of each shape: ``{"HGMMA.64x128x16": 16}``."""
    return Counter(
        f"{i.opcode}.{'x'.join(map(str, mma_shape(i)))}" if i.opcode in WARPGROUP_MMA else i.mnemonic.split(".F32")[0]
        for i in body
        if i.kind == "mma"
    )


def count_kinds(body: tuple[Instruction, ...] | list[Instruction]) -> Counter[str]:
    """Instructions by :data:`KINDS` (plus "other"), with ``mufu_ex2`` for the exponentials among ``mufu``."""
    counts = Counter(dict.fromkeys([*KINDS, "other"], 0))
    counts.update(i.kind for i in body)
    counts["mufu_ex2"] = sum(1 for i in body if i.mnemonic.startswith("MUFU.EX2"))
    counts["uniform_int"] = sum(1 for i in body if i.kind == "int" and i.opcode.startswith("U"))
    counts["bar_named"] = sum(1 for i in body if named_barrier(i) is not None)
    return counts


def named_barrier(ins: Instruction) -> tuple[int, int] | None:
    """``(barrier id, threads)`` of a barrier over part of the program (``BAR.SYNC 0x2, 0x80``, ``BAR.ARV``);
    None for any other instruction, and for a CTA-wide barrier (no thread count: ``BAR.SYNC 0x0``)."""
    if ins.opcode != "BAR":
        return None
    m = _NAMED_BARRIER.match(ins.operands)
    return None if m is None else (int(m.group(1), 0), int(m.group(2), 0))


def setmaxnreg(ins: Instruction) -> int | None:
    """The registers per thread a ``USETMAXREG`` sets (``USETMAXREG.DEALLOC.CTAPOOL 0x28``: 40), else None."""
    if ins.opcode != "USETMAXREG":
        return None
    m = _LAST_NUMBER.search(ins.operands)
    return None if m is None else int(m.group(1), 0)


def warp_specialized(instructions: list[Instruction]) -> bool:
    """Whether warpgroups resize their register files (``USETMAXREG``), as warp-specialised kernels do."""
    return any(i.opcode == "USETMAXREG" for i in instructions)


@dataclass(frozen=True)
class Partition:
    """The steady-state loop of one warpgroup's region of a warp-specialised kernel."""

    role: str  # "consumer" (its loop holds the matmuls) or "producer" (copies into shared memory, no matmul)
    loop: Loop
    registers: int | None  # per thread, as the region's USETMAXREG sets them (None: no USETMAXREG before it)
    warps: int  # threads of its loop's named barriers / 32; a warpgroup (4) when it has none
    barriers: tuple[int, ...]  # ids of the named barriers in its loop

    @property
    def cta_barriers(self) -> int:
        """CTA-wide barriers (``BAR`` without a thread count) in its loop: none in a specialised loop."""
        return sum(1 for i in self.loop.body if i.opcode == "BAR" and named_barrier(i) is None)


def partitions(instructions: list[Instruction]) -> list[Partition]:
    """Each warpgroup region's steady-state loop, in address order. A region runs from a ``USETMAXREG`` to
    the next (a consumer's code is repeated once per consumer warpgroup, so each has its own region); its
    loop is the shortest innermost one holding matmuls (a consumer) or, without any, TMA copies or
    cp.async (the producer). Empty for a kernel that is not warp-specialised."""
    if not warp_specialized(instructions):
        return []
    resizes = [(i.address, setmaxnreg(i)) for i in instructions if i.opcode == "USETMAXREG"]
    found = loops(instructions)
    regions: dict[int, list[Loop]] = {}
    for lp in found:
        if not any(lp.contains(other) for other in found):
            before = [r for r in resizes if r[0] < lp.start]
            regions.setdefault(before[-1][0] if before else -1, []).append(lp)
    registers = dict(resizes)
    out = []
    for start, region in sorted(regions.items()):
        for role, kinds in (("consumer", ("mma",)), ("producer", ("tma", "ldgsts"))):
            held = [lp for lp in region if any(i.kind in kinds for i in lp.body)]
            if held:
                loop = min(held, key=lambda lp: len(lp.body))
                named = [b for b in map(named_barrier, loop.body) if b is not None]
                warps = max((threads for _, threads in named), default=128) // 32
                ids = tuple(sorted({bar_id for bar_id, _ in named}))
                out.append(Partition(role, loop, registers.get(start), warps, ids))
                break
    return out


def cuobjdump() -> str:
    """The ``cuobjdump`` the triton wheel ships (CUDA's, for reading cubins)."""
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def disassemble(cubin: bytes) -> tuple[str, str]:
    """``(cuobjdump -sass, cuobjdump -res-usage)`` of a cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text, res = (
            subprocess.run([cuobjdump(), flag, str(path)], capture_output=True, text=True, check=True).stdout
            for flag in ("-sass", "-res-usage")
        )
    return text, res
