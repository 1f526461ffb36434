"""Every rewrite of a call carries each field of the records it rebuilds, or declines it (issue 35).

A rewrite runs a call as another call: the query heads of one query folded into rows (``rows.py``), a decode
step's key ranges and rows (``decode/ranges.py``), a ring's blocks (``distributed/ring.py``), the compiled
ops' records (``ops/attention.py``, ``ops/varlen.py``), a replay's packed sequences (``trace/inputs.py``).
Each exposes an allow-list per record (``dispatch/carry.py``). Three checks:

1. every field of every record is on each of its rewrite's lists, and every name on a list is a field: a
   field added later fails here until someone writes down how (or whether) each rewrite carries it;
2. a record with a field no list names (a fake one, the negative control) is declined or refused by name at
   run time, by the rewrite itself, so it is never dropped;
3. what fold rebuilds is the call's record, every field it does not rewrite the same object.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashattn_teach import _options
from flashattn_teach._validate.inputs import AttentionShapes
from flashattn_teach.dispatch import carry, rows
from flashattn_teach.distributed import comm, ring
from flashattn_teach.masks.spec import MaskSpec
from flashattn_teach.ops import attention as ops_attention
from flashattn_teach.ops import varlen as ops_varlen
from flashattn_teach.replay import inputs as trace_inputs
from flashattn_teach.serving import ranges

Options = _options.AttentionOptions

# (rewrite, its allow-list, the record it rebuilds)
LISTS = {
    "fold: options": (rows.FOLD_OPTIONS, Options),
    "fold: shapes": (rows.FOLD_SHAPES, AttentionShapes),
    "fold: mask": (rows.FOLD_MASK, MaskSpec),
    "decode: key ranges": (ranges.RANGE_CARRIES, ranges.DecodeStep),
    "decode: rows": (ranges.ROWS_CARRIES, ranges.DecodeStep),
    "ring: blocks": (ring.RING_CARRIES, comm.CallOptions),
    "attention op: options": (ops_attention.OP_OPTIONS, Options),
    "attention op: mask": (ops_attention.OP_MASK, MaskSpec),
    "varlen op: options": (ops_varlen.OP_OPTIONS, Options),
    "varlen op: mask": (ops_varlen.OP_MASK, MaskSpec),
    "replay: packed mask": (trace_inputs.PACKED_MASK, MaskSpec),
}


def undecided(carries: carry.Carries, record: type) -> tuple[list[str], list[str]]:
    """``(fields the list does not name, names on the list that are no field)``."""
    names = [f.name for f in dataclasses.fields(record)]
    return [n for n in names if n not in carries], [n for n in carries if n not in names]


def _with_new_field(record: type) -> type:
    """``record`` with one more field, as a later version of the library might add."""
    return dataclasses.make_dataclass(
        f"Extended{record.__name__}", [("new_option", int, dataclasses.field(default=0))], bases=(record,), frozen=True
    )


def _extended(value, new_option: int = 1):
    """A copy of the dataclass ``value`` whose type has one more field, set to ``new_option``."""
    cls = _with_new_field(type(value))
    return cls(**{f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, new_option=new_option)


@pytest.mark.parametrize("rewrite", sorted(LISTS))
def test_each_rewrite_decides_every_field_of_its_record(rewrite):
    carries, record = LISTS[rewrite]
    assert undecided(carries, record) == ([], [])


@pytest.mark.parametrize("rewrite", sorted(LISTS))
def test_the_check_sees_a_field_added_later(rewrite):
    """Negative control of the test above: the same check on the record with one more field fails."""
    carries, record = LISTS[rewrite]
    assert undecided(carries, _with_new_field(record)) == (["new_option"], [])


def _decode_call(dtype=torch.float64, **kw):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1, 16, generator=g, dtype=dtype)
    k, v = (torch.randn(2, 2, 40, 16, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, _options.make_options(q, k, v, enable_gqa=True, **kw)


def test_fold_declines_an_option_it_does_not_know():
    q, k, v, opts = _decode_call()
    assert rows.fold(q, k, v, opts) is not None  # the call folds ...
    extended = _extended(opts)
    assert rows.declined(extended) == ["options.new_option"]  # ... but not with a field no list names
    assert rows.fold(q, k, v, extended) is None
    with_mask = dataclasses.replace(opts, mask=_extended(opts.mask))
    assert rows.declined(with_mask) == ["mask.new_option"] and rows.fold(q, k, v, with_mask) is None
    with_shapes = dataclasses.replace(opts, shapes=_extended(opts.shapes))
    assert rows.declined(with_shapes) == ["shapes.new_option"] and rows.fold(q, k, v, with_shapes) is None


def test_fold_carries_every_field_it_does_not_rewrite():
    """What fold rebuilds is the call's record: the fields it does not rewrite (the rows' shapes, their
    position, the mask read as rows) are the same objects as the call's."""
    q, k, v, opts = _decode_call(
        softcap=3.0, seqlens_k=torch.tensor([40, 17]), deterministic=True, attn_mask=torch.ones(2, 8, 1, 40).bool()
    )
    _, folded = rows.fold(q, k, v, opts)
    for f in dataclasses.fields(opts):
        if f.name not in ("shapes", "mask", "enable_gqa"):
            assert getattr(folded, f.name) is getattr(opts, f.name), f.name
    rewritten = {"shapes", "offset", "causal", "left", "right", "per_element", "attn_mask", "_tilings"}
    for f in dataclasses.fields(opts.mask):
        if f.name not in rewritten:
            assert getattr(folded.mask, f.name) is getattr(opts.mask, f.name), f.name
    s, t = opts.shapes, folded.shapes
    assert (t.H_q, t.N_q) == (2, 4) and dataclasses.replace(t, H_q=s.H_q, N_q=s.N_q) == s


