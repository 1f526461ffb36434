"""Dropout on the attention weights from a counter-based generator: one keep mask on every path, never stored.

FlashAttention drops attention weights inside the tile loop and, rather than saving the mask, draws it
again in the backward (Dao et al. 2022, Alg. 2 line 14 and Alg. 4). That needs a generator whose draw
for weight ``P[b, h, i, j]`` depends only on the weight's coordinates, not on the order tiles run in:
a counter-based generator. This is Philox4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy
as 1, 2, 3"), the one behind torch's CUDA generator and Triton's ``tl.randint``::

    counter  = offset + ((b * H_q + h) * N_q + i) * N_k + j          64 bits: words c0 (low), c1 (high)
    r        = Philox4x32-10(counter words (c0, c1, 0, 0), key words (seed low, seed high))[0]
    keep     = (r >> 1) >= threshold,      threshold = round(dropout_p * 2^31)
    P_drop   = P * keep * keep_scale,      keep_scale = 1 / (1 - dropout_p)

so a weight survives with probability ``1 - threshold / 2^31`` (``dropout_p`` to within ``2^-32``) and
``E[P_drop] = P``. ``b`` is the flat batch index and ``h`` the query head; ``i`` and ``j`` are the row and
column of the whole ``N_q x N_k`` score matrix, so any tiling, either loop order and the Triton kernels
(:mod:`flashattn_teach.triton.kernels.dropout`, the same arithmetic in ``tl.randint``) draw the same mask.
``seed`` and ``offset`` are drawn once per call from torch's default generator (:func:`draw`), so
``torch.manual_seed`` makes runs repeatable; the backward reuses the forward's.

Philox needs the high and low 32 bits of 32 x 32-bit products; torch has no unsigned 64-bit type, but a
product of two 32-bit words fits in 64 bits and int64 multiplication wraps, so :func:`_mulhilo` reads both
halves of one int64 product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import AttentionValueError

_M32 = 0xFFFFFFFF
# Philox4x32 constants (Salmon et al. 2011, Table 2): round multipliers and the Weyl key increments.
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_KEY_A = 0x9E3779B9  # golden ratio, 2^32 / phi
PHILOX_KEY_B = 0xBB67AE85  # sqrt(3) - 1, times 2^32
PHILOX_ROUNDS = 10
THRESHOLD_BITS = 31  # keep compares the top 31 bits of r, so thresholds fit a signed 32-bit kernel argument


@dataclass(frozen=True)
class DropoutKey:
    """One call's dropout: its probability and the generator's key. ``p = 0`` is no dropout."""

    p: float = 0.0
    seed: int = 0
    offset: int = 0

    @property
    def threshold(self) -> int:
        """``round(p * 2^31)``, capped to fit int32: a weight is kept iff ``(r >> 1) >= threshold``."""
        return min(round(self.p * 2**THRESHOLD_BITS), 2**THRESHOLD_BITS - 1)

    @property
    def keep_scale(self) -> float:
        """``1 / (1 - p)``, the survivors' factor that keeps ``E[P_drop] = P``; 0 when ``p = 1``
        (every weight dropped, as torch's dropout returns zeros there)."""
        return 0.0 if self.p >= 1.0 else 1.0 / (1.0 - self.p)


def draw(p: float, generator: torch.Generator | None = None) -> DropoutKey:
    """A fresh key for one call with dropout ``p``, from torch's default CPU generator (or ``generator``);
    no draw (and no generator state consumed) when ``p = 0``. Refused while a CUDA graph is being captured:
    the seed is drawn here, on the host, so every replay of the graph would reuse one mask."""
    if p == 0.0:
        return DropoutKey()
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise AttentionValueError(
            f"dropout_p={p} while a CUDA graph is being captured: the dropout seed is drawn on the host once, so "
            "every replay would drop the same weights; capture with dropout_p=0, or run the dropout step eagerly "
            "(or under torch.compile, whose graph draws the seed itself)"
        )
    seed = int(torch.randint(0, 2**62, (), generator=generator))
    return DropoutKey(p=p, seed=seed, offset=0)


def _mulhilo(a: int, x: Tensor) -> tuple[Tensor, Tensor]:
    """``(hi, lo)``: the high and low 32 bits of ``a * x`` for a 32-bit constant ``a`` and int64 ``x`` in
    ``[0, 2^32)``. The product is below ``2^64``, so int64 multiplication, which wraps modulo ``2^64``,
    holds all 64 of its bits (as a negative number when bit 63 is set); masking after the shift drops the
    sign extension."""
    p = x * a
    return (p >> 32) & _M32, p & _M32


def philox4x32(
    c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: int, k1: int, rounds: int = PHILOX_ROUNDS
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32 on counters ``(c0, c1, c2, c3)`` (int64 tensors holding 32-bit words) with key
    ``(k0, k1)``: four 32-bit words per counter, as int64 tensors of the broadcast shape."""
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _M32  # the key is bumped by a Weyl sequence after each round
        k1 = (k1 + PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def counters(key: DropoutKey, bh: Tensor | int, rows: Tensor, cols: Tensor, N_q: int, N_k: int) -> Tensor:
    """``offset + ((b * H_q + h) * N_q + i) * N_k + j`` (int64), broadcast over ``bh`` (the flat
    ``b * H_q + h``), ``rows`` (``i``) and ``cols`` (``j``)."""
    return key.offset + ((torch.as_tensor(bh, dtype=torch.int64) * N_q + rows.long()) * N_k + cols.long())


def keep_mask(key: DropoutKey, counter: Tensor) -> Tensor:
    """Bool, the shape of ``counter``: whether each weight survives (all True when ``p = 0``)."""
    if key.p == 0.0:
        return torch.ones(counter.shape, dtype=torch.bool, device=counter.device)
    zero = torch.zeros_like(counter)
    r, _, _, _ = philox4x32(counter & _M32, (counter >> 32) & _M32, zero, zero, key.seed & _M32, key.seed >> 32)
    return (r >> 1) >= key.threshold


def drop(P: Tensor, key: DropoutKey, bh: Tensor | int, rows: Tensor, cols: Tensor, N_q: int, N_k: int) -> Tensor:
    """``P * keep * keep_scale`` for a tile of weights ``P`` whose coordinates broadcast from ``bh``,
    ``rows`` and ``cols`` (``P`` itself when ``p = 0``)."""
    if key.p == 0.0:
        return P
    keep = keep_mask(key, counters(key, bh, rows, cols, N_q, N_k))
    return torch.where(keep, P * key.keep_scale, torch.zeros((), dtype=P.dtype, device=P.device))
