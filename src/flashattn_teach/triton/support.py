"""Whether the fused kernels can run a call, and if not, why: the one answer the planner
(:mod:`flashattn_teach.dispatch`), ``explain`` and the launchers give; and, for ``explain``, which forward
configuration a call launches. Never imports triton (:func:`forward_kernel_note` does, when asked); never
raises.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

from .._options import AttentionOptions
from .._validate.inputs import AttentionShapes, validate_inputs
from ..dropout import DropoutKey
from ..errors import AttentionError, BackendUnavailableError
from .configs import DTYPES, _triton_version, lane_groups, max_head_dim
from .devices import device_reason, interpreter_dtype_reason, needs_grad, shape_reason
from .launch import default_config, to_4d
from .provenance import grid_note, off_note, ran_note, untried_note
from .tma import forward_tile, launch_tile, ws_reason
from .variants import CAPTURE_SLOTS, NO_DROPOUT, SUPPORTED, KernelVariants


@functools.cache
def triton_installed() -> bool:
    """Asked once per process: a decode loop asks at every step."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


# tl.range(..., warp_specialize=) and tl.make_tensor_descriptor, which every forward build names, came in 3.4
MIN_TRITON = (3, 4)


@functools.cache
def triton_reason() -> str | None:
    """Why the installed triton cannot build the kernels (absent, or older than :data:`MIN_TRITON`), or None.
    A triton without package metadata (a source tree on the path) is given the benefit of the doubt. Asked
    once per process, as :func:`triton_installed`."""
    if not triton_installed():
        return "triton is not installed"
    version = _triton_version()
    if version != (0, 0) and version < MIN_TRITON:
        return (
            f"the installed triton {version[0]}.{version[1]} is older than the {MIN_TRITON[0]}.{MIN_TRITON[1]} the "
            "kernels need (warp_specialize in tl.range, in-kernel tensor descriptors): pip install 'triton>=3.4'"
        )
    return None


def unsupported_reason(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, causal_align: str = "top_left", enable_gqa: bool = False
) -> str | None:
    """None if the Triton kernels can run these inputs, else a short reason. Never raises."""
    try:
        s = validate_inputs(q, k, v, causal_align=causal_align, enable_gqa=enable_gqa)
    except AttentionError as e:  # invalid inputs are a reason too; the caller decides whether to raise
        return str(e)
    return shapes_unsupported_reason(q, k, v, s)


def shapes_unsupported_reason(q: Tensor, k: Tensor, v: Tensor, s: AttentionShapes) -> str | None:
    """:func:`unsupported_reason` for inputs already validated into ``s``."""
    return triton_reason() or device_reason(q) or shape_reason(q, s, needs_grad(q, k, v))


def variants_unsupported_reason(opts: AttentionOptions, device: torch.device | None = None) -> str | None:
    """None if the kernels honour every variant of the call's mask contract, else which they lack (packed
    sequences are the varlen launch's, :func:`call_unsupported_reason`). ``device``: the query's, where the
    user functions' captured tensors must be."""
    missing = [name for name in opts.mask.variants if name not in SUPPORTED]
    if missing:
        return f"{', '.join(missing)} not yet in the Triton kernels"
    return mods_unsupported_reason(opts, device)


def mods_unsupported_reason(opts: AttentionOptions, device: torch.device | None = None) -> str | None:
    """None if the kernels can run the call's score_mod and mask_mod (``opts.mask.mods``), else why they run
    on the CPU reference: a captured tensor that requires grad, a function the translator does not take
    (:func:`flashattn_teach.triton.usermod.unsupported_reason` names the operation and the line), more
    captured tensors than the kernels' slots, one on another device than ``device`` (the query's, when
    given), or packed sequences. Never raises; imports triton only to
    translate a function. (The decode kernel never sees a score_mod: the planner sends such steps here.)"""
    mods = opts.mask.mods
    if mods is None or (mods.score_mod is None and mods.mask_mod is None):
        return None
    if opts.mask.packed is not None or "cu_seqlens" in opts.mask.variants:
        return "score_mod and mask_mod with packed sequences are not in the Triton kernels"
    for kind, fn, captures in (
        ("score_mod", mods.score_mod, tuple(mods.captures)),
        ("mask_mod", mods.mask_mod, tuple(mods.mask_captures)),
    ):
        if fn is None:
            continue
        if kind == "score_mod" and mods.grad_captures and torch.is_grad_enabled():
            return "score_mod captures a tensor that requires grad: learned biases' gradients run on the CPU reference"
        if len(captures) > CAPTURE_SLOTS:
            return f"{kind} captures {len(captures)} tensors, more than the {CAPTURE_SLOTS} the Triton kernels take"
        elsewhere = [t for t in captures if device is not None and t.device != device]
        if elsewhere:
            return (
                f"{kind} captures a tensor on {elsewhere[0].device} and the kernels read it on {device}: move it "
                "there (.to(q.device))"
            )
        try:
            from .usermod import unsupported_reason as translation_reason
        except ImportError as e:  # a triton too old to import the translator
            return f"{kind} cannot be compiled into the Triton kernels: {e}"
        reason = translation_reason(fn, captures, kind)
        if reason is not None:
            return reason
    return None


