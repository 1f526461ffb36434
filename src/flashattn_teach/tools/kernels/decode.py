"""Ahead-of-time compilation report of the decode kernels (:mod:`.decode`), as :mod:`.inspect` gives one
for the prefill kernels: no GPU needed.

Each case is a sample decode step run through the real launcher (:func:`.decode_launch.launch_decode`)
under :func:`.specialize.capture`, so the kernels compiled are the specialisations the JIT builds for it:
Llama's shapes (``H_q = 32``, ``H_kv = 8``, one new query, so ``G x N_new = 4`` rows padded to
``BLOCK_M = 16``), a 16k cache in 4 splits (so the combine kernel launches too), with a causal window,
softcap and ALiBi at once (the most live values per score), in the tiles :func:`.decode_launch.decode_config`
ships; ``--rows`` asks for as many query rows as the configuration's largest ``BLOCK_M``; ``--paged
PAGE_SIZE`` stores the caches in pages of that many keys (a shuffled block table, flash-attn's
``cache_leftpad`` and attention sinks too). A case ``bfloat16:192/128`` has query/key head dim 192 and value
head dim 128 (DeepSeek's MLA), its keys two lane groups of 128 + 64; ``--padded`` builds it as before, one
lane group padded to 256, on the same tiles (for comparing the two). Printed per kernel: registers per
thread, spilled bytes (stack plus local memory), shared memory, and a check (no spills, at most 255
registers, shared memory within the 227 KB a block may use on sm_90, 163 KB on sm_80); ``--loops`` adds the
split kernel's loop profile (:mod:`.loops`: instructions per warp per key-block iteration of its steady-state
loop).

    flashattn-teach kernels-decode --arch sm90 [--case bfloat16:128 float32:64] [--rows]
        [--paged 256] [--loops] [--padded]

Must run without ``TRITON_INTERPRET`` (the variable decides how kernels are built for the whole process).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ...serving import launch as decode_launch
from ...serving.launch import decode_config, launch_decode
from ...triton.configs import ARCHS
from ...triton.lanes import block_d
from .compile import MAX_REGISTERS, SMEM_LIMIT, require_triton
from .loops import loop_profile
from .sass import disassemble
from .specialize import CompileRequest, requests_for

SAMPLE_BATCH = 4
SAMPLE_HEADS = 32
SAMPLE_KV_HEADS = 8
SAMPLE_CACHE = 16384
SAMPLE_SPLITS = 4
# (dtype, head dim) of every case: 16-bit up to 256, fp32 up to 128 (what the Triton forward supports)
CASES = (
    (torch.bfloat16, 64),
    (torch.bfloat16, 128),
    (torch.float16, 128),
    (torch.bfloat16, 256),
    (torch.float32, 64),
    (torch.float32, 128),
)
# (dtype, D, D_v) of the cases whose value head dim differs: DeepSeek's MLA, D = 192 as two lane groups
SPLIT_CASES = ((torch.bfloat16, 192, 128),)
_ROW = "{:<18} {:<9} {:>4} {:>7} {:>7} {:>5} {:>6} {:>7}"
_DTYPE_BY_NAME = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _figure(res_usage: str, name: str) -> int:
    """One figure of ``cuobjdump -res-usage`` (``REG:40 STACK:0 SHARED:0 LOCAL:0 ...``)."""
    found = re.search(rf"\b{name}:(\d+)", res_usage)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no {name} figure: {res_usage.strip()!r}")
    return int(found.group(1))


@contextmanager
def one_lane_group() -> Iterator[None]:
    """Within the block the decode launcher covers every query/key head dim with one padded lane group, as it
    did before :func:`flashattn_teach.triton.lanes.lane_groups` split 192 into 128 + 64 (tiles unchanged)."""
    saved = decode_launch.lane_groups
    decode_launch.lane_groups = lambda head_dim: (block_d(head_dim), 0)
    try:
        yield
    finally:
        decode_launch.lane_groups = saved


def requests(
    arch: str,
    dtype: torch.dtype,
    head_dim: int,
    *,
    rows: bool = False,
    page_size: int | None = None,
    head_dim_v: int | None = None,
) -> list[CompileRequest]:
    """The compile requests of the sample decode step (module docs): the split kernel, then the combine;
    ``page_size``: paged caches of that many keys a page, with ``cache_leftpad`` and sinks; ``head_dim_v``:
    the values' head dim (default ``head_dim``)."""
    D_v = head_dim if head_dim_v is None else head_dim_v
    config = decode_config(dtype, head_dim, arch, D_v)
    n_new = config.BLOCK_M // (SAMPLE_HEADS // SAMPLE_KV_HEADS) if rows else 1
    q = torch.empty(SAMPLE_BATCH, SAMPLE_HEADS, n_new, head_dim, dtype=dtype)
    seqlens = torch.empty(SAMPLE_BATCH, dtype=torch.int32)
    paged: dict[str, torch.Tensor | None] = {"block_table": None, "cache_leftpad": None, "sinks": None}
    if page_size is None:
        k_cache = torch.empty(SAMPLE_BATCH, SAMPLE_KV_HEADS, SAMPLE_CACHE, head_dim, dtype=dtype)
    else:
        max_blocks = -(-SAMPLE_CACHE // page_size)
        k_cache = torch.empty(SAMPLE_BATCH * max_blocks, SAMPLE_KV_HEADS, page_size, head_dim, dtype=dtype)
        paged = {
            "block_table": torch.randperm(SAMPLE_BATCH * max_blocks, dtype=torch.int32).view(SAMPLE_BATCH, -1),
            "cache_leftpad": torch.zeros(SAMPLE_BATCH, dtype=torch.int32),
            "sinks": torch.zeros(SAMPLE_HEADS),
        }
    v_cache = torch.empty(*k_cache.shape[:3], D_v, dtype=dtype)
    return requests_for(
        lambda: launch_decode(
            q,
            k_cache,
            v_cache,
            seqlens,
            1,
            causal=True,
            scale=head_dim**-0.5,
            window=(4096, 0),
            softcap=50.0,
            alibi_slopes=torch.empty(SAMPLE_HEADS),
            num_splits=SAMPLE_SPLITS,
            config=config,
            block_table=paged["block_table"],
            cache_leftpad=paged["cache_leftpad"],
            sinks=paged["sinks"],
        ),
        arch,
    )


def report(request: CompileRequest, arch: str) -> dict[str, int | str]:
    """Registers, spilled bytes and shared memory of one compiled kernel, and its check."""
    compiled = request.compile()
    text, res = disassemble(compiled.asm["cubin"])
    spills = _figure(res, "LOCAL") + _figure(res, "STACK")
    if spills == 0 and re.search(r"\b(STL|LDL)\b", text):
        spills = -1  # local-memory traffic of unknown size
    registers = _figure(res, "REG")
    smem = max(_figure(res, "SHARED"), compiled.metadata.shared)
    problems = []
    if spills:
        problems.append("spills to local memory")
    if registers > MAX_REGISTERS:
        problems.append(f"{registers} registers > {MAX_REGISTERS}")
    if smem > SMEM_LIMIT[arch]:
        problems.append(f"{smem} bytes of shared memory > {SMEM_LIMIT[arch]}")
    return {"registers": registers, "spills": spills, "smem": smem, "check": "; ".join(problems) or "ok"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=ARCHS, default="sm90")
    names = [f"{str(dt).removeprefix('torch.')}:{d}" for dt, d in CASES]
    names += [f"{str(dt).removeprefix('torch.')}:{d}/{d_v}" for dt, d, d_v in SPLIT_CASES]
    parser.add_argument("--case", nargs="+", choices=names, default=names, help="dtype:D[/D_v] (default: all)")
    parser.add_argument("--rows", action="store_true", help="as many query rows as the largest BLOCK_M")
    parser.add_argument("--paged", type=int, metavar="PAGE_SIZE", help="paged caches, with leftpad and sinks")
    parser.add_argument("--loops", action="store_true", help="the split kernel's loop profile")
    parser.add_argument("--padded", action="store_true", help="192 as one lane group padded to 256, same tiles")


def run(args: argparse.Namespace) -> int:
    require_triton()
    os.environ.pop("TRITON_INTERPRET", None)  # compiling ahead of time needs it unset in this process
    cases = []
    for name in args.case:
        dtype_name, dims = name.split(":")
        d, _, d_v = dims.partition("/")
        cases.append((_DTYPE_BY_NAME[dtype_name], int(d), int(d_v or d)))
    limits = f"registers <= {MAX_REGISTERS}, no spills, shared memory <= {SMEM_LIMIT[args.arch]} B"
    layout = "contiguous caches" if args.paged is None else f"pages of {args.paged} keys, leftpad, sinks"
    print(f"# {args.arch} decode kernels ({layout}): {limits}")
    columns = ("kernel", "dtype", "D", "BLOCK_M", "BLOCK_N", "regs", "spills", "smem")
    print(_ROW.format(*columns) + "  check")
    failed = 0
    for dt, d, d_v in cases:
        profiles = []
        with one_lane_group() if args.padded else contextlib.nullcontext():
            built = requests(args.arch, dt, d, rows=args.rows, page_size=args.paged, head_dim_v=d_v)
        for request in built:
            r = report(request, args.arch)
            if args.loops and request.name == "decode_split_fwd":
                profiles.append(loop_profile(request, args.arch))
            constants = request.constants()
            failed += r["check"] != "ok"
            tile = (constants.get("BLOCK_M", "-"), constants.get("BLOCK_N", "-"))
            dtype = str(dt).removeprefix("torch.")
            dims = d if d == d_v else f"{d}/{d_v}"
            figures = (r["registers"], r["spills"], r["smem"])
            print(_ROW.format(request.name, dtype, dims, *tile, *figures) + f"  {r['check']}")
        for profile in profiles:
            print("  " + ("no loop holds a matmul" if profile is None else profile.summary()))
    return 1 if failed else 0
