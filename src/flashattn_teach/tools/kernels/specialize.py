"""Compile what runs: the specialisation Triton's JIT would build for a call, obtained from the JIT itself.

``kernel[grid](*args, **kwargs)`` does not compile the kernel's source as written. The JIT binder
(``triton.runtime.jit.create_function_from_signature``, through the backend's ``specialize_impl``)
first looks at every argument value:

    integer equal to 1          becomes a constant (``GROUP = 1`` deletes the loop over the group)
    integer divisible by 16     gets the attribute ``tt.divisibility = 16`` (vectorised address math)
    pointer 16-byte aligned     likewise
    integer >= 2**31            is typed i64 instead of i32

then ``JITFunction._pack_args`` turns that into the ``signature``, ``constexprs`` and ``attrs`` of an
``ASTSource`` and parses the launch options. Rather than re-deriving these rules (which differ between
triton releases), :func:`capture` runs the real ``JITFunction.run`` on CPU tensors with a stand-in
driver that names a GPU target, and records what ``JITFunction._do_compile`` is asked to build instead of
building it. Nothing is launched; no GPU is needed. Both triton 3.6 and 3.9 go through ``_do_compile``
with the same arguments.

Because it runs the real launcher (:func:`flashattn_teach.triton.launch.forward` / ``backward``), the
compile checks and the loop profile follow kernel signature changes without edits here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..._validate.inputs import AttentionShapes
from ...dropout import DropoutKey
from ...triton.configs import AttentionConfig
from ...triton.variants import NO_DROPOUT, PLAIN, UNBOUNDED, KernelVariants

# The benchmark's long-sequence shape (benchmarks/results/gpu/*/bench/attention.csv, hd128 rows): every
# size divisible by 16 and none equal to 1, as in the runs the loop profile is calibrated against.
SAMPLE_BATCH = 2
SAMPLE_HEADS = 16
SAMPLE_SEQ = 8192
SAMPLE_DROPOUT = DropoutKey(p=0.1, seed=2**40 + 1)  # dropout of the sample calls, a 64-bit seed
# A sample call with grouped-query attention: 16 query heads share 4 key/value heads (GROUP = 4)
SAMPLE_GQA_KV_HEADS = 4


@dataclass(frozen=True)
class CompileRequest:
    """What ``JITFunction._do_compile`` receives for one launch: enough for ``triton.compile``."""

    fn: Any  # the triton.runtime.jit.JITFunction
    signature: dict[str, str]  # argument name -> "*bf16", "i32", "fp32", "constexpr", ...
    constexprs: dict[tuple[int, ...], Any]  # argument path -> constant value
    attrs: dict[tuple[int, ...], list[list[Any]]]  # argument path -> [["tt.divisibility", 16]]
    options: Any  # the backend's parsed options (num_warps, num_stages, ...)
    target: Any  # triton.backends.compiler.GPUTarget

    @property
    def name(self) -> str:
        return str(self.fn.__name__)

    def flat_signature(self) -> dict[str, str]:
        """:attr:`signature` with each record (:mod:`flashattn_teach.triton.kernels.records`) spelt out field by
        field: ``{"ptr.Q": "*bf16", "stride.Q.stride_b": "i32", ...}``, the names the constants and attributes use."""
        return {name: kind for name, kind in _flatten(self.signature.items())}

    def path_name(self, path: tuple[int, ...]) -> str:
        """The name of the argument at ``path`` (``(0,)``: ``ptr``; ``(1, 0, 3)``: ``stride.Q.stride_d``)."""
        label, value = list(self.signature.items())[path[0]]
        for index in path[1:]:
            fields = getattr(value, "_fields", None)
            label += "." + (fields[index] if fields is not None else str(index))
            value = value[index]
        return label

    def constants(self) -> dict[str, Any]:
        """Constant arguments by name (constexpr parameters and integers the JIT turned into constants), a
        record's fields by dotted name (``stride.Q.stride_d``); a record's field that is None (an unused variant) is
        left out. A ``tl.constexpr`` record, the kernels' :class:`~flashattn_teach.triton.flags.Flags`, gives
        each field under its bare name (``CAUSAL``), the name it had as a parameter of its own."""
        named: dict[str, Any] = {}
        for path, value in self.constexprs.items():
            fields = getattr(value, "_fields", None)
            if len(path) == 1 and fields is not None:
                named.update(zip(fields, value, strict=True))
            elif value is not None or len(path) == 1:
                named[self.path_name(path)] = value
        return named

    def divisible_by_16(self) -> list[str]:
        return [self.path_name(path) for path, a in self.attrs.items() if ["tt.divisibility", 16] in a]

    def source(self):
        """The ``triton.compiler.ASTSource`` the JIT would compile."""
        import triton

        return triton.compiler.ASTSource(self.fn, self.signature, self.constexprs, self.attrs)

    def compile(self):
        """``triton.compile`` of :meth:`source` with the JIT's options, for :attr:`target`."""
        import triton

        return triton.compile(self.source(), target=self.target, options=self.options.__dict__)


