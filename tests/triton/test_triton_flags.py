"""The kernels' variant flags as one record (``flashattn_teach.triton.flags``): a ``tl.constexpr`` NamedTuple
branches statically, reaches the helpers it is passed to and may hold a ``@triton.jit`` function; no kernel
spells a flag of the record as a parameter of its own; ``kernel_flags`` reads each flag off the call's
variants; the capture tools name each field by its bare name."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, NamedTuple

import pytest
import torch

from flashattn_teach.dropout import DropoutKey
from flashattn_teach.masks.grid import LONGEST, PER_HEAD
from flashattn_teach.triton.configs import TEST_CONFIG
from flashattn_teach.triton.flags import Flags, kernel_flags
from flashattn_teach.triton.variants import PLAIN, KernelVariants

triton = pytest.importorskip("triton")
tl = triton.language


class _Probe(NamedTuple):
    NEGATE: bool
    MOD: Any  # a @triton.jit function or None
    ADD: int


@triton.jit
def _plus_one(x):
    return x + 1.0


@triton.jit
def _probe_inner(x, P: tl.constexpr):
    if P.MOD is not None:
        x = P.MOD(x)
    if P.ADD > 0:
        x = x + P.ADD
    return x


@triton.jit
def _probe(X, Y, P: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    if P.NEGATE:
        x = -x
    tl.store(Y + offs, _probe_inner(x, P))


@pytest.mark.parametrize(
    ("negate", "mod", "add"), [(False, None, 0), (True, None, 0), (True, _plus_one, 0), (False, _plus_one, 3)]
)
def test_a_constexpr_record_branches_reaches_helpers_and_holds_a_jit_function(negate, mod, add) -> None:
    x = torch.arange(16, dtype=torch.float32)
    y = torch.empty_like(x)
    _probe[(1,)](x, y, _Probe(negate, mod, add), N=16)
    expected = (-x if negate else x) + (1.0 if mod is not None else 0.0) + add
    assert torch.equal(y, expected)


def _flag_kernels():
    from flashattn_teach.triton.kernels.backward_dkdv import attn_bwd_dkdv
    from flashattn_teach.triton.kernels.backward_dkdv_inner import _attn_bwd_dkdv_inner
    from flashattn_teach.triton.kernels.backward_dq import attn_bwd_dq
    from flashattn_teach.triton.kernels.backward_dq_inner import _attn_bwd_dq_inner
    from flashattn_teach.triton.kernels.forward import attn_fwd
    from flashattn_teach.triton.kernels.forward_inner import _attn_fwd_inner

    return [attn_fwd, _attn_fwd_inner, attn_bwd_dkdv, _attn_bwd_dkdv_inner, attn_bwd_dq, _attn_bwd_dq_inner]


@pytest.mark.parametrize("kernel", _flag_kernels(), ids=lambda k: k.__name__)
def test_each_kernel_takes_the_flags_as_one_record(kernel) -> None:
    params = inspect.signature(kernel.fn).parameters
    assert "F" in params and "constexpr" in str(params["F"].annotation)
    assert sorted(set(Flags._fields) & set(params)) == []


def _flags(variants: KernelVariants = PLAIN, *, causal: bool = False, config=TEST_CONFIG) -> Flags:
    return kernel_flags(variants, causal=causal, config=config, block_d2=0, precision="ieee", trace=False)


def test_kernel_flags_read_each_variant_off_the_call() -> None:
    set_by = {
        "SOFTCAP": KernelVariants(softcap=30.0),
        "ALIBI": KernelVariants(alibi_slopes=torch.ones(1, 2)),
        "SEQLENS": KernelVariants(seqlens_k=torch.ones(2, dtype=torch.int32)),
        "DROPOUT": KernelVariants(dropout=DropoutKey(p=0.5, seed=1)),
        "BOOL_MASK": KernelVariants(attn_mask=torch.ones(1, 1, 2, 2, dtype=torch.uint8)),
        "ADD_MASK": KernelVariants(attn_mask=torch.zeros(1, 1, 2, 2)),
        "VARLEN": KernelVariants(cu_seqlens_q=torch.zeros(2, dtype=torch.int32)),
    }
    off = _flags()
    assert not any(getattr(off, name) for name in (*set_by, "CAUSAL", "WINDOW", "KINDS", "LISTED", "TMA", "TRACE"))
    for name, variants in set_by.items():
        on = _flags(variants)
        assert [f for f in Flags._fields if getattr(on, f) != getattr(off, f)] == [name]


def test_a_window_carries_causal_and_the_grid_order_follows_the_config() -> None:
    assert _flags(causal=True).CAUSAL is True
    windowed = _flags(KernelVariants(window=True, left=4, right=0), causal=True)
    assert (windowed.WINDOW, windowed.CAUSAL) == (True, False)
    orders = {_flags(config=dataclasses.replace(TEST_CONFIG, longest_first=f)).GRID_ORDER for f in (True, False)}
    assert orders == {LONGEST, PER_HEAD}


def test_the_record_repr_names_a_jit_field_by_its_source_hash() -> None:
    """Triton's on-disk cache keys a constexpr record by its ``str``: a function's source hash, not its name."""

    class Compiled:  # what a JITFunction has (the interpreter's stand-in has no cache_key)
        cache_key = "5f3a9c"

        def __repr__(self) -> str:
            return "JITFunction(module:score_mod)"

    flags = _flags()._replace(SCORE_MOD=Compiled())
    assert "SCORE_MOD='5f3a9c'" in repr(flags) and "score_mod" not in repr(flags)
    assert "MASK_MOD=None" in repr(flags) and "CAUSAL=False" in repr(flags)


def test_constants_name_each_flag_by_its_bare_name() -> None:
    from flashattn_teach.tools.kernels.specialize import CompileRequest

    flags = _flags(causal=True)
    request = CompileRequest(
        fn=None,
        signature={"X": "*fp32", "F": "constexpr", "BLOCK_M": "constexpr"},
        constexprs={(1,): flags, (2,): 64},
        attrs={},
        options=None,
        target=None,
    )
    assert request.constants() == {**flags._asdict(), "BLOCK_M": 64}