def test_decode_refuses_a_step_field_it_does_not_carry():
    step = ranges.DecodeStep(
        causal=True, scale=0.25, window=(-1, -1), softcap=None, num_splits=1, backend="query_major", cache_seqlens=4
    )
    assert carry.uncarried(step, ranges.RANGE_CARRIES) == []
    sloped = dataclasses.replace(step, alibi_slopes=torch.ones(8))  # a slope per head: the rows decline it
    assert carry.uncarried(sloped, ranges.RANGE_CARRIES) == []
    assert carry.uncarried(sloped, ranges.ROWS_CARRIES) == ["alibi_slopes"]
    extended = _extended(step)
    assert carry.uncarried(extended, ranges.ROWS_CARRIES) == ["new_option"]  # decode_one's rows decline it
    q = torch.randn(1, 8, 1, 16)
    cache = torch.randn(1, 2, 10, 16)
    with pytest.raises(NotImplementedError, match=r"DecodeStep\.new_option is not carried"):
        ranges.range_plan(q, cache, cache, extended)


def test_the_ring_names_a_call_option_it_does_not_carry():
    options = comm.CallOptions(True, False, "zigzag", "auto", None, None, None)
    assert carry.uncarried(options, ring.RING_CARRIES) == []
    assert carry.uncarried(_extended(options), ring.RING_CARRIES) == ["new_option"]


def test_the_attention_op_refuses_what_it_does_not_carry_by_name():
    q, k, v, opts = _decode_call(causal=True)
    args = ops_attention.AttentionArgs.of_call(
        opts, "query_major", scale_given=False, alibi_slopes=None, seqlens_k=None
    )
    assert args.options(q, k, v).causal
    for odd in (_extended(opts), dataclasses.replace(opts, mask=_extended(opts.mask))):
        with pytest.raises(ValueError, match="does not carry new_option"):
            ops_attention.AttentionArgs.of_call(
                odd, "query_major", scale_given=False, alibi_slopes=None, seqlens_k=None
            )
    lengths = torch.tensor([40, 17])
    with_lengths = _options.make_options(q, k, v, enable_gqa=True, seqlens_k=lengths)
    with pytest.raises(ValueError, match="does not carry seqlens_k"):  # the lengths not passed to the op
        ops_attention.AttentionArgs.of_call(
            with_lengths, "query_major", scale_given=False, alibi_slopes=None, seqlens_k=None
        )


def test_the_varlen_op_declines_what_it_does_not_carry():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 7, 8, generator=g) for _ in range(3))  # (H, total, D) views
    bounds = (torch.tensor([0, 3, 7]), torch.tensor([0, 3, 7]), 4, 4)
    opts = _options.make_options(q, k, v, causal=True, enable_gqa=True)
    assert ops_varlen.of_call(bounds, None, opts, "query_major", scale_given=False) is not None
    assert ops_varlen.of_call(bounds, None, _extended(opts), "query_major", scale_given=False) is None
    sinks = _options.make_options(q, k, v, enable_gqa=True, sinks=torch.zeros(4))
    assert ops_varlen.of_call(bounds, None, sinks, "query_major", scale_given=False) is None
