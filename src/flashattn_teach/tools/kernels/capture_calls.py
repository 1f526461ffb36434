"""The kernel specialisations a GPU run would build, captured on the CPU: every :class:`.cases.Call` run through
the real ``triton_attention`` (and its backward, through autograd) as if its CPU tensors were on a GPU of
generation ``arch``, with :func:`.specialize.capture` recording what the JIT is asked to compile.

"As if on a GPU" (:func:`as_if_on_gpu`) changes these answers and nothing else: the device checks let CPU
tensors through (the FP8 forward's on sm_90 only, as a GPU of capability 8 refuses it, with the FP8 tile
a CUDA call gets rather than the interpreter's), the default configuration is what a plain call runs on ``arch``
(:func:`~flashattn_teach.triton.launch.arch_config`: the shipped row without the paths no GPU has run,
unless switched on), and on sm_80 no tile reads by TMA nor is warp-specialised (as
:mod:`flashattn_teach.triton.tma` decides for a CUDA device of capability 8), and a decode step plans, tiles
and splits as for CUDA tensors on ``arch`` (:func:`_decode_as_if_on_gpu`: ``SM_COUNT[arch]`` SMs). Every
other decision (the backward's route, TMA fallbacks, lane groups, the JIT's integer specialisation)
is the library's own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .cases import Call, head_bias
from .decode_cases import DecodeCall
from .flex_cases import BLOCK, N_K, N_Q, BlockMaskCall
from .specialize import CompileRequest, capture

# Streaming multiprocessors of the GPU each arch stands for (H100 and H200: 132; A100: 108): the decode
# planner's split count (serving.splitkv.cuda_num_splits) reads them from the device on a GPU
SM_COUNT = {"sm90": 132, "sm80": 108}


@contextmanager
def as_if_on_gpu(arch: str) -> Iterator[None]:
    """Within the block, ``triton_attention`` on CPU tensors chooses and launches as on an ``arch`` GPU."""
    from ...triton import launch, support, tma

    def default_config(q, s, variants=launch.PLAIN, *, tried=True):
        return launch.arch_config(arch, q.dtype, s, variants, tried=tried)  # what a plain call runs there

    def ws_reason(*args):
        return saved[3](*args) or "the GPU is not sm_90 (the pass that specialises it is Hopper's)"

    from ...dispatch import fp8 as dispatch_fp8
    from ...triton import fp8
    from ...triton.provenance import as_tried
    from ...triton.variants import NO_DROPOUT, KernelVariants

    def fp8_reason(q, opts):  # as for a CUDA device of capability 9 (sm_90) or 8
        return saved[5](q, opts) or (None if arch == "sm90" else "the FP8 forward runs on sm_90 (Hopper) only")

    def fp8_forward(q, k, v, opts, *, config=None):  # the tile triton_fp8_forward takes for a CUDA tensor
        s, used = opts.shapes, KernelVariants.from_spec(opts.mask, NO_DROPOUT).used
        config = config or as_tried(fp8.fp8_forward_config(max(s.D, s.D_v), variants=used))
        return saved[7](q, k, v, opts, config=config)

    saved: tuple[Any, ...] = (support.device_reason, launch.default_config, tma.use_tma, tma.ws_reason)
    saved += (fp8.device_reason, fp8.fp8_unsupported_reason, fp8.INTERPRETER_ROUNDS_AS_GPU)
    saved += (dispatch_fp8.triton_fp8_forward,)
    support.device_reason = fp8.device_reason = lambda t: None
    fp8.fp8_unsupported_reason, fp8.INTERPRETER_ROUNDS_AS_GPU = fp8_reason, True
    dispatch_fp8.triton_fp8_forward = fp8_forward
    launch.default_config = default_config
    if arch != "sm90":  # as tma.use_tma and tma.ws_reason answer for a CUDA device of capability 8
        tma.use_tma = lambda c, *tensors: False
        tma.ws_reason = ws_reason
    try:
        with _decode_as_if_on_gpu(arch):
            yield
    finally:
        support.device_reason, launch.default_config, tma.use_tma, tma.ws_reason, fp8.device_reason = saved[:5]
        fp8.fp8_unsupported_reason, fp8.INTERPRETER_ROUNDS_AS_GPU, dispatch_fp8.triton_fp8_forward = saved[5:]


@contextmanager
def _decode_as_if_on_gpu(arch: str) -> Iterator[None]:
    """The decode step's answers for a CUDA ``q`` on ``arch``: ``backend="auto"`` plans the Triton split-KV
    kernel (when no gradient is wanted, as :func:`~flashattn_teach.dispatch.planner.plan_decode` does for
    CUDA tensors), the launch takes :func:`~flashattn_teach.serving.launch.decode_config`'s tiles for
    ``arch`` rather than the interpreter's, and ``num_splits=0`` counts ``SM_COUNT[arch]`` SMs."""
    from ...dispatch import Plan, planner
    from ...serving import launch as decode_launch
    from ...serving.splitkv import cuda_num_splits
    from ...triton import support

    def plan_decode(backend, q, k_cache, v_cache):
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache))
        if backend == "auto" and not grads and support.decode_unsupported_reason(q, v_cache) is None:
            return Plan("triton", "CUDA tensors: the Triton split-KV decode kernel")
        return saved[0](backend, q, k_cache, v_cache)

    def triton_decode(q, k_cache, v_cache, k, v, step, *, config=None):
        config = config or decode_launch.decode_config(q.dtype, q.shape[3], arch, v_cache.shape[3])
        return saved[1](q, k_cache, v_cache, k, v, step, config=config)

    def default_num_splits(q, k_cache, L_max):
        B, H_q, N_q, D = q.shape
        H_kv = k_cache.shape[1]
        return cuda_num_splits(B=B, H_kv=H_kv, N_q=N_q, group=H_q // H_kv, N_k=L_max, D=D, sm_count=SM_COUNT[arch])

    saved = (planner.plan_decode, decode_launch.triton_decode, decode_launch.default_num_splits)
    planner.plan_decode, decode_launch.triton_decode, decode_launch.default_num_splits = (
        plan_decode, triton_decode, default_num_splits
    )  # fmt: skip
    try:
        yield
    finally:
        planner.plan_decode, decode_launch.triton_decode, decode_launch.default_num_splits = saved


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


def run_call(call: Call | DecodeCall | BlockMaskCall, arch: str) -> None:
    """``call`` through ``triton_attention`` and, where ``call.backward`` and the backward ships, its backward
    (a decode step through ``flash_attention_with_kvcache``)."""
    from ...triton import triton_attention
    from ...triton.configs import max_head_dim

    if isinstance(call, DecodeCall):
        return run_decode_call(call)
    if isinstance(call, BlockMaskCall):  # create_block_mask on CUDA: the translated function's Triton launch
        from ...triton.block_mask import triton_block_kinds

        kinds = triton_block_kinds(call.mask_mod, call.B, call.H, N_Q, N_K, *BLOCK, torch.device("cpu"))
        if kinds is None:
            raise ValueError(f"{call.name}: the translator refused the function (create_block_mask would use torch)")
        return None
    c = call.case
    if call.warp_specialize:  # the switch is read at every call (triton.provenance)
        os.environ["FLASHATTN_TEACH_WARP_SPECIALIZE"] = "1"
        try:
            return _run_api_call(call)
        finally:
            del os.environ["FLASHATTN_TEACH_WARP_SPECIALIZE"]
    if call.packed or call.fp8 or call.sinks or call.api or call.score_mod:
        return _run_api_call(call)
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


def _run_api_call(call: Call) -> None:
    """A varlen, FP8 or sinks row of bench_gpu_variants.py or a first-light masked case, through the public API
    as they call it."""
    import flashattn_teach as fa

    from ...triton.configs import max_head_dim

    c = call.case
    backward = call.backward and c.D <= max_head_dim(c.dtype, backward=True)  # where the backward ships
    if call.packed is not None:
        T = sum(call.packed)
        q, k, v = (torch.zeros(T, c.H_q if i == 0 else c.H_kv, c.D, dtype=c.dtype) for i in range(3))
        q, k, v = (t.requires_grad_(backward) for t in (q, k, v))
        cu = torch.tensor([0, *torch.tensor(call.packed).cumsum(0).tolist()], dtype=torch.int32)
        longest = max(call.packed)
        O = fa.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=c.causal, backend="triton")
    elif call.fp8:
        q, k, v, _ = _inputs(call)
        descale = torch.ones(c.B, c.H_kv)
        q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        O = fa.flash_attention(
            q8, k8, v8, causal=c.causal, causal_align=c.causal_align, q_descale=descale, k_descale=descale,
            v_descale=descale, window=call.window, softcap=call.softcap, seqlens_k=_lengths(call),
            alibi_slopes=torch.rand(c.H_q) if call.alibi else None, sinks=_sinks(call), backend="triton",
        )  # fmt: skip
    else:
        q, k, v, _ = _inputs(call)
        q, k, v = (t.requires_grad_(backward) for t in (q, k, v))
        mask = None if call.padding is None else torch.arange(c.N_k) < torch.tensor(call.padding)[:, None]
        O = fa.flash_attention(
            q, k, v, score_mod=head_bias, enable_gqa=True, backend="triton"
        ) if call.score_mod else fa.flash_attention(
            q, k, v, causal=c.causal, causal_align=c.causal_align, window=call.window, softcap=call.softcap,
            attn_mask=None if mask is None else mask.reshape(c.B, 1, 1, c.N_k), seqlens_k=_lengths(call),
            sinks=_sinks(call), backend="triton",
        )  # fmt: skip
    if backward:
        assert isinstance(O, Tensor)
        O.backward(torch.zeros_like(O))


