"""The five rungs: each one's forward on ``(B, H, N, D)`` inputs, its tile, the HBM bytes the IO model counts for
its schedule and its tolerance against float64 dense; or, for a kernel that cannot run here, one line saying
why."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core import dense, loops
from ..tools.iomodel import Problem, key_major_forward_io, query_major_forward_io, standard_forward_io

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
# max |O - float64 dense| and |lse - float64 dense| a rung may show; two rungs may differ by the sum of theirs.
# TF32 (the tutorial kernel's float32 tl.dot on a GPU) keeps float16's 10 mantissa bits: float16's tolerance.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}
TRITON_EXTRA = "pip install 'flashattn-teach[triton]'"

CPU = torch.device("cpu")
Forward = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]  # (q, k, v) -> (O, lse)


@dataclass(frozen=True)
class Inputs:
    """The one problem every rung solves: ``q, k, v (B, H, N, D)`` on the CPU."""

    q: Tensor
    k: Tensor
    v: Tensor
    causal: bool
    block_m: int  # the loops' and the tutorial kernel's tile
    block_n: int

    def tolerance(self, tf32: bool = False) -> float:
        """:data:`TOLERANCE` of the inputs' dtype; float16's for float32 multiplied in TF32."""
        return TOLERANCE[torch.float16 if tf32 and self.q.dtype == torch.float32 else self.q.dtype]

    def problem(self) -> Problem:
        B, H, N, D = self.q.shape
        return Problem(B, H, N, D, elem_bytes=self.q.element_size(), causal=self.causal)


@dataclass(frozen=True)
class Rung:
    """A rung ready to run: its forward, its tile (None: it holds every score), its schedule's bytes, and
    how far from float64 dense its arithmetic may land."""

    forward: Forward
    tile: tuple[int, int] | None
    hbm_bytes: int
    tolerance: float
    device: torch.device  # where its inputs live: the CPU, or CUDA for a kernel on a GPU
    triton: bool = False  # a Triton kernel: on the CPU, in the interpreter (not timed)


# ----------------------------------------------------------------------------------------------- the rungs


def _dense(x: Inputs) -> Rung:
    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return dense.dense_attention(q, k, v, causal=x.causal)

    return Rung(forward, None, standard_forward_io(x.problem()).total_bytes, x.tolerance(), CPU)


def _query_major(x: Inputs) -> Rung:
    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return loops.query_major_attention(q, k, v, causal=x.causal, block_m=x.block_m, block_n=x.block_n)

    io = query_major_forward_io(x.problem(), x.block_m, x.block_n)
    return Rung(forward, (x.block_m, x.block_n), io.total_bytes, x.tolerance(), CPU)


def _key_major(x: Inputs) -> Rung:
    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return loops.key_major_attention(q, k, v, causal=x.causal, block_m=x.block_m, block_n=x.block_n)

    io = key_major_forward_io(x.problem(), x.block_m, x.block_n)
    return Rung(forward, (x.block_m, x.block_n), io.total_bytes, x.tolerance(), CPU)


def kernel_device() -> torch.device:
    """CUDA when there is a GPU and Triton is not interpreting; else the CPU, in the interpreter."""
    from ..triton.devices import interpreting

    return torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")


def triton_missing() -> str | None:
    """Why triton cannot be imported, as the rest of a one-line ``rung n name: ...`` that names the extra
    to install; or None."""
    try:
        import triton  # noqa: F401  (only whether it imports)
    except ImportError as e:
        if importlib.util.find_spec("triton") is None:
            return f"needs triton: {TRITON_EXTRA}"
        return f"not run: triton does not import ({e})"
    return None


def _kernel_reason(x: Inputs, device: torch.device) -> str | None:
    """Why the Triton kernels cannot run these inputs on ``device`` (the library's one answer), or None."""
    from ..triton import unsupported_reason

    missing = triton_missing()
    if missing is not None:
        return missing
    q, k, v = (t.to(device) for t in (x.q, x.k, x.v))
    reason = unsupported_reason(q, k, v, causal=x.causal)
    return None if reason is None else f"not run: {reason}"


def _tutorial(x: Inputs) -> Rung | str:
    device = kernel_device()
    reason = _kernel_reason(x, device)
    if reason is not None:
        return reason
    from ..core import kernel

    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return kernel.triton_forward(q, k, v, causal=x.causal, block_m=x.block_m, block_n=x.block_n)

    io = query_major_forward_io(x.problem(), x.block_m, x.block_n)
    tf32 = device.type == "cuda"  # its float32 tl.dot runs in TF32 on a GPU (core/kernel.py)
    return Rung(forward, (x.block_m, x.block_n), io.total_bytes, x.tolerance(tf32), device, triton=True)


def production_tile(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of the forward the library launches for plain ``(B, H, N, D)`` inputs: the
    shipped configuration (the test configuration in the interpreter) as ``triton.launch.forward`` narrows it
    (warp-specialised, else by TMA or by pointers)."""
    from .._validate.inputs import validate_inputs
    from ..triton.configs import lane_groups
    from ..triton.launch import default_config
    from ..triton.tma import forward_tile, launch_tile
    from ..triton.variants import PLAIN

    s = validate_inputs(q, k, v)
    tile, ws = forward_tile(default_config(q, s).forward, q, k, v, PLAIN)
    if not ws:
        _, split_lanes = lane_groups(s.D)
        tile = tile.by_pointers() if split_lanes else launch_tile(tile, k, v, varlen=False)[0]
    return tile.BLOCK_M, tile.BLOCK_N


def _production(x: Inputs) -> Rung | str:
    device = kernel_device()
    reason = _kernel_reason(x, device)
    if reason is not None:
        return reason
    from ..triton import triton_attention

    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        O, lse = triton_attention(q, k, v, causal=x.causal, return_lse=True)
        return O, lse

    tile = production_tile(*(t.to(device) for t in (x.q, x.k, x.v)))
    io = query_major_forward_io(x.problem(), *tile)  # float32 multiplies in tf32x3: float32's accuracy
    return Rung(forward, tile, io.total_bytes, x.tolerance(), device, triton=True)


# name -> how to build it; a builder returns the rung, or why it cannot run (one line)
RUNGS: dict[str, Callable[[Inputs], Rung | str]] = {
    "dense": _dense,
    "query-major loop": _query_major,
    "key-major loop": _key_major,
    "tutorial kernel": _tutorial,
    "production kernel": _production,
}
