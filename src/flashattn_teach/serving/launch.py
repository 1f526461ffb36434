"""Launcher of the split-KV decode kernels (:mod:`.decode`): check, append, choose tiles and splits, launch.

:func:`triton_decode` is the Triton path of :func:`flashattn_teach.flash_attention_with_kvcache`, which
has already checked shapes, dtypes, devices and options (``_validate_decode``). What it adds:

- a CUDA ``cache_seqlens`` stays on the device: its dtype, shape and device are checked, its values are
  not read on the host (that would wait for the GPU at every decode step). The kernels clamp each length
  to ``[0, N_max - N_new_kv]``, so a bad value cannot read or write outside the caches, but one that
  leaves no room makes the new entries overwrite the last valid ones. An int or a CPU tensor costs no
  sync to read: the caller (``decode.py``) has checked its values before this runs.
- everything that can refuse the call is checked before the new entries are written, so a call that
  raises leaves the caches as they were.
- the new keys and values are written into the caches in place at ``[cache_seqlens[b], cache_seqlens[b]
  + N_new_kv)`` by one indexed copy each, with positions computed on the device.
- paged caches (``block_table``): ``k_cache (num_blocks, H_kv, page_size, D)``, each batch element's
  capacity ``N_max = max_blocks x page_size``; the new entries go through the block table
  (:func:`append_to_pages`); a CUDA block table and ``cache_leftpad`` are not read on the host either,
  the kernel clamps block ids into ``[0, num_blocks)`` and ``cache_leftpad[b]`` into ``[0, L_b]``.
- tiles: ``BLOCK_M`` query rows (the ``G x N_new`` rows of a key/value head, padded to the 16 rows a
  tensor-core dot needs), ``BLOCK_N`` keys by head dimension (:func:`decode_config`); a query/key head dim
  of 129 to 192 as two lane groups, 128 + 64 (:func:`.lanes.lane_groups`), rather than padded to 256.
- splits: ``num_splits = 0`` asks :func:`flashattn_teach.serving.splitkv.default_num_splits` with the cache's
  capacity ``N_max`` as the key length (as flash-attn does: the lengths are on the device); more splits
  than key blocks of ``N_max`` would all be empty, so they are capped there (the partition of every
  batch element's keys is unchanged by the cap).
- the partials are merged by :func:`~.decode.decode_combine`, one launch, rather than by
  ``merge_attention_states`` in torch: ``num_splits - 1`` merges of about eight torch kernels each would
  cost more launches than the decode step itself takes on a GPU.
- both kernels launch on the caches' GPU, whichever is current
  (:func:`flashattn_teach.triton.devices.launches_on_device`).

Like the rest of the package this file does not import triton at import time.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..errors import AttentionTypeError, AttentionValueError
from ..triton.configs import arch_of, block_d, dot_precision
from ..triton.devices import launches_on_device
from ..triton.kernels.records import LOG2E, CacheLengths, DecodeTensors, Pages, Partials, score_terms, split, strided
from ..triton.lanes import lane_groups, table_dim
from ..triton.launch import check_tile_offsets
from ..triton.support import decode_unsupported_reason
from ..triton.variants import UNBOUNDED
from .checks import DecodeStep, check_seqlens_tensor
from .splitkv import default_num_splits

if TYPE_CHECKING:  # the launcher imports triton only when it launches
    from ..triton.kernels.trace_decode import DecodeTraceRecord


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the split kernel: at most ``BLOCK_M`` query rows per program (fewer rows are
    padded to a power of two >= 16), ``BLOCK_N`` keys per block."""

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int


# The interpreter's tiles: small key blocks so that short test caches span several blocks.
TEST_DECODE_CONFIG = DecodeConfig(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)

# (BLOCK_N, num_warps) by padded head dim. 16-bit inputs: a K and a V block of BLOCK_N x BLOCK_D per pipeline
# stage in shared memory (16 KB each at 64 x 128 in bf16), several stages in flight to cover the latency of a
# memory-bound loop; at head dim 64, 128 keys need eight warps to stay clear of spills. fp32 inputs (head
# dims <= 128) run "tf32x3" dots, whose split operands need more registers: 32 keys (16 at hd128), two
# stages. Every row
# compiles ahead of time for sm_90 and sm_80 without spills, also at the largest BLOCK_M
# (tests/triton/test_triton_decode.py; ``flashattn-teach kernels-decode --rows``).
_TILES_16BIT = {16: (128, 8), 32: (128, 8), 64: (128, 8), 128: (64, 4), 192: (64, 8), 256: (32, 8)}
_TILES_FP32 = {16: (32, 4), 32: (32, 4), 64: (32, 4), 128: (16, 4)}
# Rows per program at most: a (BLOCK_M, BLOCK_DV) fp32 accumulator in registers next to the score tile and
# the queries; 64 rows spill on sm_80 (and in fp32 on sm_90), so a step with more rows runs several blocks.
MAX_BLOCK_M_16BIT = 32
MAX_BLOCK_M_FP32 = 16


