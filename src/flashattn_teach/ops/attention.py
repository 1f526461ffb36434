"""flashattn_teach as one torch operator, so ``torch.compile`` and ``torch.export`` see one node per call.

Traced through as Python, the tile loops unroll into the graph: every sequence length is a new graph, and
``torch.export`` with a dynamic length fails on the loop bounds. Registered with ``torch.library``, a call
is one opaque op whose output shapes come from a fake (meta) implementation, symbolic in every size, so one
graph serves all lengths. Eager calls do not go through here: :func:`flashattn_teach.flash_attention` and
:func:`flashattn_teach.scaled_dot_product_attention` use these ops only while being compiled or exported
(``torch.compiler.is_compiling()``), and eager behaviour, the torch.func transforms included, is unchanged.

    flashattn_teach::attention(q, k, v, <AttentionArgs>) -> (O, lse)
    flashattn_teach::attention_backward(dO, dlse, q, k, v, <AttentionArgs>) -> (dq, dk, dv)

:class:`AttentionArgs` names the arguments after ``q, k, v`` once: the op's schema is built from it
(``schema.py``), and the public function, the op, its fake and its backward all read it by name.

The op's eager body is the dispatcher's (checks, options, plan, :func:`flashattn_teach.dispatch.run`); the
backward op recomputes the forward under autograd and differentiates it (``grads.py``).

Dropout: an op must be a function of its inputs, so the call's dropout key cannot be drawn inside it. The
caller draws the seed as a tensor (:meth:`AttentionArgs.of_call`, the same ``torch.randint`` as the eager
:func:`flashattn_teach.dropout.draw`, but left in the graph rather than read into a Python int) and passes
it in; the op and its backward build ``DropoutKey(dropout_p, seed, offset=0)`` from it, so the backward
draws the forward's mask again (Dao et al. 2022, Alg. 4) and, where the compiled graph runs torch's own
``randint`` (``aot_eager``, or inductor with ``fallback_random``), the mask is eager's for the same seed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._layout import compute_dtype
from .._options import AttentionOptions, make_options
from .._validate.inputs import check_dropout, validate_inputs
from ..dispatch import planner, runner
from ..dispatch.carry import Carries, always, uncarried, unset
from ..dropout import DropoutKey
from ..errors import AttentionValueError
from ..sinks import sink_grad
from .grads import recomputed_grads, unaliased
from .schema import op_args, op_schema, unused

# What the op carries of a call's options (dispatch/carry.py); its body rebuilds them with make_options
# (AttentionArgs.options). AttentionArgs.of_call refuses anything else by name: its callers run such calls
# eagerly (user functions, FP8) before they get here.
OP_OPTIONS: Carries = {
    "shapes": always,  # rebuilt from q, k, v; the scale is an argument
    "mask": always,  # OP_MASK
    "causal_align": always,
    "enable_gqa": always,
    "dropout_p": always,
    "dropout_key": unset("dropout_key"),  # the op draws its own seed (of_call); a key drawn before would be lost
    "deterministic": always,
    "descale": unset("descale"),  # the schema has no descales
    "sinks": always,
}
OP_MASK: Carries = {
    "shapes": always,
    "offset": always,  # causal_align's and seqlens_k's (make_options without an offset), which the op carries
    "causal": always,
    "left": always,  # window
    "right": always,
    "softcap": always,
    "alibi_slopes": always,  # as the caller's alibi_slopes argument (of_call checks it is given)
    "seqlens_k": always,  # as the caller's seqlens_k argument (likewise)
    "attn_mask": always,
    "packed": unset("packed"),  # the varlen op's (ops/varlen.py)
    "per_element": always,  # causal_align's with seqlens_k
    "dtype": always,  # the compute dtype of q's, which the op gets
    "mods": unset("mods"),  # a function is no argument of an op
    "_tilings": always,  # a cache
}


@dataclass(frozen=True)
class AttentionArgs:
    """The arguments of ``flashattn_teach::attention`` after ``q, k, v``, each in the type its schema
    declares: the masks and lengths as given, then the checked options (``scale`` None for ``1 / sqrt(D)``,
    ``window`` a list or None), then dropout's probability and seed (an int64 scalar tensor), then
    ``deterministic`` and ``sinks`` (last, with their defaults, so records and call sites from before them still
    work)."""

    attn_mask: Tensor | None
    alibi_slopes: Tensor | None
    seqlens_k: Tensor | None
    causal: bool
    causal_align: str
    scale: float | None
    window: list[int] | None
    softcap: float | None
    enable_gqa: bool
    backend: str
    dropout_p: float = 0.0
    dropout_seed: Tensor | None = None
    deterministic: bool = False
    sinks: Tensor | None = None

    @staticmethod
    def of_call(
        opts: AttentionOptions,
        backend: str,
        *,
        scale_given: bool,
        alibi_slopes: Tensor | None,
        seqlens_k: Tensor | None,
    ) -> AttentionArgs:
        """The op's arguments for a call's checked options. Without ``scale_given`` the scale is None and
        the op takes ``1 / sqrt(D)`` itself, so a graph with a symbolic ``D`` holds no square root; the
        dropout seed is drawn here (:func:`dropout_seed`). Options the op does not carry (:data:`OP_OPTIONS`,
        :data:`OP_MASK`; ``alibi_slopes`` and ``seqlens_k`` when the caller does not pass them) are refused by
        name."""
        spec = opts.mask
        dropped = [*uncarried(opts, OP_OPTIONS), *uncarried(spec, OP_MASK)]
        for name, given in (("alibi_slopes", alibi_slopes), ("seqlens_k", seqlens_k)):
            if (getattr(spec, name) is None) != (given is None):
                dropped.append(name)
        if dropped:
            raise AttentionValueError(
                f"the compiled op flashattn_teach::attention does not carry {', '.join(dropped)}: run the call "
                "eagerly (runner.run), as flash_attention does for user functions and FP8"
            )
        return AttentionArgs(
            attn_mask=opts.attn_mask,
            alibi_slopes=alibi_slopes,
            seqlens_k=seqlens_k,
            causal=opts.causal,
            causal_align=opts.causal_align,
            scale=opts.scale if scale_given else None,
            window=None if spec.left == spec.right == -1 else [spec.left, spec.right],
            softcap=spec.softcap,
            enable_gqa=opts.enable_gqa,
            backend=backend,
            dropout_p=opts.dropout_p,
            dropout_seed=dropout_seed(opts.dropout_p),
            deterministic=opts.deterministic,
            sinks=opts.sinks,
        )

    def options(self, q: Tensor, k: Tensor, v: Tensor) -> AttentionOptions:
        """The call's options, checked (the op may be called directly), with the dropout key of the seed."""
        opts = make_options(
            q,
            k,
            v,
            causal=self.causal,
            causal_align=self.causal_align,
            scale=self.scale,
            enable_gqa=self.enable_gqa,
            attn_mask=self.attn_mask,
            dropout_p=self.dropout_p,
            window=None if self.window is None else (self.window[0], self.window[1]),
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            seqlens_k=self.seqlens_k,
            deterministic=self.deterministic,
            sinks=self.sinks,
        )
        if opts.dropout_p > 0.0 and self.dropout_seed is None:
            raise AttentionValueError(f"dropout_p={self.dropout_p} needs a dropout_seed (an int64 tensor)")
        key = DropoutKey(opts.dropout_p, seed=int(self.dropout_seed)) if self.dropout_seed is not None else DropoutKey()
        return opts.with_dropout(key)