def _lengths(call: Call) -> torch.Tensor | None:
    return None if call.seqlens_k is None else torch.tensor(call.seqlens_k, dtype=torch.int32)


def _sinks(call: Call) -> torch.Tensor | None:
    return torch.linspace(-1.0, 2.0, call.case.H_q) if call.sinks else None


def run_decode_call(c: DecodeCall) -> None:
    """One decode step as the test or benchmark makes it, on CPU tensors (``empty``: never read)."""
    import flashattn_teach as fa

    D_v = c.head_dim_v
    q = torch.zeros(c.B, c.H_q, c.N_new, c.D, dtype=c.dtype)
    table = None
    if c.page_size is None:
        k_cache, v_cache = (torch.empty(c.B, c.H_kv, c.N_max, d, dtype=c.dtype) for d in (c.D, D_v))
    else:
        per_seq = c.N_max // c.page_size
        blocks = c.B * per_seq
        table = torch.arange(blocks, dtype=torch.int32).reshape(c.B, per_seq)  # (B, pages per sequence)
        if c.layout == "head-major":  # (num_blocks, H_kv, page, D)
            k_cache, v_cache = (torch.empty(blocks, c.H_kv, c.page_size, d, dtype=c.dtype) for d in (c.D, D_v))
        else:  # flash-attn's (num_blocks, page, H_kv, D), passed as its (num_blocks, H_kv, page, D) view
            k_cache, v_cache = (
                torch.empty(blocks, c.page_size, c.H_kv, d, dtype=c.dtype).transpose(1, 2) for d in (c.D, D_v)
            )
    k = v = None
    if c.new_kv:
        k, v = (torch.zeros(c.B, c.H_kv, c.N_new, d, dtype=c.dtype) for d in (c.D, D_v))
    fa.flash_attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(c.lengths, dtype=torch.int32), block_table=table,
        cache_leftpad=None if c.leftpad is None else torch.tensor(c.leftpad, dtype=torch.int32),
        sinks=torch.zeros(c.H_q) if c.sinks else None, causal=c.causal, window=c.window, softcap=c.softcap,
        alibi_slopes=torch.rand(c.H_q) if c.alibi else None, num_splits=c.num_splits, backend=c.backend,
    )  # fmt: skip


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


def capture_calls(calls: list[Call | DecodeCall | BlockMaskCall], arch: str) -> tuple[list[Captured], dict[str, str]]:
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