def call_unsupported_reason(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions) -> str | None:
    """None if the kernels can run this checked call, packed sequences (``(H, total, D)`` views) included,
    else a short reason."""
    reason = shapes_unsupported_reason(q, k, v, opts.shapes)
    if reason is not None:
        return reason
    missing = [name for name in opts.mask.variants if name not in SUPPORTED and name != "cu_seqlens"]
    if missing:
        return f"{', '.join(missing)} not yet in the Triton kernels"
    return mods_unsupported_reason(opts, q.device)


def refuse_unsupported(
    q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, *, who: str = "backend='triton'"
) -> None:
    """Raise :class:`~flashattn_teach.errors.BackendUnavailableError` (a ``ValueError`` and a
    ``NotImplementedError``) with :func:`call_unsupported_reason` when the kernels cannot run this checked
    call: the one place that question is asked before a launch (the planner for ``backend="triton"``,
    :func:`flashattn_teach.triton.triton_attention` for its own calls); the launch trusts it."""
    reason = call_unsupported_reason(q, k, v, opts)
    if reason is not None:
        raise BackendUnavailableError(f"{who} cannot run this call: {reason}")


def decode_unsupported_reason(q: Tensor, v_cache: Tensor) -> str | None:
    """None if the decode kernels can run these inputs (checked by :mod:`flashattn_teach.serving.checks`), else
    why not. Never raises."""
    reason = triton_reason() or device_reason(q)
    if reason is not None:
        return reason
    if q.dtype not in DTYPES:
        return f"the Triton decode kernel supports float16, bfloat16 and float32, got {q.dtype}"
    interpreter = interpreter_dtype_reason(q)
    if interpreter is not None:
        return interpreter
    if v_cache.dtype != q.dtype:  # torch.autocast cast q but not the caches, which are the caller's storage
        return (
            f"the Triton decode kernel reads the caches in q's dtype, but under torch.autocast q is {q.dtype} "
            f"and the caches {v_cache.dtype}"
        )
    top = max_head_dim(q.dtype, backward=False)
    for name, d in (("D", q.shape[3]), ("D_v", v_cache.shape[3])):
        if not 1 <= d <= top:
            dtype = str(q.dtype).removeprefix("torch.")
            return f"the Triton decode kernel for {dtype} supports head dimensions 1 to {top}, got {name}={d}"
    return None


def forward_kernel_note(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions) -> str:
    """For ``explain``: the forward configuration the kernels launch for this checked call (the shipped
    one), whether its loop is warp-specialised, or why not, and whether a GPU has run that path, its grid
    order and the call's options (:mod:`.provenance`). Imports triton."""
    s = opts.shapes
    untried = [*opts.mask.variants] + ["dropout"] * (opts.dropout_p > 0.0) + ["sinks"] * (opts.sinks is not None)
    untried += ["a split head dim (two lane groups)"] * (lane_groups(s.D)[1] > 0)
    if opts.mask.packed is not None:
        return "; forward not warp-specialised: packed sequences (a program may end early)" + untried_note(untried)
    dropout = DropoutKey(p=opts.dropout_p) if opts.dropout_p > 0.0 else NO_DROPOUT  # a stand-in: nothing drawn
    variants = KernelVariants.from_spec(opts.mask, dropout)
    q4, k4, v4 = to_4d(q, s, s.H_q), to_4d(k, s, s.H_kv), to_4d(v, s, s.H_kv)
    config = default_config(q4, s, variants)
    grid = f"; {grid_note(config)}" if opts.causal else ""
    tile, ws = forward_tile(config.forward, q4, k4, v4, variants)
    compiled = _compiled_note(variants)
    if ws:
        return (
            f"; forward {tile}: warp-specialised (a producer warpgroup issues the TMA copies, two consumer "
            f"warpgroups of 64 query rows compute), {ran_note('warp-specialised forward')}{grid}"
            + untried_note(untried)
        )
    tile, tma = launch_tile(tile, k4, v4, varlen=False)
    row = default_config(q4, s, variants, tried=False).forward  # the table's, before the switches
    if row.ws and ws_reason(row, q4, k4, v4, variants) is None:
        why = off_note("warp_specialize")
    else:
        why = f"not warp-specialised: {ws_reason(config.forward, q4, k4, v4, variants)}"
    path = ran_note("forward by TMA" if tma else "forward through pointers")
    return f"; forward {tile}{compiled}: {why}; {path}{grid}" + untried_note(untried)


def _compiled_note(variants: KernelVariants) -> str:
    """For ``explain``: which of the user's functions are compiled into the kernels."""
    names = [
        name
        for name, used in (
            ("score_mod", variants.score_mod is not None),
            ("its derivative by the score", variants.score_grad_fn is not None),
            ("mask_mod", variants.mask_mod is not None),
        )
        if used
    ]
    note = ""
    if names:
        note = f" with {', '.join(names)} compiled in (flashattn_teach.triton.generated_sources prints them)"
    if variants.block_mask is not None:
        note += ", the block mask's tile kinds read per tile (SKIP tiles not visited, mask_mod on PARTIAL ones only)"
    return note