def dropout_seed(dropout_p: float) -> Tensor | None:
    """The seed of one call's dropout, None without dropout: the draw of
    :func:`flashattn_teach.dropout.draw` (the same ``torch.randint`` on torch's default CPU generator) kept
    a tensor so that a graph can hold it (``int()`` of it would break the graph)."""
    if dropout_p == 0.0:
        return None  # a constant, so the graph holds no symbolic float for a call without dropout
    return torch.randint(0, 2**62, (), dtype=torch.int64)


def _eager(q: Tensor, k: Tensor, v: Tensor, a: AttentionArgs) -> tuple[Tensor, Tensor]:
    """The eager call the op stands for: checks, options, plan, run."""
    opts = a.options(q, k, v)
    return runner.run(planner.plan(q, k, v, opts, a.backend), q, k, v, opts)


_LEADING = "Tensor q, Tensor k, Tensor v"


@torch.library.custom_op(
    "flashattn_teach::attention",
    mutates_args=(),
    schema=op_schema(AttentionArgs, _LEADING, "(Tensor, Tensor)"),
)
def attention(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of :func:`flashattn_teach.flash_attention` for the arguments :class:`AttentionArgs`
    names, dropout keyed by ``dropout_seed`` (needed when ``dropout_p > 0``)."""
    with torch.no_grad():
        return unaliased(*_eager(q, k, v, AttentionArgs(*args)))


@attention.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    """Output shapes from the input shapes alone (symbolic under dynamic shapes): ``O (..., H_q, N_q, D_v)``
    in ``q``'s dtype, ``lse (..., H_q, N_q)`` in the compute dtype."""
    a = AttentionArgs(*args)
    check_dropout(a.dropout_p)
    s = validate_inputs(
        q, k, v, scale=a.scale, causal_align=a.causal_align, enable_gqa=a.enable_gqa, attn_mask=a.attn_mask
    )
    return q.new_empty(s.out_shape), q.new_empty(s.lse_shape, dtype=compute_dtype(q.dtype))


@torch.library.custom_op(
    "flashattn_teach::attention_backward",
    mutates_args=(),
    schema=op_schema(AttentionArgs, "Tensor dO, Tensor dlse, " + _LEADING, "(Tensor, Tensor, Tensor)"),
)
def attention_backward(dO: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, ...]:
    """``(dq, dk, dv)`` for the gradients ``dO`` of ``O`` and ``dlse`` of ``lse``, in the inputs' shapes;
    the forward's dropout mask drawn again from the same ``dropout_seed``."""
    a = AttentionArgs(*args)
    return recomputed_grads(lambda q, k, v: _eager(q, k, v, a), q, k, v, dO, dlse)


@attention_backward.register_fake
def _attention_backward_fake(dO: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor, *_: Any) -> tuple[Tensor, ...]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, *args = inputs
    a = AttentionArgs(*args)
    # O and lse only with sinks, whose gradient is computed from them (online_softmax.sink_grad)
    O, lse = output if a.sinks is not None else (None, None)
    ctx.save_for_backward(q, k, v, a.attn_mask, a.alibi_slopes, a.seqlens_k, a.dropout_seed, a.sinks, O, lse)
    ctx.args = a


def _backward(ctx: Any, dO: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, attn_mask, alibi_slopes, seqlens_k, dropout_seed, sinks, O, lse = ctx.saved_tensors
    a: AttentionArgs = ctx.args
    saved = {
        "attn_mask": attn_mask,
        "alibi_slopes": alibi_slopes,
        "seqlens_k": seqlens_k,
        "dropout_seed": dropout_seed,
        "sinks": sinks,
    }
    args = op_args(AttentionArgs(**{**a.__dict__, **saved}))
    grads = attention_backward(dO, dlse, q, k, v, *args)
    # no gradient into masks, slopes, lengths, options or the seed; the sinks' is O(B H N) torch ops on the
    # forward's O and lse, traced into the graph (the backward op recomputes q, k, v's only)
    rest: list[Tensor | None] = list(unused(AttentionArgs))
    if sinks is not None and ctx.needs_input_grad[3 + _SINKS_FIELD]:
        rest[_SINKS_FIELD] = sink_grad(sinks, lse, O, dO, dlse)
    return (*grads, *rest)


_SINKS_FIELD = [f.name for f in dataclasses.fields(AttentionArgs)].index("sinks")


attention.register_autograd(_backward, setup_context=_setup_context)


def call(q: Tensor, k: Tensor, v: Tensor, a: AttentionArgs) -> tuple[Tensor, Tensor]:
    """The op, called with a record: what a public function being compiled runs."""
    O, lse = attention(q, k, v, *op_args(a))
    return O, lse


def traceable(attn_mask: Tensor | None, alibi_slopes: Tensor | None) -> bool:
    """Whether a call being compiled can be this op: not when a mask or slopes need gradients (the op gives
    none to them; such calls are traced through instead)."""
    return not any(t is not None and t.requires_grad for t in (attn_mask, alibi_slopes))