def decode_config(dtype: torch.dtype, head_dim: int, arch: str, head_dim_v: int | None = None) -> DecodeConfig:
    """The split kernel's tiles for a dtype, query/key and value head dimensions (``head_dim_v`` defaults to
    ``head_dim``) and GPU generation ("sm90", "sm80"): three stages on sm_90, two on sm_80 (less shared
    memory) and for fp32. The row is :func:`.lanes.table_dim`'s: the larger padded head dim, or 192 for
    DeepSeek's 192 / 128, whose keys run as two lane groups (128 + 64) next to values of 128."""
    fp32 = dtype == torch.float32
    key = table_dim(head_dim, head_dim if head_dim_v is None else head_dim_v)
    block_n, warps = (_TILES_FP32 if fp32 else _TILES_16BIT)[key]
    return DecodeConfig(
        BLOCK_M=MAX_BLOCK_M_FP32 if fp32 else MAX_BLOCK_M_16BIT,
        BLOCK_N=block_n,
        num_warps=warps,
        num_stages=3 if arch == "sm90" and not fp32 else 2,
    )


def rows_block(rows: int, cap: int) -> int:
    """``BLOCK_M`` for ``rows = G x N_new`` query rows per key/value head: the next power of two, at least
    16 (the smallest tensor-core M), at most ``cap``."""
    return max(16, min(cap, 1 << max(rows - 1, 0).bit_length()))


def device_seqlens(cache_seqlens: object, B: int, N_max: int, device: torch.device) -> Tensor:
    """``cache_seqlens`` as an int32 ``(B,)`` tensor on ``device``, checked without reading its values on the
    host (an int is checked: it is on the host already)."""
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        n = int(cache_seqlens)
        if not 0 <= n <= N_max:
            raise AttentionValueError(
                f"cache_seqlens must lie in [0, N_max] = [0, {N_max}] (N_max = k_cache.shape[2]), got {n}"
            )
        return torch.full((B,), n, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, Tensor):
        raise AttentionTypeError(
            f"cache_seqlens must be an int32/int64 torch.Tensor of shape ({B},) or an int, "
            f"got {type(cache_seqlens).__name__} {cache_seqlens!r}"
        )
    check_seqlens_tensor(cache_seqlens, B, device)
    return cache_seqlens.to(torch.int32).contiguous()  # the kernel reads entry b at CACHE_SEQLENS + b


def append_on_device(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, seqlens: Tensor) -> None:
    """Write ``k, v`` into the caches in place at ``[seqlens[b], seqlens[b] + N_new_kv)``, positions computed
    on the device (clamped into the cache, as the kernels clamp the lengths)."""
    B, _, N_max, _ = k_cache.shape
    N_new_kv = k.shape[2]
    first = seqlens.long().clamp(0, N_max - N_new_kv)  # (B,)
    pos = first[:, None] + torch.arange(N_new_kv, device=k.device)  # (B, N_new_kv)
    batch = torch.arange(B, device=k.device)[:, None]  # (B, 1)
    with torch.no_grad():  # an in-place write of inference state, as decode.append_to_cache
        # (B, N_max, H_kv, D)[batch, pos] = (B, N_new_kv, H_kv, D): views, so the caches change in place
        k_cache.transpose(1, 2)[batch, pos] = k.transpose(1, 2)
        v_cache.transpose(1, 2)[batch, pos] = v.transpose(1, 2)


