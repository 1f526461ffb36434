"""Whether the Triton kernels can run a call at all: the device (CUDA, or the CPU under ``TRITON_INTERPRET=1``),
the dtype and head dimension the shipped kernels take, and whether autograd will want the backward. The
launchers, :mod:`.support` and :mod:`.autotune` ask these before anything is launched; and every launcher
launches on its tensors' device (:func:`launches_on_device`, :func:`device_guard`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

import torch
from torch import Tensor

from .._validate.inputs import AttentionShapes
from .configs import DTYPES, MIN_HEAD_DIM, max_head_dim


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_reason(t: Tensor) -> str | None:
    """Why a tensor's device cannot run the Triton kernels, or None."""
    if t.device.type == "cuda":
        return None
    if t.device.type == "cpu" and interpreting():
        return None
    return f"the Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {t.device}"


def interpreter_dtype_reason(t: Tensor) -> str | None:
    """Why the interpreter cannot run a kernel on ``t``'s dtype, or None: triton's interpreter multiplies
    bfloat16 tiles wrongly (a 16 x 16 ``tl.dot`` of bfloat16 tiles is off by about 1e10 with triton 3.9),
    with no error, so a bfloat16 call on CPU tensors is refused rather than answered."""
    if t.dtype == torch.bfloat16 and t.device.type == "cpu" and interpreting():
        return (
            "triton's interpreter (TRITON_INTERPRET=1) computes bfloat16 dot products wrongly, without an "
            "error; run bfloat16 on a GPU, or float16 or float32 in the interpreter"
        )
    return None


def shape_reason(q: Tensor, s: AttentionShapes, needs_grad: bool) -> str | None:
    """Why a dtype or head dimension is outside what the shipped kernels support, or None."""
    if q.dtype not in DTYPES:
        return f"the Triton kernels support float16, bfloat16 and float32, got {q.dtype}"
    interpreter = interpreter_dtype_reason(q)
    if interpreter is not None:
        return interpreter
    top = max_head_dim(q.dtype, backward=needs_grad)
    for name, d in (("D", s.D), ("D_v", s.D_v)):
        if not MIN_HEAD_DIM <= d <= top:
            what = "forward and backward" if needs_grad else "forward"
            return (
                f"the Triton {what} for {str(q.dtype).removeprefix('torch.')} supports head dimensions "
                f"{MIN_HEAD_DIM} to {top}, got {name}={d}"
            )
    return None


def needs_grad(*tensors: Tensor) -> bool:
    """Whether autograd will ask for the backward of a call on these tensors."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


P = ParamSpec("P")
R = TypeVar("R")


def device_guard(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """``torch.cuda.device(device)`` for a CUDA device, else nothing to enter. A Triton launch goes to the
    *current* CUDA device (its stream, and the scratch memory of in-kernel descriptors, are the current
    device's), so tensors on another GPU would be read from the wrong one: an illegal memory access."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def launches_on_device(
    launcher: Callable[Concatenate[torch.Tensor, P], R],
) -> Callable[Concatenate[torch.Tensor, P], R]:
    """``launcher(q, ...)`` run inside :func:`device_guard` of ``q``'s device: every kernel it launches (and
    every scratch buffer Triton asks for) goes to that GPU, whichever is current."""

    @functools.wraps(launcher)
    def on_device(q: torch.Tensor, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with device_guard(q.device):
            return launcher(q, *args, **kwargs)

    return on_device
