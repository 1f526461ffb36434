"""Where an FP8 (e4m3) call runs: the fused kernel on sm_90, the CPU emulation elsewhere.

An FP8 call is not an ordinary call in a narrow dtype: its scores carry descales and its weights are
rounded to e4m3 before the second product, so the tiled CPU backends' loops (which upcast once and round
nothing) would give a different answer. Every CPU backend name therefore runs the one emulation,
:func:`flashattn_teach.reference.fp8.fp8_forward`; ``"triton"`` (and ``"auto"`` on CUDA) runs the kernel
(:mod:`flashattn_teach.triton.fp8`), and a call the kernel cannot take on CUDA is refused by name, not moved
to the CPU behind the caller's back.
"""

from __future__ import annotations

from torch import Tensor

from .._autocast import autocast_off
from .._options import AttentionOptions
from ..errors import BackendUnavailableError
from ..reference.fp8 import fp8_forward
from ..triton.fp8 import fp8_unsupported_reason, triton_fp8_forward
from ..triton.provenance import ran_note
from .planner import Plan, check_backend

EMULATION = "the FP8 emulation (reference/fp8.py: e4m3 products in fp32, P rounded to e4m3)"


def plan_fp8(q: Tensor, opts: AttentionOptions, backend: str = "auto") -> Plan:
    """The backend of a checked FP8 call: ``triton`` for CUDA tensors (refused with the reason where the
    kernel cannot run them) or when asked for by name, else the named CPU backend running the emulation."""
    backend = check_backend(backend)
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        why_not = fp8_unsupported_reason(q, opts)
        if why_not is not None:
            raise BackendUnavailableError(f"backend={backend!r} cannot run this FP8 call: {why_not}")
        return Plan("triton", f"FP8 inputs: the fused kernel's e4m3 build (sm_90); {ran_note('FP8 forward')}")
    if q.is_cuda:
        return Plan(backend, f"requested explicitly: {EMULATION}, on {q.device}")
    return Plan("query_major" if backend == "auto" else backend, f"{q.device.type} tensors: {EMULATION}")


def run_fp8(p: Plan, q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of a checked FP8 call by its planned backend: ``O`` bfloat16, ``lse`` float32."""
    if p.backend == "triton":
        return triton_fp8_forward(q, k, v, opts)
    with autocast_off(q.device.type):  # the emulation's products are fp32, as the tensor cores' (not autocast's)
        return fp8_forward(q, k, v, opts)