def append_to_pages(
    k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, seqlens: Tensor, block_table: Tensor
) -> None:
    """:func:`append_on_device` through a block table: entry ``j`` of batch element b goes to page
    ``block_table[b, j // page_size]``, slot ``j % page_size`` of ``k_cache (num_blocks, H_kv, page_size,
    D)``; positions and block ids computed and clamped on the device (as the kernel clamps them), so only
    the slots written change."""
    num_blocks, _, page_size, _ = k_cache.shape
    N_max = block_table.shape[1] * page_size
    N_new_kv = k.shape[2]
    first = seqlens.long().clamp(0, N_max - N_new_kv)  # (B,)
    pos = first[:, None] + torch.arange(N_new_kv, device=k.device)  # (B, N_new_kv)
    page = block_table.long().gather(1, pos // page_size).clamp(0, num_blocks - 1)  # (B, N_new_kv)
    slot = pos % page_size  # (B, N_new_kv)
    with torch.no_grad():  # an in-place write of inference state, as decode.append_to_cache
        # (num_blocks, page_size, H_kv, D)[page, slot] = (B, N_new_kv, H_kv, D): views of the caches
        k_cache.transpose(1, 2)[page, slot] = k.transpose(1, 2)
        v_cache.transpose(1, 2)[page, slot] = v.transpose(1, 2)


def _needs_grad(**tensors: Tensor | None) -> list[str]:
    return [name for name, t in tensors.items() if t is not None and t.requires_grad]


def triton_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    step: DecodeStep,
    *,
    config: DecodeConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """``(O (B, H_q, N_new, D_v) in q's dtype, lse (B, H_q, N_new) float32)`` of one decode step by the
    Triton kernels; ``k, v`` are appended first. Inputs and options checked by the caller, the options in
    one record (:class:`~.checks.DecodeStep`: ``block_table`` int32 ``(B, max_blocks)`` with caches
    ``(num_blocks, H_kv, page_size, .)``, ``cache_leftpad`` int32 ``(B,)``, ``sinks`` floating ``(H_q,)``,
    each on q's device)."""
    block_table, sinks = step.block_table, step.sinks
    reason = decode_unsupported_reason(q, v_cache)
    if reason is not None:
        raise AttentionValueError(f"backend='triton' cannot run this decode call: {reason}")
    needing = _needs_grad(q=q, k_cache=k_cache, v_cache=v_cache, sinks=sinks) if torch.is_grad_enabled() else []
    if needing:
        raise AttentionValueError(
            f"{', '.join(needing)} require{'s' if len(needing) == 1 else ''} grad, but the Triton decode kernel "
            "is forward only; run under torch.no_grad(), or use backend='auto' or a CPU backend for gradients"
        )
    B, D = q.shape[0], q.shape[3]
    D_v = v_cache.shape[3]
    N_max = v_cache.shape[2] if block_table is None else block_table.shape[1] * v_cache.shape[2]
    N_new_kv = 0 if k is None else k.shape[2]
    seqlens = device_seqlens(step.cache_seqlens, B, N_max, q.device)
    if config is None:
        config = decode_config(q.dtype, D, arch_of(q.device), D_v) if q.is_cuda else TEST_DECODE_CONFIG
    splits = step.num_splits or default_num_splits(q, k_cache, N_max)
    splits = max(1, min(splits, math.ceil(N_max / config.BLOCK_N)))
    # before the write, too; paged: the kernel moves to each page in 64-bit arithmetic, within it in 32-bit
    rows = config.BLOCK_N if block_table is None else v_cache.shape[2]
    check_tile_offsets("decode", rows, k_cache=k_cache, v_cache=v_cache)
    if k is not None and v is not None:
        if N_new_kv > N_max:
            raise AttentionValueError(
                f"k and v hold N_new_kv={N_new_kv} new entries, more than k_cache and v_cache hold (N_max = {N_max})"
            )
        if block_table is None:
            append_on_device(k_cache, v_cache, k, v, seqlens)
        else:
            append_to_pages(k_cache, v_cache, k, v, seqlens, block_table)
    return launch_decode(
        q,
        k_cache,
        v_cache,
        seqlens,
        N_new_kv,
        causal=step.causal,
        scale=step.scale,
        window=step.window,
        softcap=step.softcap,
        alibi_slopes=step.alibi_slopes,
        num_splits=splits,
        block_table=block_table,
        cache_leftpad=step.cache_leftpad,
        sinks=sinks,
        config=config,
    )


@launches_on_device
def launch_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seqlens: Tensor,
    N_new_kv: int,
    *,
    causal: bool,
    scale: float,
    window: tuple[int, int],
    softcap: float | None,
    alibi_slopes: Tensor | None,
    num_splits: int,
    config: DecodeConfig,
    block_table: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    sinks: Tensor | None = None,
    trace: DecodeTraceRecord | None = None,
    partials: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Allocate and launch (the new entries already appended): the split kernel on ``num_splits >= 1``
    splits, then the combine when there are several. ``seqlens`` int32 ``(B,)``, the lengths before the
    step's ``N_new_kv`` new entries; ``block_table``, ``cache_leftpad``, ``sinks`` as :func:`triton_decode`
    takes them. ``trace``: run the kernel's trace build (:mod:`.trace`); ``partials``: float32 ``(num_splits, B,
    H_q, N_new, D_v)`` and ``(num_splits, B, H_q, N_new)`` buffers for the splits' outputs when there are
    several (default: allocated here), which a trace's reader keeps."""
    import triton

    from ..triton.kernels.decode import decode_combine, decode_split_fwd

    B, H_q, N_new, D = q.shape
    num_blocks, H_kv, N_rows, D_v = v_cache.shape  # N_rows: the cache's length, or a page's
    N_max = N_rows if block_table is None else block_table.shape[1] * N_rows
    G = H_q // H_kv
    BLOCK_M = rows_block(G * N_new, config.BLOCK_M)
    O = torch.empty((B, H_q, N_new, D_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H_q, N_new), dtype=torch.float32, device=q.device)
    if O.numel() == 0 or lse.numel() == 0:
        return O, lse.fill_(float("-inf"))
    if num_splits == 1:  # the split kernel writes the final outputs: no partials, no combine
        O_part, lse_part = O.unsqueeze(0), lse.unsqueeze(0)
    elif partials is not None:
        O_part, lse_part = partials
    else:
        O_part = torch.empty((num_splits, B, H_q, N_new, D_v), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((num_splits, B, H_q, N_new), dtype=torch.float32, device=q.device)
    check_tile_offsets("decode", config.BLOCK_N if block_table is None else N_rows, k_cache=k_cache, v_cache=v_cache)
    pages = None
    if block_table is not None:
        stride_bt_b, stride_bt_n = block_table.stride()
        pages = Pages(block_table, stride_bt_b, stride_bt_n, PAGE_SIZE=N_rows, num_blocks=num_blocks)
    lengths = CacheLengths(
        seqlens,
        # the kernel reads entry b at cache_leftpad + b: one int32 per element, back to back
        None if cache_leftpad is None else cache_leftpad.to(torch.int32).contiguous(),
        N_new=N_new,
        N_new_kv=N_new_kv,
        N_max=N_max,
    )
    slopes = None if alibi_slopes is None else alibi_slopes.detach().to(torch.float32)
    terms = score_terms(softcap, slopes, None)
    left, right = window
    BLOCK_D, BLOCK_D2 = lane_groups(D)  # 192: 128 + 64 lanes, two MMAs a score tile (.kernels.tiles)
    decode_split_fwd[(B * H_kv * triton.cdiv(G * N_new, BLOCK_M), num_splits)](
        *split(
            DecodeTensors(
                strided(q),
                strided(k_cache),
                strided(v_cache),
                Partials(O_part, *O_part.stride()),
                Partials(lse_part, *lse_part.unsqueeze(-1).stride()),  # (num_splits, B, H_q, N_new, 1)
            )
        ),
        lengths,
        pages,
        terms,
        None if sinks is None else sinks.detach().to(torch.float32).contiguous(),  # (H_q,), fp32
        H_kv=H_kv,
        GROUP=G,
        num_splits=num_splits,
        qk_scale=scale * LOG2E,
        LEFT=UNBOUNDED if left < 0 else left,
        RIGHT=0 if causal else UNBOUNDED if right < 0 else right,  # causal is a window's right side of 0
        HEAD_DIM=D,
        HEAD_DIM_V=D_v,
        BLOCK_D=BLOCK_D,
        BLOCK_D2=BLOCK_D2,
        BLOCK_DV=block_d(D_v),
        BLOCK_M=BLOCK_M,
        BLOCK_N=config.BLOCK_N,
        SOFTCAP=softcap is not None,
        ALIBI=alibi_slopes is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        PAGED=block_table is not None,
        WIDE_PAGES=block_table is not None and N_rows >= config.BLOCK_N,
        LEFTPAD=cache_leftpad is not None,
        SINKS=sinks is not None,
        Trace=trace,  # None: a constant, and the trace build compiles to nothing
        TRACE=trace is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_splits > 1:
        rows = B * H_q * N_new
        decode_combine[(rows,)](
            O_part,
            lse_part,
            O,
            lse,
            rows * D_v,
            rows,
            num_splits,
            HEAD_DIM_V=D_v,
            BLOCK_DV=block_d(D_v),
            num_warps=1,
        )
    return O, lse
