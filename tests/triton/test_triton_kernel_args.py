"""The kernels' arguments as named records (``flashattn_teach.triton.kernels.records``): no kernel takes more than 20
runtime arguments, an unused variant is None in its record (no placeholder pointer), and the records carry
what the old positional lists carried."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import Tensor

from flashattn_teach.dropout import DropoutKey
from flashattn_teach.triton.kernels.records import Bounds, DkdvTensors, ScoreTerms, Strided, split, strided
from flashattn_teach.triton.variants import PLAIN, UNBOUNDED, KernelVariants

pytest.importorskip("triton")
KERNELS_DIR = Path(__file__).resolve().parents[2] / "src" / "flashattn_teach" / "triton" / "kernels"
MAX_RUNTIME_ARGS = 20  # issue 38: constexprs do not count


def _launched_kernels():
    from flashattn_teach.triton.kernels.backward import attn_bwd_preprocess
    from flashattn_teach.triton.kernels.backward_dkdv import attn_bwd_dkdv
    from flashattn_teach.triton.kernels.backward_dq import attn_bwd_dq
    from flashattn_teach.triton.kernels.decode import decode_combine, decode_split_fwd
    from flashattn_teach.triton.kernels.forward import attn_fwd

    return [attn_fwd, attn_bwd_preprocess, attn_bwd_dkdv, attn_bwd_dq, decode_split_fwd, decode_combine]


def _params(kernel) -> list[inspect.Parameter]:
    """The Python function's parameters (``kernel.fn``: a JITFunction's, or the interpreter's stand-in's)."""
    return list(inspect.signature(kernel.fn).parameters.values())


def _runtime(kernel) -> list[str]:
    """The parameters that are not ``tl.constexpr`` (annotations are strings under postponed evaluation)."""
    return [p.name for p in _params(kernel) if "constexpr" not in str(p.annotation)]


def test_no_kernel_takes_more_than_20_runtime_arguments() -> None:
    counts = {k.fn.__name__: len(_runtime(k)) for k in _launched_kernels()}
    assert all(n <= MAX_RUNTIME_ARGS for n in counts.values()), counts
    assert counts["attn_fwd"] == max(counts.values()) == 16, counts  # the widest, with room for four more


def test_the_attention_kernels_take_every_pointer_ahead_of_every_stride() -> None:
    """``ptr`` and ``stride`` come first (records.split): the parameter buffer then holds every tensor's pointer
    ahead of every stride, as the positional kernels did, and ptxas schedules as it did for them."""
    for k in _launched_kernels():
        if k.fn.__name__ in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq", "decode_split_fwd"):
            assert _runtime(k)[:2] == ["ptr", "stride"], k.fn.__name__


def test_split_puts_the_pointers_in_one_record_and_the_strides_in_another() -> None:
    q, k, do = torch.empty(2, 3, 10, 8), torch.empty(2, 1, 12, 8).transpose(1, 2), torch.empty(2, 3, 10, 4)
    tensors = DkdvTensors(strided(q), strided(k), strided(k), strided(do), strided(k), strided(k), None)
    ptr, stride = split(tensors)
    assert type(ptr) is type(stride) is DkdvTensors
    assert ptr == DkdvTensors(q, k, k, do, k, k, None)
    assert stride.Q == q.stride() and stride.K == k.stride() and stride.DO == do.stride()
    assert stride.DQ == (None,) * 4  # no dQ buffer: its pointer and strides are constants None
    # the kernel makes each record again from the two
    for t, p, s in zip(tensors[:6], ptr[:6], stride[:6], strict=True):
        assert Strided(p, *s) == t


def test_no_format_skips_left_in_the_kernels() -> None:
    skipped = [f.name for f in KERNELS_DIR.glob("*.py") if "fmt: skip" in f.read_text()]
    assert skipped == []


def test_kernels_read_no_stride_argument_by_its_old_flat_name() -> None:
    """``stride_qd`` and the like are gone from the kernels' signatures: strides come with their tensor."""
    for k in _launched_kernels():
        flat = [n for n in _runtime(k) if re.fullmatch(r"stride_(q|k|v|o|do|dq|dk|dv)[bhnd]", n)]
        assert flat == [], (k.fn.__name__, flat)


def test_strided_zeroes_the_batch_stride_of_packed_sequences() -> None:
    t = torch.empty(1, 3, 10, 8).transpose(1, 2)  # (1, 10, 3, 8) viewed from (1, 3, 10, 8)
    b, h, n, d = t.stride()
    assert strided(t) == Strided(t, stride_h=h, stride_n=n, stride_b=b, stride_d=d)
    assert strided(t, varlen=True) == Strided(t, stride_h=h, stride_n=n, stride_b=0, stride_d=d)
    # a descriptor's record takes the strides of the tensor it reads
    assert strided("desc", (4, 3, 2, 1)) == Strided("desc", stride_h=3, stride_n=2, stride_b=4, stride_d=1)