def _flatten(items) -> Iterator[tuple[str, str]]:
    """``(name, kind)`` of each argument, a record's fields as ``record.field``."""
    for name, kind in items:
        fields = getattr(kind, "_fields", None)
        if isinstance(kind, tuple):
            names = fields if fields is not None else [str(i) for i in range(len(kind))]
            yield from _flatten((f"{name}.{field}", value) for field, value in zip(names, kind, strict=True))
        else:
            yield name, kind


class _CompileOnlyDriver:
    """Enough of a triton driver for ``JITFunction.run`` to specialise and stop before compiling."""

    DEVICE = "ahead-of-time"  # a device key no real device uses, so JIT caches never mix

    def __init__(self, target) -> None:
        self.target = target

    def get_current_device(self) -> str:
        return self.DEVICE

    def get_current_stream(self, device: object) -> int:
        return 0

    def get_current_target(self):
        return self.target


@contextmanager
def capture(arch: str) -> Iterator[list[CompileRequest]]:
    """Within the block, launching any ``@triton.jit`` kernel records a :class:`CompileRequest` for
    ``arch`` ("sm90", "sm80") and returns without compiling or launching. Needs TRITON_INTERPRET unset."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from ...triton.devices import interpreting

    if interpreting():
        raise RuntimeError("capturing the JIT's specialisation needs TRITON_INTERPRET unset (it is set here)")
    target = GPUTarget("cuda", int(arch.removeprefix("sm")), 32)
    requests: list[CompileRequest] = []
    touched: list[Any] = []

    def record(self, key, signature, device, constexprs, options, attrs, warmup):
        touched.append(self)
        requests.append(CompileRequest(self, dict(signature), dict(constexprs), dict(attrs), options, target))
        return None  # JITFunction.run returns early when there is no kernel

    saved_driver, saved_compile = driver._active, JITFunction._do_compile
    driver.set_active(_CompileOnlyDriver(target))
    JITFunction._do_compile = record
    try:
        yield requests
    finally:
        JITFunction._do_compile = saved_compile
        driver._active = saved_driver
        for fn in touched:  # drop the binder made for the stand-in device
            fn.device_caches.pop(_CompileOnlyDriver.DEVICE, None)


def requests_for(launch: Callable[[], object], arch: str) -> list[CompileRequest]:
    """The compile requests of every kernel launch ``launch()`` makes, in launch order."""
    with capture(arch) as requests:
        launch()
    return requests


def request_for_call(kernel, *args: Any, arch: str = "sm90", **kwargs: Any) -> CompileRequest:
    """The compile request of one direct call ``kernel[grid](*args, **kwargs)`` (CPU tensors are fine)."""
    (request,) = requests_for(lambda: kernel[(1,)](*args, **kwargs), arch)
    return request


def sample_shapes(
    dtype: torch.dtype, head_dim: int, group: int = 1, head_dim_v: int | None = None
) -> tuple[AttentionShapes, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sample non-causal call: ``(s, q, k, v)`` as ``(B, H, N, D)`` CPU tensors (allocated, never read);
    the values' head dim is ``head_dim_v`` (default ``head_dim``)."""
    B, H, N = SAMPLE_BATCH, SAMPLE_HEADS, SAMPLE_SEQ
    H_kv = H // group
    D_v = head_dim if head_dim_v is None else head_dim_v
    s = AttentionShapes(batch=(B,), H_q=H, H_kv=H_kv, N_q=N, N_k=N, D=head_dim, D_v=D_v, rank=4, scale=head_dim**-0.5)
    q = torch.empty(B, H, N, head_dim, dtype=dtype)
    k = torch.empty(B, H_kv, N, head_dim, dtype=dtype)
    v = torch.empty(B, H_kv, N, D_v, dtype=dtype)
    return s, q, k, v


@contextmanager
def one_lane_group() -> Iterator[None]:
    """Within the block the launcher covers every head dim with one padded lane group, as it did before
    :func:`flashattn_teach.triton.lanes.lane_groups` split 192 into 128 + 64: for comparing the two builds."""
    from ...triton import launch
    from ...triton.lanes import block_d

    saved = launch.lane_groups
    launch.lane_groups = lambda head_dim: (block_d(head_dim), 0)
    try:
        yield
    finally:
        launch.lane_groups = saved


