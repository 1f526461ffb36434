"""Fused FlashAttention kernels in Triton: forward (FA2 Alg. 1) and memory-efficient backward (Alg. 2).

Layers, each in its own file:

    forward.py    the forward kernel: a program per query block, its causal and window stages
    forward_inner.py  the forward's key/value loop (online softmax in base 2) and its K/V loads
    tiles.py      the tile loads and stores both kernels use
    support.py    can the kernels run a call, and if not, why
    tma.py        when a tile may arrive by TMA, and the configuration that runs when it cannot
    backward.py   the backward scheme and its delta = rowsum(dO * O) preprocess
    backward_dkdv.py  the dK/dV kernel (a program owns a key block), in the one-kernel backward also dQ by atomics
    backward_dkdv_inner.py  its loop over query blocks
    backward_dq.py    the dQ kernel of the deterministic backward (a program owns a query block)
    configs.py    block sizes, warps and stages per (head dim, dtype, GPU generation)
    provenance.py which paths have run on a GPU, and when; those that have not stay off by default
    masking.py    the mask contract in the kernels: window ranges, softcap, ALiBi
    usermods.py   score_mod, mask_mod and a block mask's tile kinds inside the kernels
    variants.py   a call's variants as the kernels' flags and arguments
    launch.py     validate, allocate, launch
    autograd.py   the differentiable function (saves q, k, v, O, lse)
    varlen.py     packed variable-length sequences (flash-attn's varlen) through the same kernels
    autotune.py   optional: time candidate configurations, keep the fastest
    inspect.py    ahead-of-time compilation report (``flashattn-teach kernels``)

Importing this package does not import triton; the kernels are imported on first launch, so the package
works (and reports why the Triton path is unavailable) on machines without triton.
"""

from __future__ import annotations

from torch import Tensor

from .._autocast import cast_inputs
from .._options import AttentionOptions, make_options
from .._validate.inputs import check_bool
from ..dropout import DropoutKey
from ..errors import AttentionTypeError
from .configs import TEST_CONFIG, AttentionConfig, KernelConfig, check_backward_config, shipped_config
from .devices import needs_grad
from .support import refuse_unsupported, shapes_unsupported_reason, unsupported_reason, variants_unsupported_reason
from .variants import KernelVariants
from .varlen import triton_attention_varlen

