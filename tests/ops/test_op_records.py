"""The custom ops keep the schemas of flashattn_teach 0.1.0, argument for argument: exported programs name the
ops and pass their arguments in this order; an argument added since comes last, with a default
(``deterministic``, ``sinks``), so that calls written for 0.1.0 still run. Each schema is built from its argument record
(``ops/schema.py``), so a field added, renamed or moved in a record shows here, and the records round-trip
through the ops."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach._options import make_options
from flashattn_teach.ops.attention import AttentionArgs
from flashattn_teach.ops.schema import op_args
from flashattn_teach.ops.varlen import VarlenArgs
from flashattn_teach.serving.ops import DecodeArgs

# As torch prints them for flashattn_teach 0.1.0 (before the records), one op per line.
SCHEMAS = {
    "attention": (
        "flashattn_teach::attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? alibi_slopes, "
        "Tensor? seqlens_k, bool causal, str causal_align, float? scale, SymInt[]? window, float? softcap, "
        "bool enable_gqa, str backend, float dropout_p=0., Tensor? dropout_seed=None, bool deterministic=False, "
        "Tensor? sinks=None) -> (Tensor, Tensor)"
    ),
    "attention_backward": (
        "flashattn_teach::attention_backward(Tensor dO, Tensor dlse, Tensor q, Tensor k, Tensor v, Tensor? "
        "attn_mask, Tensor? alibi_slopes, Tensor? seqlens_k, bool causal, str causal_align, float? scale, "
        "SymInt[]? window, float? softcap, bool enable_gqa, str backend, float dropout_p=0., Tensor? "
        "dropout_seed=None, bool deterministic=False, Tensor? sinks=None) -> (Tensor, Tensor, Tensor)"
    ),
    "attention_varlen": (
        "flashattn_teach::attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor "
        "cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? alibi_slopes, bool causal, str "
        "causal_align, float? scale, SymInt[]? window, float? softcap, str backend, float dropout_p=0., "
        "Tensor? dropout_seed=None, bool deterministic=False) -> (Tensor, Tensor)"
    ),
    "attention_varlen_backward": (
        "flashattn_teach::attention_varlen_backward(Tensor dO, Tensor dlse, Tensor q, Tensor k, Tensor v, "
        "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? "
        "alibi_slopes, bool causal, str causal_align, float? scale, SymInt[]? window, float? softcap, str "
        "backend, float dropout_p=0., Tensor? dropout_seed=None, bool deterministic=False) -> (Tensor, Tensor, "
        "Tensor)"
    ),
    "attention_with_kvcache": (
        "flashattn_teach::attention_with_kvcache(Tensor q, Tensor(a1!) k_cache, Tensor(a2!) v_cache, Tensor? "
        "k, Tensor? v, Tensor cache_seqlens, Tensor? alibi_slopes, bool causal, float? scale, SymInt[]? "
        "window, float? softcap, SymInt num_splits, str backend, ScalarType? autocast, Tensor? block_table=None, "
        "Tensor? cache_leftpad=None, Tensor? sinks=None) -> (Tensor, Tensor)"
    ),
}

RECORDS = {"attention": AttentionArgs, "attention_varlen": VarlenArgs, "attention_with_kvcache": DecodeArgs}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_each_op_keeps_its_schema(name):
    assert str(getattr(torch.ops.flashattn_teach, name).default._schema) == SCHEMAS[name]


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_the_record_names_the_ops_arguments_after_its_tensors_in_order(name):
    arguments = [a.name for a in getattr(torch.ops.flashattn_teach, name).default._schema.arguments]
    fields = [f.name for f in dataclasses.fields(RECORDS[name])]
    assert arguments[-len(fields) :] == fields
    assert (
        arguments[: -len(fields)] == ["q", "k_cache", "v_cache"]
        if name == "attention_with_kvcache"
        else ["q", "k", "v"]
    )


def test_a_call_written_for_0_1_0_still_runs_and_the_record_carries_deterministic():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    opts = make_options(q, k, v, causal=True, deterministic=True)
    args = AttentionArgs.of_call(opts, "query_major", scale_given=False, alibi_slopes=None, seqlens_k=None)
    assert args.deterministic and args.options(q, k, v).deterministic
    old = op_args(args)[:-1]  # the 0.1.0 arguments: no deterministic
    O, _ = torch.ops.flashattn_teach.attention(q, k, v, *old)
    torch.testing.assert_close(O, fa.dense_attention(q, k, v, causal=True), atol=1e-12, rtol=0)


def test_a_record_built_from_a_calls_options_runs_that_call():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    lengths = torch.tensor([9, 5])
    kwargs = dict(causal=True, causal_align="bottom_right", window=(3, 0), softcap=2.0, seqlens_k=lengths)
    opts = make_options(q, k, v, **kwargs)
    args = AttentionArgs.of_call(opts, "query_major", scale_given=False, alibi_slopes=None, seqlens_k=lengths)
    O, lse = torch.ops.flashattn_teach.attention(q, k, v, *op_args(args))
    want, want_lse = fa.dense_attention(q, k, v, return_lse=True, **kwargs)
    torch.testing.assert_close(O, want, atol=1e-12, rtol=0)
    finite = want_lse.isfinite()
    torch.testing.assert_close(lse[finite], want_lse[finite], atol=1e-12, rtol=0)
    assert (lse[~finite] == float("-inf")).all()


def test_the_decode_record_carries_every_keyword_of_a_call_there_and_back():
    """The op's record is built from the call's keywords by name and gives them back: every keyword of
    ``DecodeKeywords`` is a field, each arrives with its own value (tensors the same objects)."""
    from flashattn_teach._options import DecodeKeywords
    from flashattn_teach._validate.keywords import keyword_table
    from flashattn_teach.serving.step import DecodeCall

    tensors = {
        "alibi_slopes": torch.ones(2),
        "sinks": torch.zeros(2),
        "block_table": torch.zeros(2, 1, dtype=torch.int32),
        "cache_leftpad": torch.zeros(2, dtype=torch.int32),
    }
    scalars = {"causal": True, "scale": 0.5, "softcap": 2.0, "num_splits": 3, "backend": "query_major"}
    options = {**tensors, **scalars, "window": (3, 0), "cache_seqlens": 7}
    assert set(options) == set(keyword_table(DecodeKeywords))  # every keyword, each with a value of its own
    lengths = torch.tensor([7, 7])
    args = DecodeArgs.of_call(DecodeCall(None, None, options, False, torch.bfloat16), lengths)
    assert args.cache_seqlens is lengths and args.window == [3, 0] and args.autocast is torch.bfloat16
    back = args.call()
    assert back.return_lse and back.autocast is torch.bfloat16 and back.options["window"] == (3, 0)
    assert all(back.options[name] is t for name, t in tensors.items())
    assert all(back.options[name] == value for name, value in scalars.items())


def test_the_varlen_record_gives_back_every_packed_keyword_it_holds_by_name():
    """The varlen op's body rebuilds the call from the record's keywords: each keyword of
    ``PackedKeywords`` the schema has comes back with its own value (``sinks``, which it has not, is declined
    by ``of_call``)."""
    from flashattn_teach._options import PackedKeywords
    from flashattn_teach._validate.keywords import keyword_table
    from flashattn_teach.ops.varlen import KEYWORDS

    slopes, cu = torch.ones(2), torch.tensor([0, 3])
    args = VarlenArgs(
        cu, cu, 3, 3, alibi_slopes=slopes, causal=True, causal_align="top_left", scale=0.5, window=[2, 0],
        softcap=4.0, backend="query_major", dropout_p=0.25, deterministic=True,
    )  # fmt: skip
    assert set(keyword_table(PackedKeywords)) - set(KEYWORDS) == {"sinks"}
    want = {"causal": True, "causal_align": "top_left", "scale": 0.5, "window": (2, 0), "softcap": 4.0}
    want |= {"dropout_p": 0.25, "deterministic": True}
    given = args.keywords()
    assert given.keys() == set(KEYWORDS) and given["alibi_slopes"] is slopes
    assert all(given[name] == value for name, value in want.items())  # type: ignore[literal-required]
