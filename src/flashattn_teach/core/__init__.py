"""The read-first FlashAttention: one idea per file, 4-D ``(B, H, N, D)`` tensors, causal or not, nothing else.

Read in this order; each file is checked against the one before (``tests/core/``):

1. ``dense.py``: the oracle. ``S = scale Q K^T``, ``P = softmax(S)``, ``O = P V``, ``lse = logsumexp(S)``,
   with the whole ``N_q x N_k`` matrix in memory (Vaswani et al. 2017).
2. ``online_softmax.py``: the one update that makes tiling possible: fold a tile of scores into the running
   max ``m_i``, denominator ``l_i`` and unnormalised output ``acc`` (Milakov & Gimelshein 2018; FlashAttention-2
   Alg. 1 lines 9-10), then ``O = acc / l``, ``lse = m + log l``. Every CPU path of the library calls it.
3. ``loops.py``: the two loop orders around that update. Key-major is FlashAttention's Alg. 1 (Dao et al.
   2022: key blocks outside, every row's statistics rescaled in HBM); query-major is FlashAttention-2's Alg. 1
   (Dao 2023: query blocks outside, the state on chip, ``O_i`` written once). Causal tiles above the diagonal
   are skipped, the diagonal's masked.
4. ``backward.py``: the backward recomputes ``P_ij = exp(S_ij - lse_i)`` tile by tile from the saved ``lse``
   and uses ``delta_i = rowsum(dO_i * O_i)`` (FlashAttention-2 Alg. 2); ``tile_terms`` is the one tile's
   ``P, dP, dS`` and ``dQ, dK, dV`` contributions, shared by every backward in the library.
5. ``kernel.py``: the same forward and backward as Triton kernels (exp2, float32 accumulation, a named
   ``CAUSAL`` stage, any ``N``); not imported here, so ``core`` runs without triton:
   ``from flashattn_teach.core import kernel``. On a CPU it runs in Triton's interpreter
   (``TRITON_INTERPRET=1`` set before triton is imported).

The full-featured paths (``reference/``, ``triton/kernels/``, ``replay/``) each open with "Changes from
core/...": what they add to these files and why.
"""

from __future__ import annotations

from .backward import BackwardTerms, flash_backward, tile_terms
from .dense import dense_attention
from .loops import key_major_attention, query_major_attention

__all__ = [
    "BackwardTerms",
    "dense_attention",
    "flash_backward",
    "key_major_attention",
    "query_major_attention",
    "tile_terms",
]