__all__ = [
    "TEST_CONFIG",
    "AttentionConfig",
    "KernelConfig",
    "generated_sources",
    "shapes_unsupported_reason",
    "shipped_config",
    "triton_attention",
    "triton_attention_varlen",
    "triton_forward",
    "unsupported_reason",
    "variants_unsupported_reason",
]


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    config: AttentionConfig | str | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_key: DropoutKey | None = None,
    deterministic: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention with the fused Triton kernels; differentiable.

    Args:
        q: ``(..., H_q, N_q, D)`` queries, as torch's ``scaled_dot_product_attention``; any strides.
        k: ``(..., H_kv, N_k, D)`` keys; ``H_kv`` divides ``H_q`` with ``enable_gqa`` (or is 1).
        v: ``(..., H_kv, N_k, D_v)`` values.
        causal, causal_align: see :mod:`flashattn_teach.masks.causal` (``"top_left"`` or ``"bottom_right"``).
        scale: softmax scale, default ``1 / sqrt(D)``.
        return_lse: also return ``lse`` (float32, shape ``(..., H_q, N_q)``).
        config: block sizes, warps and stages; default from :func:`shipped_config` on CUDA without the
            paths no GPU has run yet (the warp-specialised forward, the one-kernel backward, the
            longest-first causal grid), each switched on by its environment variable
            (:mod:`flashattn_teach.triton.provenance`), and :data:`TEST_CONFIG` in the interpreter. For one
            call, pass the configuration to run: ``shipped_config(D, q.dtype, "sm90")`` has all three, and
            ``provenance.as_tried(config, warp_specialize=True)`` only the ones asked for.
            ``"autotune"`` times the candidates of :func:`~flashattn_teach.triton.autotune.autotune` once
            per shape class and uses the fastest.
        window, softcap, alibi_slopes, seqlens_k, attn_mask: the variants of
            :func:`flashattn_teach.flash_attention` (see :mod:`flashattn_teach.masks`), honoured in the
            forward and backward kernels (a mask read tile by tile); ALiBi slopes and the mask get no
            gradient.
        dropout_p: drop attention weights with this probability, survivors scaled by ``1 / (1 - p)``
            (``lse`` is not dropped); the keep mask is :mod:`flashattn_teach.dropout`'s, keyed by a seed
            drawn from torch's default generator, or by ``dropout_key`` when given (whose ``p`` then
            counts): the CPU references draw the same mask for the same key.
        deterministic: the two-kernel backward, bitwise reproducible, rather than the one-kernel backward
            with dQ by atomic adds (see :func:`flashattn_teach.flash_attention`).

    CUDA tensors (CPU tensors when ``TRITON_INTERPRET=1``) of dtype float16 or bfloat16 with head dims
    up to 256, or float32 with head dims up to 128, forward and backward. A query row that sees no key
    gets ``O = 0`` and ``lse = -inf``. Under ``torch.autocast`` the inputs are cast to the autocast dtype
    first, as torch's SDPA does.
    """
    q, k, v = cast_inputs(q, k, v)
    opts = make_options(
        q,
        k,
        v,
        causal=causal,
        causal_align=causal_align,
        scale=scale,
        enable_gqa=enable_gqa,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        seqlens_k=seqlens_k,
        attn_mask=attn_mask,
        dropout_p=dropout_p if dropout_key is None else dropout_key.p,
        deterministic=deterministic,
    )
    lse_wanted = check_bool("return_lse", return_lse)
    refuse_unsupported(q, k, v, opts, who="triton_attention")  # what the planner asks for backend="triton"
    if config == "autotune":
        from .autotune import autotune

        config = autotune(
            q,
            k,
            v,
            causal=opts.causal,
            causal_align=opts.causal_align,
            enable_gqa=opts.enable_gqa,
            backward=needs_grad(q, k, v),
        )
    elif config is not None and not isinstance(config, AttentionConfig):
        raise AttentionTypeError(f"config must be an AttentionConfig, 'autotune' or None, got {config!r}")
    if config is not None and needs_grad(q, k, v):
        check_backward_config(config, q, opts.shapes)  # fail at the call, not at loss.backward()
    O, lse = triton_forward(q, k, v, opts.with_dropout(dropout_key), config=config)
    return (O, lse) if lse_wanted else O


def generated_sources(opts: AttentionOptions) -> str:
    """The ``@triton.jit`` source the kernels run for the call's ``score_mod`` (with its derivative by the
    score, which the backward multiplies into dS) and ``mask_mod``, for a reader (``explain(...,
    verbose=True)`` prints it); empty without them. Translates the functions (cached), so it raises
    :class:`flashattn_teach.triton.usermod.UnsupportedUserFunction` for one the translator does not take."""
    from .usermod import compile_mask_mod, compile_score_mod

    mods = opts.mask.mods
    if mods is None:
        return ""
    parts = []
    if mods.score_mod is not None:
        compiled = compile_score_mod(mods.score_mod, mods.captures)
        parts.append(f"# score_mod and score_grad: SCORE_MOD and SCORE_GRAD of the kernels\n{compiled.source}")
    if mods.mask_mod is not None:
        mask = compile_mask_mod(mods.mask_mod, mods.mask_captures)
        parts.append(f"# mask_mod: MASK_MOD of the kernels, on the block mask's PARTIAL tiles\n{mask.source}")
    return "\n".join(parts)


def triton_forward(
    q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, *, config: AttentionConfig | None = None
) -> tuple[Tensor, Tensor]:
    """``(O, lse)`` of a planned call by the fused kernels: the planner (or :func:`triton_attention`) has
    checked that they can run it (:func:`.support.refuse_unsupported`), and ``opts`` carries the dropout
    key (``opts.with_dropout()``). ``config``: the shipped one for these inputs when None."""
    from . import launch
    from .autograd import TritonAttentionFunction, TritonLaunch

    variants = KernelVariants.from_spec(opts.mask, opts.dropout)
    if config is None:
        config = launch.default_config(q, opts.shapes, variants)
        if needs_grad(q, k, v):
            check_backward_config(config, q, opts.shapes)  # fail at the call, not at loss.backward()
    O, lse = TritonAttentionFunction.apply(q, k, v, opts, TritonLaunch(config, variants), opts.sinks)
    return O, lse
