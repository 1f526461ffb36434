"""Reading tiles through Hopper's tensor memory accelerator (TMA): when it is allowed, and which tile runs.

A kernel configuration with ``tma=True`` asks for the tiles that stream through a loop to arrive by TMA
from tensor descriptors: the forward's and dQ's key/value blocks, the dK/dV kernel's query and output-
gradient blocks. The copy engine then computes every address, so the loop holds no address registers;
some tiles fit in registers only that way, and name in ``fallback`` the tile to run when TMA cannot be used
(a stride the copy engine cannot describe, packed sequences).

A forward configuration with ``ws=True`` asks for more: triton's warp specialiser splits its key loop
between a producer warpgroup, which issues the copies, and two consumer warpgroups, which compute
(:func:`forward_tile` says where it runs). Its descriptors are made inside the kernel, each program
writing its own into global scratch memory (128 bytes a descriptor) that triton's allocator provides:
:func:`ensure_scratch_allocator` installs one drawing from torch's caching allocator, but only where the
caller has not set one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .configs import KernelConfig
from .variants import KernelVariants


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


def ws_reason(c: KernelConfig, q: Tensor, k: Tensor, v: Tensor, variants: KernelVariants) -> str | None:
    """Why a forward call cannot run ``c`` warp-specialised, or None: it needs ``c.ws``, 16-bit inputs on an
    sm_90 GPU (or the interpreter), a triton with in-kernel tensor descriptors, queries, keys and values TMA can
    read (:func:`tma_reason`), and none of the variants whose loop the pass does not take: packed
    sequences (a program may return early), an ``attn_mask`` and dropout (pointer loads and a longer
    loop body)."""
    if not c.ws:
        return "the configuration does not ask for it (ws=False)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{q.dtype} inputs (the specialised loop is built for float16 and bfloat16)"
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the GPU is not sm_90 (the pass that specialises it is Hopper's)"
    unsupported = [name for name, used in _ws_variants(variants) if used]
    if unsupported:
        return f"{' and '.join(unsupported)} (the pass does not take that loop)"
    for name, t in (("query", q), ("key", k), ("value", v)):
        why = tma_reason(t)
        if why is not None:
            return f"the {name} tensor cannot be read by TMA: {why}"
    from triton import language as tl

    if not hasattr(tl, "make_tensor_descriptor"):
        return "the installed triton has no in-kernel tensor descriptors (tl.make_tensor_descriptor)"
    return None


def _ws_variants(variants: KernelVariants) -> tuple[tuple[str, bool], ...]:
    """(name, used) of the variants a warp-specialised forward does not run."""
    return (
        ("packed sequences", variants.varlen),
        ("an attn_mask", variants.bool_mask or variants.additive_mask),
        ("dropout", variants.has_dropout),
        ("a score_mod, mask_mod or block mask", variants.user_mods),
    )


def forward_tile(
    c: KernelConfig, q: Tensor, k: Tensor, v: Tensor, variants: KernelVariants
) -> tuple[KernelConfig, bool]:
    """``(configuration, warp-specialised)`` of a forward launch: ``c`` specialised where :func:`ws_reason`
    allows it, else ``c.unspecialised()``, which the launcher runs by :func:`launch_tile`'s rule."""
    if ws_reason(c, q, k, v, variants) is None:
        return c, True
    return c.unspecialised(), False


def ensure_scratch_allocator() -> None:
    """Give triton an allocator for kernel scratch memory (the in-kernel descriptors, 128 bytes each per
    program) unless one is set already: the caller's own ``triton.set_allocator`` is never replaced. Ours takes
    ``torch.empty(size, dtype=torch.int8)`` on the current CUDA device, which the launcher has made the
    tensors' (:func:`.devices.launches_on_device`), from torch's caching allocator, which also serves
    CUDA-graph capture. Triton keeps the allocator in a context variable, so a new
    thread starts without one and gets it on its first warp-specialised launch."""
    import triton
    from triton.runtime import _allocation

    # triton has no public getter: the unset state is its module's null allocator (so in 3.6 and 3.9)
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_torch_scratch)


def _torch_scratch(size: int, alignment: int, stream: int | None) -> Tensor:
    """Scratch memory for a kernel launch, from torch's caching allocator (whose blocks are aligned to at
    least 512 bytes, above any alignment triton asks for)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")  # the current device: the launch's (above)
