"""The backward of every op here: the forward run again under autograd and differentiated.

A tiled forward saves only ``q, k, v, O, lse``, so memory stays O(N); the cost is one forward more than
the eager backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor


@contextlib.contextmanager
def _autograd_dispatch() -> Iterator[None]:
    """Grad mode and the autograd dispatch keys back on. torch.library runs an op's implementation below
    autograd (its autograd kernel excludes those keys), where a torch op records no graph: only an
    ``autograd.Function`` would, so a recompute through the dense path, or through a view taken of a
    Function's output (varlen's transposes), would have nothing to differentiate."""
    K = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (K.AutogradFunctionality, K.AutogradOther, K.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def recomputed_grads(
    forward: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dO: Tensor,
    dlse: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of ``(O, lse) = forward(q, k, v)`` for the gradients ``(dO, dlse)``."""
    with _autograd_dispatch():
        qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
        O, lse = forward(qd, kd, vd)
        dq, dk, dv = torch.autograd.grad((O, lse), (qd, kd, vd), (dO, dlse), allow_unused=True)
    return _laid_out_like(q, dq), _laid_out_like(k, dk), _laid_out_like(v, dv)


def _laid_out_like(t: Tensor, grad: Tensor | None) -> Tensor:
    """``grad`` in ``torch.empty_like(t)``'s layout, the one the fake backward promises: a compiled graph
    reads the result with those strides, and ``q, k, v`` are often strided views (a GPT's ``qkv`` split and
    transposed) while autograd returns other strides. ``None`` (an input the call never read, such as an
    empty sequence) is a zero gradient."""
    out = torch.empty_like(t)
    return out.zero_() if grad is None else out.copy_(grad)


def unaliased(O: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """An op's outputs may not alias its inputs or each other; a path may return views (empty inputs)."""
    return O.clone() if O._base is not None else O, lse.clone() if lse._base is not None else lse
