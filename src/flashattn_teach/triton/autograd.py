"""Autograd glue: the fused forward and the backward kernels as one differentiable function.

Saved for backward: ``q, k, v, O, lse`` only (O(N) memory, and the attention sinks, ``(H_q,)``); ``P`` is
recomputed by the backward kernels, and ``dsink`` comes from ``lse`` and ``delta``.
The function has the ``setup_context`` form (a ``forward`` without ``ctx``), so ``torch.func.vjp`` sees
through it. Caveats: there is no vmap rule, and ``torch.func.grad`` fails, because inside that transform
the backward receives functorch's wrapper tensors, whose storage a Triton launch cannot read.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._layout import grad_to_input
from .._options import AttentionOptions
from ..dropout import DropoutKey
from ..errors import AttentionValueError
from ..sinks import sink_grad
from .configs import AttentionConfig, fused_backward
from .launch import backward as launch_backward
from .launch import default_config, to_4d
from .launch import forward as launch_forward
from .provenance import off_note, ran_note
from .variants import PLAIN, KernelVariants


def deterministic_backward(requested: bool) -> tuple[bool, str]:
    """Whether the backward runs the deterministic (two-kernel) path, and why: ``requested`` (the call's
    ``deterministic``), or torch's global flag, read when the backward runs, as torch's kernels read it.
    ``warn_only=True`` changes nothing here: torch's rule is that it turns the error of an operation with *no*
    deterministic implementation into a warning, and this backward has one, so it runs it in both modes.
    """
    if requested:
        return True, "deterministic=True"
    if torch.are_deterministic_algorithms_enabled():
        return True, "torch.use_deterministic_algorithms(True)"
    return False, "deterministic=False"


def explain_backward(q: Tensor, opts: AttentionOptions) -> str:
    """Which backward a Triton call would run, and why, for :func:`flashattn_teach.explain` (the global
    flag as it is now; the backward reads it again when it runs)."""
    dropout = DropoutKey(opts.dropout_p, seed=0) if opts.dropout_p > 0.0 else DropoutKey()
    variants = KernelVariants.from_spec(opts.mask, dropout)
    packed = opts.mask.packed
    if packed is not None:  # packed sequences take the variant rows, as triton_varlen_forward's call does
        variants = replace(variants, cu_seqlens_q=packed.cu_q_t, cu_seqlens_k=packed.cu_k_t)
    config = default_config(q, opts.shapes, variants)
    if config.backward_dkdv is None or config.backward_dq is None:
        return "; no backward ships for this head dimension and dtype"
    deterministic, why = deterministic_backward(opts.deterministic)
    row = default_config(q, opts.shapes, variants, tried=False)  # the table's, before the switches
    tma = config.backward_dkdv.tma or config.backward_dq.tma
    ran = ran_note("two-kernel backward by TMA" if tma else "two-kernel backward through pointers")
    if not tma and row.backward_dkdv is not None and row.backward_dq is not None:
        ran += f"; {off_note('backward_tma')}" if row.backward_dkdv.tma or row.backward_dq.tma else ""
    two = f"; backward: two kernels (dK/dV, then dQ), bitwise reproducible ({ran})"
    if deterministic:
        return f"{two}, as {why} asks"
    if config.backward_fused is None:
        if row.backward_fused is not None:
            return f"{two}: {off_note('fused_backward')}"
        kind = "calls with variants, dropout or packed sequences" if variants.used else "this head dimension"
        return f"{two}: no one-kernel tile is compile-checked for {kind} on this GPU and dtype"
    if not fused_backward(config, deterministic, opts.shapes.N_q):
        return (
            f"{two}: N_q = {opts.shapes.N_q} queries do not fill the one-kernel tile's {config.backward_fused.BLOCK_M} "
            "rows (every key block would add dQ into one partial tile; triton 3.6's ptxas crashes on such a build)"
        )
    how = "deterministic=True or torch.use_deterministic_algorithms(True) runs the two-kernel backward"
    return (
        "; backward: one kernel per key block, dQ added in fp32 by atomics, not bitwise reproducible "
        f"({how if why == 'deterministic=False' else why}; {ran_note('one-kernel backward')})"
    )


class TritonLaunch(NamedTuple):
    """What the kernels launch with beyond the call's options: the block sizes, warps and stages, and the
    call's variants as the kernels' flags and arguments (built once, by
    :func:`flashattn_teach.triton.triton_forward`)."""

    config: AttentionConfig
    variants: KernelVariants = PLAIN


class TritonAttentionFunction(torch.autograd.Function):
    """``(q, k, v, opts, launch, sinks) -> (O, lse)`` in the user's layout; backward also accepts a gradient
    into ``lse``. The options and the launch travel whole; ``sinks`` (``opts.sinks``) is an input so that
    autograd gives it a gradient."""

    @staticmethod
    def forward(
        q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, launch: TritonLaunch, sinks: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        s = opts.shapes
        q4, k4, v4 = to_4d(q, s, s.H_q), to_4d(k, s, s.H_kv), to_4d(v, s, s.H_kv)
        o4, lse3 = launch_forward(
            q4,
            k4,
            v4,
            s,
            causal=opts.causal,
            causal_align=opts.causal_align,
            config=launch.config,
            variants=launch.variants,
            sinks=sinks,
        )
        # (B, H_q, N_q, D_v) -> (*batch, H_q, N_q, D_v): a view, as is the lse's
        return o4.reshape(s.out_shape), lse3.reshape(s.lse_shape)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        q, k, v, opts, launch, sinks = inputs
        O, lse = output
        ctx.save_for_backward(q, k, v, O, lse, sinks)
        ctx.opts, ctx.launch = opts, launch
        ctx.capture_versions = [t._version for t in _captures(launch.variants)]
        # a loss of O alone passes dlse = None rather than zeros, and the backward skips its subtraction
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, dO: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, O, lse, sinks = ctx.saved_tensors
        opts: AttentionOptions = ctx.opts
        launch: TritonLaunch = ctx.launch
        s = opts.shapes
        # The kernels need no sink: they recompute P_ij = exp(S_ij - lse_i) from the saved lse, which holds
        # it; the sink's own gradient is O(B H N) work on lse and delta (online_softmax.sink_grad).
        dsink = sink_grad(sinks, lse, O, dO, dlse) if sinks is not None and ctx.needs_input_grad[5] else None
        q4, k4, v4 = to_4d(q, s, s.H_q), to_4d(k, s, s.H_kv), to_4d(v, s, s.H_kv)
        o4 = to_4d(O, s, s.H_q)
        lse3 = lse.reshape(o4.shape[:3])  # (B, H_q, N_q)
        do4 = torch.zeros_like(o4) if dO is None else to_4d(dO, s, s.H_q)
        dlse3 = None if dlse is None else dlse.reshape(lse3.shape)
        deterministic, _ = deterministic_backward(opts.deterministic)
        if [t._version for t in _captures(launch.variants)] != ctx.capture_versions:
            raise AttentionValueError(
                "a tensor score_mod or mask_mod captures was modified in place between the forward and the "
                "backward; the backward kernels read it again, so keep it unchanged until backward (or clone it "
                "for the call)"
            )
        dq4, dk4, dv4 = launch_backward(
            q4,
            k4,
            v4,
            o4,
            lse3,
            do4,
            dlse3,
            s,
            causal=opts.causal,
            causal_align=opts.causal_align,
            config=launch.config,
            variants=launch.variants,
            deterministic=deterministic,
        )
        # (B, H, N, X) -> (B, H, 1, N, X), the grouped layout grad_to_input undoes broadcasting from
        dq = grad_to_input(dq4.unsqueeze(2), q, s)
        dk = grad_to_input(dk4.unsqueeze(2), k, s)
        dv = grad_to_input(dv4.unsqueeze(2), v, s)
        return dq, dk, dv, None, None, dsink  # no gradient for opts and launch


def _captures(variants: KernelVariants) -> list[Tensor]:
    """The tensors the compiled user functions read, which the backward kernels read again."""
    return [t for mod in (variants.score_mod, variants.mask_mod) if mod is not None for t in mod.captures]