def attention_requests(
    config: AttentionConfig,
    dtype: torch.dtype,
    head_dim: int,
    arch: str,
    *,
    backward: bool,
    causal: bool = True,
    group: int = 1,
    variants: KernelVariants = PLAIN,
    head_dim_v: int | None = None,
) -> dict[str, CompileRequest]:
    """The kernels the launcher compiles for a sample call (see :func:`sample_shapes`), by kernel name of
    :data:`flashattn_teach.triton.configs.KERNELS`: the forward, or the three backward kernels; with
    ``variants`` (e.g. :func:`sample_variants`) the kernels of a call that uses them; ``head_dim_v`` as
    :func:`sample_shapes`'s."""
    from ...triton.launch import backward as launch_backward
    from ...triton.launch import forward as launch_forward

    s, q, k, v = sample_shapes(dtype, head_dim, group, head_dim_v)
    if not backward:
        (fwd,) = requests_for(
            lambda: launch_forward(
                q, k, v, s, causal=causal, causal_align="bottom_right", config=config, variants=variants
            ),
            arch,
        )
        return {"forward": fwd}
    o, do = (torch.empty(*q.shape[:-1], s.D_v, dtype=dtype) for _ in range(2))
    lse = torch.empty(q.shape[:-1], dtype=torch.float32)

    # a ``split`` dK/dV kernel launches twice; its dK program (the heavier: it also holds V_j, dP and dS)
    # stands for both
    def launch(deterministic: bool) -> list[CompileRequest]:
        return requests_for(
            lambda: launch_backward(
                q, k, v, o, lse, do, None, s, causal=causal, causal_align="bottom_right", config=config,
                variants=variants, deterministic=deterministic,
            ),
            arch,
        )  # fmt: skip

    preprocess, dkdv, *_, dq = launch(deterministic=True)
    out = {"backward_preprocess": preprocess, "backward_dkdv": dkdv, "backward_dq": dq}
    if config.backward_fused is not None:
        _, out["backward_fused"] = launch(deterministic=False)  # the preprocess, then the one-kernel backward
    return out


def sample_variants(
    *,
    window: bool = True,
    softcap: bool = True,
    alibi: bool = True,
    seqlens: bool = False,
    dropout: bool = False,
    mask: torch.dtype | None = None,
) -> KernelVariants:
    """Variants for a sample call of :func:`sample_shapes`: a causal sliding window of 4096 keys, Gemma 2's
    softcap of 50, ALiBi slopes per head and, with ``seqlens``, key lengths per batch element (allocated,
    never read); with ``dropout``, dropout 0.1 under a 64-bit seed; with ``mask`` (torch.bool, or a float
    dtype for an additive mask), a padding mask of shape ``(B, 1, 1, N_k)`` broadcast over heads and rows."""
    return KernelVariants(
        window=window,
        left=4096 if window else UNBOUNDED,
        right=0 if window else UNBOUNDED,
        softcap=50.0 if softcap else None,
        alibi_slopes=torch.empty(1, SAMPLE_HEADS) if alibi else None,
        seqlens_k=torch.empty(SAMPLE_BATCH, dtype=torch.int32) if seqlens else None,
        dropout=SAMPLE_DROPOUT if dropout else NO_DROPOUT,
        attn_mask=None if mask is None else _sample_mask(mask),
    )


def sample_varlen(*, dropout: bool = False) -> KernelVariants:
    """Packed sequences for a sample call: two of 4000 and 4192 tokens in :data:`SAMPLE_SEQ` rows, for
    queries and keys alike; with ``dropout``, :data:`SAMPLE_DROPOUT`."""
    cu = torch.tensor([0, 4000, SAMPLE_SEQ], dtype=torch.int32)
    longest = SAMPLE_SEQ - 4000
    return KernelVariants(
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=longest,
        max_seqlen_k=longest,
        dropout=SAMPLE_DROPOUT if dropout else NO_DROPOUT,
    )


def _sample_mask(dtype: torch.dtype) -> torch.Tensor:
    """``(B, 1, 1, N)`` expanded to the kernels' ``(B, H, N, N)`` (strides 0), as the launcher passes it."""
    mask = torch.empty(SAMPLE_BATCH, 1, 1, SAMPLE_SEQ, dtype=dtype)
    mask = mask.expand(SAMPLE_BATCH, SAMPLE_HEADS, SAMPLE_SEQ, SAMPLE_SEQ)
    return mask.view(torch.uint8) if dtype == torch.bool else mask


def kernel_request(
    name: str, config: AttentionConfig, dtype: torch.dtype, head_dim: int, arch: str, **kwargs: Any
) -> CompileRequest:
    """The compile request of one kernel ``name`` for a sample call; ``kwargs`` as :func:`attention_requests`."""
    return attention_requests(config, dtype, head_dim, arch, backward=name != "forward", **kwargs)[name]


def with_kernel_config(config: AttentionConfig, name: str, kernel_config) -> AttentionConfig:
    """``config`` with kernel ``name``'s launch parameters replaced."""
    return dataclasses.replace(config, **{name: kernel_config})
