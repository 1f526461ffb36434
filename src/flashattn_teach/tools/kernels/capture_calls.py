"""The kernel specialisations a GPU run would build, captured on the CPU: every :class:`.cases.Call` run through
the real ``triton_attention`` (and its backward, through autograd) as if its CPU tensors were on a GPU of
generation ``arch``, with :func:`.specialize.capture` recording what the JIT is asked to compile.

"As if on a GPU" (:func:`as_if_on_gpu`) changes three answers and nothing else: the device check lets CPU
tensors through, the default configuration is what a plain call runs on ``arch``
(:func:`~flashattn_teach.triton.launch.arch_config`: the shipped row without the paths no GPU has run,
unless switched on), and on sm_80 no tile reads by TMA nor is warp-specialised (as
:mod:`flashattn_teach.triton.tma` decides for a CUDA device of capability 8). Every other decision (the
backward's route, TMA fallbacks, lane groups, the JIT's integer specialisation) is the library's own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from .cases import Call
from .specialize import CompileRequest, capture


@contextmanager
def as_if_on_gpu(arch: str) -> Iterator[None]:
    """Within the block, ``triton_attention`` on CPU tensors chooses and launches as on an ``arch`` GPU."""
    from ...triton import launch, support, tma

    def default_config(q, s, variants=launch.PLAIN, *, tried=True):
        return launch.arch_config(arch, q.dtype, s, variants, tried=tried)  # what a plain call runs there

    def ws_reason(*args):
        return saved[3](*args) or "the GPU is not sm_90 (the pass that specialises it is Hopper's)"

    saved = (support.device_reason, launch.default_config, tma.use_tma, tma.ws_reason)
    support.device_reason = lambda t: None
    launch.default_config = default_config
    if arch != "sm90":  # as tma.use_tma and tma.ws_reason answer for a CUDA device of capability 8
        tma.use_tma = lambda c, *tensors: False
        tma.ws_reason = ws_reason
    try:
        yield
    finally:
        support.device_reason, launch.default_config, tma.use_tma, tma.ws_reason = saved


def _inputs(call: Call) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``q, k, v, dO`` of ``call`` on the CPU (zeros: never read), ``(B, N, H, D)`` views where ``case.bnhd``."""
    c = call.case

    def make(H: int, N: int) -> Tensor:
        if c.bnhd:
            return torch.zeros(c.B, N, H, c.D, dtype=c.dtype).transpose(1, 2)
        return torch.zeros(c.B, H, N, c.D, dtype=c.dtype)

    return make(c.H_q, c.N_q), make(c.H_kv, c.N_k), make(c.H_kv, c.N_k), make(c.H_q, c.N_q).contiguous()


def _config(call: Call, arch: str):
    """The configuration ``call.forward`` asks for (None: the shipped default, as the library chooses)."""
    from ...triton.configs import shipped_config

    if call.forward == "default":
        return None
    config = shipped_config(call.case.D, call.case.dtype, arch)
    f = config.forward  # as bench_attention.py's provider_config builds triton-ptr's and triton-nows' forward
    forward = f.by_pointers() if call.forward == "pointers" else f.unspecialised()
    return dataclasses.replace(config, forward=forward)


def run_call(call: Call, arch: str) -> None:
    """``call`` through ``triton_attention`` and, where ``call.backward`` and the backward ships, its backward."""
    from ...triton import triton_attention
    from ...triton.configs import max_head_dim

    c = call.case
    q, k, v, dO = _inputs(call)
    backward = call.backward and c.D <= max_head_dim(c.dtype, backward=True)
    q, k, v = (t.requires_grad_(backward) for t in (q, k, v))
    seqlens = None if call.seqlens_k is None else torch.tensor(call.seqlens_k, dtype=torch.int32)
    O = triton_attention(
        q, k, v, causal=c.causal, causal_align=c.causal_align, enable_gqa=c.group > 1, config=_config(call, arch),
        window=call.window, softcap=call.softcap, seqlens_k=seqlens, deterministic=call.deterministic,
    )  # fmt: skip
    if backward:
        assert isinstance(O, Tensor)
        O.backward(dO)


@dataclass
class Captured:
    """One specialisation: its compile request and the calls that launch it."""

    request: CompileRequest
    calls: list[str]

    @property
    def key(self) -> str:
        return request_key(self.request)


def request_key(r: CompileRequest) -> str:
    """Identical specialisations share this: kernel (by its source's hash), signature, constants,
    attributes and options."""
    fields = {
        "kernel": f"{r.fn.__module__}.{r.name}",
        "source": r.fn.cache_key,
        "signature": r.flat_signature(),  # with the records' field names: a reordered record is a new kernel
        "constexprs": sorted((list(p), repr(v)) for p, v in r.constexprs.items()),
        "attrs": sorted((list(p), repr(v)) for p, v in r.attrs.items()),
        "options": sorted((k, repr(v)) for k, v in r.options.__dict__.items()),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def capture_calls(calls: list[Call], arch: str) -> tuple[list[Captured], dict[str, str]]:
    """The distinct specialisations ``calls`` launch on ``arch``, in first-launch order, and the calls that
    raised instead (name -> the exception's first line): a refusal the GPU run would also meet."""
    found: dict[str, Captured] = {}
    refused: dict[str, str] = {}
    with as_if_on_gpu(arch):
        for call in calls:
            with capture(arch) as requests:
                try:
                    run_call(call, arch)
                except Exception as e:  # a call the library refuses is a result (what it launched first stays)
                    refused[call.name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            for r in requests:
                entry = found.setdefault(request_key(r), Captured(r, []))
                if call.name not in entry.calls:
                    entry.calls.append(call.name)
    return list(found.values()), refused
