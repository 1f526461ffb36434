"""``explain``: which backend a call of :func:`flashattn_teach.flash_attention`,
:func:`flashattn_teach.scaled_dot_product_attention` or :func:`flashattn_teach.flash_attention_varlen`
would run, and why, without running it.

The answer is :func:`flashattn_teach.dispatch.plan`'s, for the options the call would build; on the Triton
kernels it names the forward configuration and whether it is warp-specialised; with a mask or variant on
a tiled backend it adds how the tiles meet the mask (visited whole, visited with a tile mask, skipped),
and with dropout how the mask is drawn. It draws no dropout key, so it consumes nothing from torch's
generator.
"""

from __future__ import annotations

from typing import Annotated

from torch import Tensor
from typing_extensions import Unpack

from .._autocast import cast_inputs
from .._options import AttentionOptions, make_options, make_packed_options
from .._validate.inputs import check_bool
from .._validate.keywords import Default, takes_keywords
from .._validate.varlen import PackedBounds
from ..dispatch import Plan, fp8, planner
from ..dispatch.planner import TILED
from ..dispatch.runner import with_block_mask
from ..errors import AttentionTypeError, AttentionValueError
from ..masks.causal import TileKind
from ..serving.varlen_pages import gather_paged_keys
from ..triton.support import forward_kernel_note
from .attention import FlashAttentionKeywords, check_descales
from .varlen import VarlenKeywords

_DROPOUT_NOTE = (
    "; dropout: the counter-based Philox generator's mask, keyed by (seed, offset, batch, head, row, column), "
    "the key drawn once per call from torch's generator"
)


def _masked_by_user(opts: AttentionOptions) -> bool:
    return opts.mask.mods is not None and "mask_mod" in opts.mask.mods.names


def _tile_counts(p: Plan, opts: AttentionOptions) -> str:
    """How the planned tiled backend meets the mask: tiles visited whole, masked, and skipped."""
    _, block_m, block_n = planner.tiles(p.backend, opts.shapes.N_q, block_mask=_masked_by_user(opts))
    counts = opts.mask.tiling(block_m, block_n).counts()
    n = sum(counts.values())
    return (
        f"; {n} tile{'' if n == 1 else 's'} of {block_m} x {block_n}: {counts[TileKind.FULL]} visited whole, "
        f"{counts[TileKind.PARTIAL]} visited with a tile mask, {counts[TileKind.SKIP]} skipped"
    )


class ExplainKeywords(FlashAttentionKeywords, VarlenKeywords, total=False):
    """:func:`explain`'s keywords: :func:`flash_attention`'s and :func:`flash_attention_varlen`'s, the packed
    call's bounds, ``is_causal`` (torch's SDPA's spelling of ``causal``) and ``verbose``."""

    is_causal: Annotated[bool, Default(False)]
    cu_seqlens_q: Annotated[Tensor | None, Default(None)]
    cu_seqlens_k: Annotated[Tensor | None, Default(None)]
    max_seqlen_q: Annotated[int | None, Default(None)]
    max_seqlen_k: Annotated[int | None, Default(None)]
    verbose: Annotated[bool, Default(False)]


# flash_attention_varlen's call: the padded batch's keywords it does not take are refused, not left out
_NOT_PACKED = ("seqlens_k", "attn_mask", "score_mod", "mask_mod", "block_mask")


