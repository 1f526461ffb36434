"""The teaching example's inputs, drawn as the command line draws them (one recipe for the trace tests)."""

from __future__ import annotations

import torch


def teaching_inputs(N_q: int = 6, N_k: int = 6, *, with_dO: bool = False) -> tuple[torch.Tensor, ...]:
    """``manual_seed(0)``, then randn q ``(1, N_q, 4)``, k and v ``(1, N_k, 4)`` in float64; with ``with_dO``
    the 4th randn, dO ``(1, N_q, 4)`` (the stream ``flashattn-teach replay --backward`` draws)."""
    torch.manual_seed(0)
    q = torch.randn(1, N_q, 4, dtype=torch.float64)
    k = torch.randn(1, N_k, 4, dtype=torch.float64)
    v = torch.randn(1, N_k, 4, dtype=torch.float64)
    return (q, k, v, torch.randn(1, N_q, 4, dtype=torch.float64)) if with_dO else (q, k, v)
