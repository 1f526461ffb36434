"""One block of ring attention on one rank: the local queries against one key/value shard, forward and
backward, through the library's own backends.

The forward is the dispatcher's (:func:`flashattn_teach.dispatch.run` on the backend the ring chose once
per call; with explicit tile sizes, the online reference). The backward recomputes
``P_ij = exp(S_ij - lse_i)`` from the *global* ``lse`` of the merged output and uses the global
``delta_i = rowsum(dO_i * O_i)`` (FA2 Alg. 2), so each block's gradients are exactly that block's share of
the full gradient and simply add up: the Triton launcher on CUDA (and on CPU tensors under
``TRITON_INTERPRET=1``), :func:`flashattn_teach.reference.flash_backward` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .._options import make_options
from .._validate.inputs import validate_inputs
from ..dispatch import planner, runner
from ..reference import flash_backward, online_attention
from ..reference.defaults import DEFAULT_BLOCK_M, DEFAULT_BLOCK_N


@dataclass(frozen=True)
class LocalBackend:
    """The backend every block of a ring call runs on, resolved once per call.

    ``name`` is a concrete backend of :data:`flashattn_teach.BACKENDS` (never ``"auto"``); ``block_m`` and
    ``block_n`` are set only for the online reference with explicit tile sizes (``BLOCK_M``, ``BLOCK_N``).
    """

    name: str
    scale: float
    block_m: int | None = None
    block_n: int | None = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> tuple[Tensor, Tensor]:
        """``(O_ij, lse_ij)``: ``q (B, H_q, n_q, D)``, ``k, v (B, H_kv, n_k, D[_v])`` -> ``(B, H_q, n_q, D_v)``,
        ``(B, H_q, n_q)``; causal is top-left in the block's own coordinates."""
        if self.block_m is not None and self.block_n is not None:
            return online_attention(
                q,
                k,
                v,
                causal=causal,
                scale=self.scale,
                enable_gqa=True,
                block_m=self.block_m,
                block_n=self.block_n,
                return_lse=True,
            )
        opts = make_options(q, k, v, causal=causal, scale=self.scale, enable_gqa=True)
        return runner.run(planner.Plan(self.name, "the ring's backend, chosen once per call"), q, k, v, opts)

    def backward(
        self, q: Tensor, k: Tensor, v: Tensor, O: Tensor, lse: Tensor, dO: Tensor, dlse: Tensor | None, *, causal: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` of one block from the rows' global ``O, lse, dO, dlse``; ``dk, dv`` are summed
        over the query heads that share a key/value head."""
        if self.name == "triton":
            return _triton_backward(q, k, v, O, lse, dO, dlse, causal=causal, scale=self.scale)
        return flash_backward(
            q,
            k,
            v,
            O,
            lse,
            dO,
            dlse=dlse,
            causal=causal,
            scale=self.scale,
            enable_gqa=True,
            block_m=self.block_m or DEFAULT_BLOCK_M,
            block_n=self.block_n or DEFAULT_BLOCK_N,
        )


def _triton_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    O: Tensor,
    lse: Tensor,
    dO: Tensor,
    dlse: Tensor | None,
    *,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The fused backward kernels on 4-D ``(B, H, n, X)`` blocks, as :mod:`flashattn_teach.triton.autograd`
    calls them; the kernels read ``lse`` and ``dlse`` as contiguous float32 ``(B, H_q, n_q)``."""
    from ..triton import launch
    from ..triton.autograd import deterministic_backward

    s = validate_inputs(q, k, v, scale=scale, enable_gqa=True)
    lse32 = lse.float().contiguous()
    dlse32 = None if dlse is None else dlse.float().contiguous()
    config = launch.default_config(q, s)
    # torch.use_deterministic_algorithms(True) selects the reproducible backward here too
    deterministic, _ = deterministic_backward(False)
    return launch.backward(
        q, k, v, O, lse32, dO.contiguous(), dlse32, s, causal=causal, causal_align="top_left", config=config,
        deterministic=deterministic,
    )  # fmt: skip
