"""Reading tiles through Hopper's tensor memory accelerator (TMA): when it is allowed, and which tile runs.

A kernel configuration with ``tma=True`` asks for the tiles that stream through a loop to arrive by TMA
from tensor descriptors: the forward's and dQ's key/value blocks, the dK/dV kernel's query and output-
gradient blocks. The copy engine then computes every address, so the loop holds no address registers;
some tiles fit in registers only that way, and name in ``fallback`` the tile to run when TMA cannot be used
(a stride the copy engine cannot describe, packed sequences).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .configs import KernelConfig


def tma_reason(t: Tensor) -> str | None:
    """Why a ``(B, H, N, X)`` tensor cannot be read through a TMA tensor descriptor, or None: the copy
    engine needs a non-empty tensor, a unit innermost stride, and a 16-byte aligned base and outer
    strides; broadcast (stride-0) dimensions are left to the pointer path too."""
    size = t.element_size()
    if t.numel() == 0:
        return "it is empty (a descriptor needs a positive size in every dimension)"
    if 0 in t.stride()[:-1]:
        return f"strides {t.stride()} broadcast a dimension (stride 0), which has not run on a GPU by TMA"
    if t.stride(-1) != 1:
        return f"innermost stride is {t.stride(-1)}, not 1"
    if t.data_ptr() % 16:
        return "base address is not 16-byte aligned"
    bad = [st for st in t.stride()[:-1] if (st * size) % 16]
    if bad:
        return f"strides {t.stride()} are not multiples of 16 bytes"
    return None


def use_tma(c: KernelConfig, *tensors: Tensor) -> bool:
    """Whether a kernel reads ``tensors`` by TMA: asked for by the configuration, available in the
    installed triton, on a Hopper-or-newer GPU (or in the interpreter), and allowed by every tensor."""
    if not c.tma or any(tma_reason(t) is not None for t in tensors):
        return False
    if tensors[0].device.type == "cuda" and torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def launch_tile(c: KernelConfig, *tensors: Tensor, varlen: bool) -> tuple[KernelConfig, bool]:
    """The configuration to launch and whether it reads ``tensors`` by TMA: ``c`` by TMA where
    :func:`use_tma` allows it, else ``c.by_pointers()`` (its ``fallback``, or its own tile). Packed sequences
    (``varlen``) never use TMA: a sequence's rows end inside the tensor, where no descriptor box stops."""
    if not varlen and use_tma(c, *tensors):
        return c, True
    return c.by_pointers(), False


def descriptor(t: Tensor, block_n: int, block_x: int) -> Any:
    """A tensor descriptor of a ``(B, H, N, X)`` tensor whose box is one ``(block_n, block_x)`` tile."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_n, block_x])