def test_a_plain_call_passes_none_for_every_variant_tensor() -> None:
    """No placeholder pointer: what a call does not use is None, which the JIT makes a constexpr None."""
    assert PLAIN.bounds(0) == Bounds(OFFSET=0, LEFT=UNBOUNDED, RIGHT=UNBOUNDED, SEQLENS_K=None)
    assert PLAIN.score_terms() == ScoreTerms(1.0, *(None,) * 8)
    assert PLAIN.packed() is None
    mods = PLAIN.mods_record(torch.device("cpu"), 64, 64, 100, 100, listed=True)
    assert mods.score_captures == (None,) * 4 and mods.mask_captures == (None,) * 4
    assert tuple(mods[2:]) == (None,) * 9  # the tile kinds, the tile list and their strides


def test_variant_records_carry_the_variants_by_name() -> None:
    slopes = torch.rand(1, 4)  # one row for every batch element: batch stride 0
    mask = torch.zeros(2, 4, 5, 7).expand(2, 4, 5, 7)
    key = DropoutKey(p=0.25, seed=2**40 + 3, offset=96)
    v = KernelVariants(
        window=True,
        left=3,
        right=0,
        softcap=30.0,
        alibi_slopes=slopes,
        seqlens_k=torch.tensor([5, 7]),
        dropout=key,
        attn_mask=mask,
    )
    b = v.bounds(1)
    assert (b.OFFSET, b.LEFT, b.RIGHT) == (1, 3, 0) and b.SEQLENS_K is v.seqlens_k
    terms = v.score_terms()
    assert terms.softcap_log2 == pytest.approx(30.0 / torch.log(torch.tensor(2.0)).item())
    assert terms.alibi is slopes and (terms.alibi_stride_b, terms.alibi_stride_h) == (0, slopes.stride(1))
    assert terms.mask is mask
    assert (terms.mask_stride_b, terms.mask_stride_h, terms.mask_stride_m, terms.mask_stride_n) == mask.stride()
    d = v.dropout_args()
    assert (d.seed, d.offset, d.threshold) == (key.seed, key.offset, key.threshold)
    assert d.keep_scale == pytest.approx(1 / (1 - 0.25))


def _records() -> list[type]:
    from flashattn_teach.triton.kernels import records

    return [v for v in vars(records).values() if isinstance(v, type) and issubclass(v, tuple) and v is not tuple]


def test_no_record_holds_a_record() -> None:
    """A record's fields are scalars, tensors (or descriptors) and tuples of tensors, never another record:
    triton specialises an integer equal to 1 inside a record to a constant (``do_not_specialize`` does not
    reach into records), and triton 3.6 loses such a constant of a record inside a record (records.py). The
    one exception is a kernel's ``stride`` record (``split``: a ``Strides`` in each field, typed ``Any``), which
    has no None field of its own; test_triton_loops.py checks its unit strides arrive as the constant 1."""
    import typing

    from flashattn_teach.triton.kernels import records

    nested = {}
    for cls in _records():
        hints = typing.get_type_hints(cls, vars(records))
        for name, hint in hints.items():
            args = typing.get_args(hint) or (hint,)
            inner = [a for a in args if isinstance(a, type) and issubclass(a, tuple) and a is not tuple]
            tuples = [a for a in args if typing.get_origin(a) is tuple]
            if inner or any(typing.get_args(t) != (Tensor | None, ...) for t in tuples):
                nested[f"{cls.__name__}.{name}"] = hint
    assert nested == {}


def test_no_integer_of_a_masked_calls_records_is_specialised_below_the_first_level() -> None:
    """What the JIT makes of the records of an attn_mask call whose key stride is 1 and of a block mask's
    tile kinds: every constant it finds below a record's own fields is None (a capture's slot), none a 1."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    from flashattn_teach.triton.kernels.records import UserMods, score_terms

    mask = torch.zeros(2, 4, 5, 7, dtype=torch.uint8)
    kinds = torch.zeros(1, 1, 3, 3, dtype=torch.int8)
    for record in (
        score_terms(30.0, torch.rand(1, 4), mask),
        score_terms(None, None, mask),
        UserMods((kinds,) + (None,) * 3, (None,) * 4, kinds, 0, 0, 3, 1, kinds, 0, 0, 3),
    ):
        kinds_of, values = native_specialize_impl(BaseBackend, record, False, True, True)
        constants = dict(_constants(kinds_of, values, ()))
        assert 1 in [v for path, v in constants.items() if len(path) == 1], constants  # a 1 at the first level
        assert {path: v for path, v in constants.items() if len(path) > 1 and v is not None} == {}


def _constants(kinds, values, path):
    """``(path, value)`` of each field the JIT made a constant (kind ``constexpr``)."""
    if isinstance(kinds, tuple):
        for i, (k, v) in enumerate(zip(kinds, values, strict=True)):
            yield from _constants(k, v, (*path, i))
    elif kinds == "constexpr":
        yield path, values
