"""Which backend runs a call, and why: the one choice every public function, ``explain`` and the compiled
ops' eager bodies ask for.

Backends:
    "triton"     fused Triton kernels (CUDA tensors; see :mod:`flashattn_teach.triton`), packed sequences
                 included; a decode step takes the split-KV decode kernel (:func:`plan_decode`)
    "parallel"   query-major tiles, the (batch, head) slices spread over worker threads (the fast CPU path)
    "query_major"  query-major online-softmax CPU reference: the readable tile-by-tile loop (``"online"``,
                 its old name, is accepted with a ``DeprecationWarning``: "online" also names the update and
                 the module of entry points)
    "key_major"  key-major reference, FlashAttention's Algorithm 1 loop order
    "dense"      the dense oracle: holds all N_q x N_k scores

``backend="auto"`` picks the fastest backend that can honour every argument; an explicitly named backend
that cannot honour an argument raises :class:`~flashattn_teach.errors.BackendUnavailableError` (a
``NotImplementedError``) instead of silently doing something else.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from types import FrameType

import torch
from torch import Tensor
from torch.autograd import forward_ad

from .._options import AttentionOptions
from ..errors import AttentionValueError, BackendUnavailableError
from ..reference import parallel
from ..reference.autograd import TileLoop
from ..reference.defaults import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N, PARALLEL_BLOCK_M, PARALLEL_BLOCK_N
from ..reference.workers import default_workers
from ..triton import support

BACKENDS = ("auto", "triton", "parallel", "query_major", "key_major", "dense")
RENAMED = {"keymajor": "key_major", "online": "query_major"}  # deprecated names still accepted, with a warning
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # warnings skip it
# The tiled CPU backends: their loop order and tile sizes.
TILED = {
    "parallel": TileLoop("parallel", PARALLEL_BLOCK_M, PARALLEL_BLOCK_N),
    "query_major": TileLoop("query_major", DEFAULT_BLOCK_M, DEFAULT_BLOCK_N),
    "key_major": TileLoop("key_major", DEFAULT_BLOCK_M, DEFAULT_BLOCK_N),
}
# A call with few query rows (a decode step, after folding query heads into rows) takes wide key tiles:
# fewer tiles are fewer Python-level ops per row, and its score tiles stay small (benchmarks/README.md).
FEW_ROWS = 64
FEW_ROWS_BLOCK_N = 2048
# The parallel path's tiles under a block mask: two of its 128-row blocks by one of its key blocks (on two
# cores, causal and document masks at N = 1024 to 4096 ran in about half the time of 1024 x 256 tiles).
USER_MASK_TILES = (256, 128)


@dataclass(frozen=True)
class Plan:
    """Which backend runs a call, and why."""

    backend: str
    reason: str

    def __str__(self) -> str:
        return f"{self.backend}: {self.reason}"


def transforms_active() -> bool:
    """Whether a torch.func transform (grad, vmap, jvp, ...) is running around this call."""
    return bool(torch._C._are_functorch_transforms_active())


def check_backend(backend: object) -> str:
    """``backend`` as one of :data:`BACKENDS`, for every public function: a deprecated spelling warns,
    pointing at the caller's line outside this package, and becomes its new name; anything else raises."""
    if isinstance(backend, str) and backend in RENAMED:
        new = RENAMED[backend]
        frame: FrameType | None = sys._getframe(1)
        level = 2  # the caller of this function
        while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            frame, level = frame.f_back, level + 1
        warnings.warn(f"backend={backend!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=level)
        return new
    if backend not in BACKENDS:
        raise AttentionValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return str(backend)


def public_backend(backend: object) -> str:
    """:func:`check_backend` for a public function; while compiling, a deprecated spelling is passed on as
    it is, and the op warns when it runs (dynamo cannot trace the warning's walk over the frames)."""
    if isinstance(backend, str) and backend in RENAMED and torch.compiler.is_compiling():  # the cheap question first
        return backend
    return check_backend(backend)


def tiles(backend: str, N_q: int, *, block_mask: bool = False) -> TileLoop:
    """``TileLoop(order, block_m, block_n)`` of a tiled backend for ``N_q`` query rows: few rows take key tiles of
    at least ``FEW_ROWS_BLOCK_N``; with a block mask (a ``mask_mod``) the parallel path takes
    ``USER_MASK_TILES``, so that its tiles can be skipped (its own ``1024``-row tiles would span eight of
    the mask's blocks, and be skipped only where all eight are)."""
    order, block_m, block_n = TILED[backend]  # tests set plain (order, block_m, block_n) tuples
    if N_q <= FEW_ROWS:
        return TileLoop(order, block_m, max(block_n, FEW_ROWS_BLOCK_N))
    if block_mask and backend == "parallel":
        return TileLoop(order, *USER_MASK_TILES)
    return TileLoop(order, block_m, block_n)


def batched(backend: str, opts: AttentionOptions) -> bool:
    """Whether a ``parallel`` call is too small for the pool (fewer than ``MIN_PARALLEL_SCORES`` scores):
    the runner then runs every head at once in one query-major loop (:mod:`flashattn_teach.dispatch.runner`),
    and the plan says so."""
    if backend != "parallel":
        return False
    s = opts.shapes
    scores = s.H_q * s.N_q * s.N_k
    for n in s.batch:
        scores *= n
    return scores < parallel.MIN_PARALLEL_SCORES


_BATCHED = "; fewer than 2^{} scores, too few for the worker threads: every (batch, head) slice at once, in one loop"


def dense_only(opts: AttentionOptions) -> str | None:
    """Why only the dense path can run this call, or None."""
    tensors = (("attn_mask", opts.attn_mask), ("alibi_slopes", opts.mask.alibi_slopes))
    differentiated = [name for name, t in tensors if t is not None and t.requires_grad]
    if differentiated:
        return f"{' and '.join(differentiated)} requires grad, which only the dense path differentiates"
    if opts.attn_mask is not None and transforms_active():
        return "an attn_mask under a torch.func transform is only supported by the dense path"
    if opts.mask.mods is not None and (transforms_active() or forward_ad._current_level >= 0):
        return "score_mod and mask_mod under a torch.func transform or forward-mode AD run on the dense path only"
    return None


def plan(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, backend: str = "auto") -> Plan:
    """Choose a backend for checked inputs; raises ``NotImplementedError`` for a named backend that cannot run
    the call. A plain call's plan is kept with its options (:func:`_memo_key`)."""
    if backend != "auto":  # the default needs no check (public functions checked theirs already)
        backend = check_backend(backend)
    key = _memo_key(q, opts, backend)
    if key is None:
        return _plan(q, k, v, opts, backend)
    p = opts.memo.get(key)
    if p is None:
        p = opts.memo[key] = _plan(q, k, v, opts, backend)
    return p


def _memo_key(q: Tensor, opts: AttentionOptions, backend: str) -> tuple[object, ...] | None:
    """The key of a CPU call's plan in ``opts.memo``: what the plan reads besides the options, when that is
    all it reads. None (plan every time) for CUDA tensors and ``"triton"`` (the support questions read the
    tensors), for an ``attn_mask``, ALiBi slopes or user functions (whether they require grad, and under
    which transform, may change between calls), and while compiling (torch.compile would guard on the memo)."""
    spec = opts.mask
    if backend == "triton" or not q.is_cpu or spec.attn_mask is not None or spec.alibi_slopes is not None:
        return None
    if spec.mods is not None or torch.compiler.is_compiling():
        return None
    return ("plan", backend, transforms_active(), default_workers(), parallel.MIN_PARALLEL_SCORES)


def _plan(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, backend: str) -> Plan:
    """:func:`plan`'s choice, made."""
    needs_dense = dense_only(opts)
    if backend == "auto":
        if needs_dense:
            return Plan("dense", needs_dense + " (it holds all N_q x N_k scores)")
        if q.is_cuda:
            why_not = support.call_unsupported_reason(q, k, v, opts)
            if why_not is None:
                return Plan("triton", "CUDA tensors: the fused Triton kernels")
            return Plan("query_major", f"CUDA tensors, but the Triton path cannot run them: {why_not}")
        if transforms_active():
            return Plan(
                "query_major",
                "a torch.func transform is active: the query-major reference in this thread "
                "(the parallel path's worker threads would not see the transform)",
            )
        variants = ", ".join(opts.mask.variants)
        masked = f"; {variants} read tile by tile" if variants else ""
        if batched("parallel", opts):
            small = _BATCHED.format(parallel.MIN_PARALLEL_SCORES.bit_length() - 1)
            return Plan("parallel", f"{q.device.type} tensors: query-major tiles{small}{masked}")
        return Plan(
            "parallel",
            f"{q.device.type} tensors: query-major tiles, the (batch, head) slices spread over "
            f"{default_workers()} single-threaded workers{masked}",
        )
    if needs_dense and backend != "dense":
        raise BackendUnavailableError(f"backend={backend!r} cannot run this call: {needs_dense}; use 'dense' or 'auto'")
    if backend == "triton":
        support.refuse_unsupported(q, k, v, opts)  # asked here once; the launch trusts the plan
    if backend == "parallel" and transforms_active():
        raise BackendUnavailableError(
            "backend='parallel' cannot run under a torch.func transform (its worker threads would not see "
            "it); use 'query_major' or 'auto'"
        )
    small = _BATCHED.format(parallel.MIN_PARALLEL_SCORES.bit_length() - 1) if batched(backend, opts) else ""
    return Plan(backend, "requested explicitly" + small)


def backward_note(p: Plan, q: Tensor, opts: AttentionOptions) -> str:
    """What :func:`flashattn_teach.explain` adds about the backward of a planned call: on the Triton path
    which backward runs and why; on the others, with ``deterministic=True``, that theirs already is."""
    if p.backend == "triton":
        from ..triton.autograd import explain_backward

        return explain_backward(q, opts)
    if opts.deterministic:
        return "; deterministic=True: this backend's backward is deterministic already (a fixed loop order)"
    return ""


def plan_decode(backend: str, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Plan:
    """The path of a decode step: ``Plan("triton", ...)`` for the split-KV decode kernel, else the CPU
    paths' ``backend`` for every key range (refined per range by :func:`plan_ranges`). ``"auto"`` takes the
    kernel for CUDA tensors it can run when no gradient is wanted (it is forward only) and no torch.func
    transform is active."""
    if backend == "triton":
        reason = support.decode_unsupported_reason(q, v_cache)
        if reason is not None:
            raise BackendUnavailableError(f"backend='triton' cannot run this decode call: {reason}")
        return Plan("triton", "requested explicitly: the Triton split-KV decode kernel")
    if backend == "auto" and q.is_cuda and not transforms_active():
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache))
        if not grads and support.decode_unsupported_reason(q, v_cache) is None:
            return Plan("triton", "CUDA tensors: the Triton split-KV decode kernel")
    return Plan(backend, "the CPU paths, one key range at a time")


def plan_ranges(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, backend: str) -> Plan:
    """The plan of a decode step's key ranges on a CPU path: the prefill kernels do not take a range's
    diagonal offset (the decode kernel is chosen before, by :func:`plan_decode`)."""
    p = plan(q, k, v, opts, backend)
    if p.backend == "triton":
        return Plan("query_major", "CUDA tensors on a CPU path: the query-major reference")
    return p
