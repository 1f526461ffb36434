"""Optional autotuning: time a few configurations on the caller's own shapes and keep the fastest.

The shipped table (:mod:`.configs`) is a good default; the fastest tiles still depend on sequence lengths,
causality and the exact GPU. :func:`autotune` runs each candidate once for warm-up, times it (forward, and
forward plus backward when ``backward=True``), and remembers the winner per shape class, so a training
loop pays for the search once. ``triton_attention(..., config="autotune")`` uses it.

Candidates default to the configurations that pass the compile checks: the shipped rows of both GPU
generations for this dtype and head dimension, so every candidate is known to compile without spills.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor

from .._options import make_options
from .._validate.inputs import validate_inputs
from ..errors import AttentionTypeError, AttentionValueError
from .configs import ARCHS, DTYPES, TEST_CONFIG, AttentionConfig, arch_of, check_backward_config, shipped_config
from .devices import device_reason, shape_reason
from .provenance import as_tried

Timer = Callable[[Callable[[], object]], float]

_CACHE: dict[tuple[object, ...], AttentionConfig] = {}


def candidate_configs(q: Tensor, head_dim: int, needs_backward: bool) -> list[AttentionConfig]:
    """Compile-checked configurations for these inputs, the current GPU generation's row first, without the
    paths no GPU has run unless they are switched on (:func:`.provenance.as_tried`)."""
    if q.device.type != "cuda":
        return [TEST_CONFIG, AttentionConfig.uniform(16, 32), AttentionConfig.uniform(32, 32)]
    own = arch_of(q.device)
    rows = [as_tried(shipped_config(head_dim, q.dtype, a)) for a in (own, *(a for a in ARCHS if a != own))]
    rows = [c for c in rows if not needs_backward or c.backward_dkdv is not None]
    return list(dict.fromkeys(rows))


def _wall_clock_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _default_timer(q: Tensor) -> Timer:
    if q.device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=5, rep=20))
    return _wall_clock_ms


def _shape_class(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()  # next power of two: lengths 513..1024 share a result


def autotune(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    enable_gqa: bool = False,
    backward: bool = True,
    candidates: Sequence[AttentionConfig] | None = None,
    timer: Timer | None = None,
) -> AttentionConfig:
    """The fastest of ``candidates`` on these inputs; ``timer(fn)`` returns milliseconds for one call."""
    from .autograd import TritonAttentionFunction, TritonLaunch

    s = validate_inputs(q, k, v, causal_align=causal_align, enable_gqa=enable_gqa)
    if q.dtype not in DTYPES:
        raise AttentionTypeError(f"autotune needs q of float16, bfloat16 or float32, got {q.dtype}")
    reason = device_reason(q) or shape_reason(q, s, needs_grad=backward)
    if reason is not None:
        raise AttentionValueError(f"autotune: {reason}")
    device = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else q.device.type
    key = (
        device,
        q.dtype,
        s.D,
        s.D_v,
        _shape_class(s.N_q),
        _shape_class(s.N_k),
        s.group,
        causal,
        causal_align,
        backward,
    )
    if candidates is None and key in _CACHE:
        return _CACHE[key]
    pool = list(candidates) if candidates is not None else candidate_configs(q, max(s.D, s.D_v), backward)
    if not pool:
        raise AttentionValueError("candidates must hold at least one AttentionConfig, got an empty sequence")
    for c in pool:
        if not isinstance(c, AttentionConfig):
            raise AttentionTypeError(f"candidates must be AttentionConfig instances, got {type(c).__name__}: {c!r}")
        if backward:
            check_backward_config(c, q, s)
    timer = timer or _default_timer(q)
    opts = make_options(q, k, v, causal=causal, causal_align=causal_align, enable_gqa=enable_gqa)
    q_, k_, v_ = (t.detach().requires_grad_(backward) for t in (q, k, v))

    def step(config: AttentionConfig) -> None:
        with torch.set_grad_enabled(backward):
            O, _ = TritonAttentionFunction.apply(q_, k_, v_, opts, TritonLaunch(config), None)
            if backward:
                O.backward(torch.ones_like(O))

    times = []
    for config in pool:
        step(config)  # compile outside the timing
        times.append(timer(partial(step, config)))
    best = pool[min(range(len(pool)), key=times.__getitem__)]
    if candidates is None:
        _CACHE[key] = best
    return best