@takes_keywords()
def explain(query: Tensor, key: Tensor, value: Tensor, **options: Unpack[ExplainKeywords]) -> Plan:
    """Which backend :func:`scaled_dot_product_attention` / :func:`flash_attention` would use, and why;
    with a mask or variant on a tiled backend, also how many tiles it visits whole, masks and skips.

    The keywords are :func:`flash_attention`'s (with ``enable_gqa`` off by default, as torch's SDPA), and
    ``is_causal`` for SDPA's ``causal`` (pass one of the two).

    With ``cu_seqlens_q`` and ``cu_seqlens_k`` (and ``max_seqlen_q``, ``max_seqlen_k``) the inputs are
    packed sequences, ``(total, H, D)``, as :func:`flash_attention_varlen` takes them (its
    ``causal_align`` default is ``"bottom_right"``: pass it as the call does); with ``block_table`` too,
    ``key`` and ``value`` are page pools, checked and gathered as the call does. On the Triton path the
    answer also says which backward runs (one kernel with dQ by atomics, or the deterministic two kernels,
    and why); ``deterministic`` as the call's. ``score_mod``, ``mask_mod`` and ``block_mask`` as
    :func:`flash_attention` takes them; with ``verbose`` and user functions on the Triton path the answer
    ends with the source of the ``@triton.jit`` functions they were translated into. ``sinks`` as the call's
    (the answer says how the backend takes them). ``q_descale, k_descale, v_descale`` with e4m3 inputs: an FP8
    call, planned as :func:`flash_attention` plans it (the kernel on sm_90, else the CPU emulation).

    >>> import torch, flashattn_teach as fa
    >>> q = torch.randn(1, 2, 1024, 16)
    >>> print(fa.explain(q, q, q))  # doctest: +ELLIPSIS
    parallel: cpu tensors: query-major tiles, the (batch, head) slices spread over ... workers
    >>> print(fa.explain(q[..., :8, :], q[..., :8, :], q[..., :8, :]))  # doctest: +ELLIPSIS
    parallel: cpu tensors: query-major tiles; fewer than 2^19 scores, too few for the worker threads: ...
    """
    cu_seqlens_q, cu_seqlens_k, block_table = options["cu_seqlens_q"], options["cu_seqlens_k"], options["block_table"]
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    if block_table is not None and not packed:
        raise AttentionValueError(
            "block_table is taken here with packed sequences (cu_seqlens_q, cu_seqlens_k), as "
            "flash_attention_varlen takes it; for a decode step over a paged cache call explain_with_kvcache"
        )
    if block_table is not None:  # the keys the varlen call would gather from the pages
        key, value = gather_paged_keys(query, key, value, cu_seqlens_k, block_table)  # type: ignore[arg-type]
    query, key, value = cast_inputs(query, key, value)
    given = [name for name in _NOT_PACKED if options[name] is not None]  # type: ignore[literal-required]
    if packed and given:
        raise AttentionValueError(
            f"{', '.join(given)} not taken with packed sequences (cu_seqlens_q, cu_seqlens_k), as "
            "flash_attention_varlen takes none; express the sequences as a document mask_mod over padded inputs"
        )
    causal, causal_name = _causal(options)
    if packed:
        # checked there: tensors and ints, or the varlen call's errors
        bounds = PackedBounds(cu_seqlens_q, cu_seqlens_k, options["max_seqlen_q"], options["max_seqlen_k"])  # type: ignore[arg-type]
        query, key, value, opts = make_packed_options(query, key, value, bounds, options, causal=causal)
    else:
        descale = check_descales(query, key, value, options)
        opts = make_options(query, key, value, options, descale=descale, causal=causal, causal_name=causal_name)
    backend = options["backend"]
    if opts.descale is not None:  # an FP8 call: its own plan (dispatch/fp8.py), forward only
        return fp8.plan_fp8(query, opts, backend)
    opts = with_block_mask(opts, query.device)  # a mask_mod's tiles, classified as the call would
    p = planner.plan(query, key, value, opts, backend)
    if p.backend == "triton":  # which forward kernel runs, and whether its loop is warp-specialised
        p = Plan(p.backend, p.reason + forward_kernel_note(query, key, value, opts))
    if p.backend in TILED and opts.mask.variants:
        p = Plan(p.backend, p.reason + _tile_counts(p, opts))
    p = Plan(p.backend, p.reason + planner.backward_note(p, query, opts))
    if opts.dropout_p > 0.0:  # explain draws no key: it consumes nothing from torch's generator
        again = ", and the backward draws the mask again instead of storing it" if p.backend in TILED else ""
        p = Plan(p.backend, p.reason + _DROPOUT_NOTE + again)
    if opts.mask.mods is not None:
        p = Plan(p.backend, p.reason + _mods_note(p, opts, check_bool("verbose", options["verbose"])))
    if opts.sinks is not None:
        p = Plan(p.backend, p.reason + _sinks_note(p))
    if block_table is not None:
        p = Plan(p.backend, p.reason + _PAGED_NOTE)
    return p


def _causal(options: ExplainKeywords) -> tuple[bool, str]:
    """The call's ``causal``, and its name for the errors: ``is_causal`` (SDPA's) or ``causal`` (flash_attention's)."""
    if options["is_causal"] is False:
        return options["causal"], "causal"
    if options["causal"] is not False:
        raise AttentionTypeError("pass is_causal (scaled_dot_product_attention's spelling) or causal, not both")
    return options["is_causal"], "is_causal"


_PAGED_NOTE = (
    "; keys read through block_table: gathered from their pages into one packed (total_k, H_kv, D) copy "
    "first, since the varlen kernels take packed keys"
)


def _sinks_note(p: Plan) -> str:
    """For ``explain``: how the planned backend takes attention sinks."""
    if p.backend == "dense":
        how = "one more score column per row, sink_h, in the softmax, dropped before P V"
    elif p.backend == "triton":
        how = "the forward kernel starts each row at m_i = sink_h log2(e), l_i = 1 (SINKS)"
    else:
        how = "each row's online softmax starts at m_i = sink_h, l_i = 1 (online_softmax.init_state)"
    return f"; attention sinks: {how}; the backward reads them in the saved lse, dsink from lse and delta"


def _mods_note(p: Plan, opts: AttentionOptions, verbose: bool) -> str:
    """How the call's user functions run on the planned backend; with ``verbose`` the ``@triton.jit`` source
    they translate into (on any backend: the translation needs no GPU), or why they do not translate."""
    mods = opts.mask.mods
    assert mods is not None
    if p.backend == "triton":
        note = "; user functions translated into @triton.jit functions inlined into the kernels"
    else:
        where = "the whole N_q x N_k grid" if p.backend == "dense" else "each tile's index vectors"
        note = f"; user functions run as Python per element, mapped by vmap over {where} as torch calls them"
        if p.backend != "dense" and mods.score_mod is not None:
            captured = ", and into the captured tensors that require grad" if mods.grad_captures else ""
            note += f"; the backward differentiates through score_mod tile by tile{captured}"
    if not verbose:
        return note
    from ..triton.usermod import generated_source, unsupported_reason

    sources = []
    for kind, fn, captures in (
        ("score_mod", mods.score_mod, mods.captures),
        ("mask_mod", mods.mask_mod, mods.mask_captures),
    ):
        if fn is not None:
            why = unsupported_reason(fn, captures, kind)
            sources.append(f"# {kind}: {why}" if why else generated_source(fn, captures, kind))
    return note + "\n" + "\n".join(sources)
