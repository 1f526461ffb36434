"""The decode replay with attention sinks: the sink joins once per row after the splits' merges, and the
result is the decode call's (``flash_attention_with_kvcache(..., sinks=)``), with a negative control."""

from __future__ import annotations

import io
import json

import pytest
import torch

from flashattn_teach import flash_attention_with_kvcache
from flashattn_teach.errors import AttentionValueError
from flashattn_teach.replay import decode_to_experiment, replay_decode
from flashattn_teach.replay.manifest import schema
from flashattn_teach.replay.table import render_table

from replay_cli import main

SINKS = torch.tensor([0.3, -1.0, 1.5, 0.0], dtype=torch.float64)  # one per query head


def step_inputs(seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    B, H_q, H_kv, N_max, D = 2, 4, 2, 12, 4  # GQA: query heads 2 and 3 read key/value head 1
    q = torch.randn(B, H_q, 2, D, generator=g, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(B, H_kv, N_max, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, H_kv, 2, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k_cache, v_cache, k, v


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_replay_with_sinks_is_the_decode_call_and_the_sink_merge_weight_is_its_share(num_splits):
    q, k_cache, v_cache, k, v = step_inputs()
    lengths = torch.tensor([5, 7])
    kwargs = {"cache_seqlens": lengths, "causal": True, "window": (6, 0)}
    r = replay_decode(
        q, k_cache, v_cache, k, v, block_n=2, num_splits=num_splits, batch_index=1, head=2, sinks=SINKS, **kwargs
    )
    O, lse = flash_attention_with_kvcache(
        q, k_cache.clone(), v_cache.clone(), k, v, sinks=SINKS, return_lse=True, **kwargs
    )
    torch.testing.assert_close(r.O, O[1, 2], rtol=0, atol=1e-13)
    torch.testing.assert_close(r.lse, lse[1, 2], rtol=0, atol=1e-13)
    assert r.max_diff <= 1e-13  # the replay's dense oracle, the sink as one more column
    last = r.merges[-1]
    assert last.split is None and last.label.endswith("+ sink") and len(r.merges) == len(r.splits)
    torch.testing.assert_close(last["lse_b"], torch.full((2,), 1.5, dtype=torch.float64))
    torch.testing.assert_close(last["w_b"], torch.exp(1.5 - lse[1, 2]), rtol=1e-12, atol=0)  # the sink's share
    assert all(m.split is not None for m in r.merges[:-1])  # the sink is merged exactly once

    # Negative control: without sinks, no sink merge, and the output is another one.
    plain = replay_decode(q, k_cache, v_cache, k, v, block_n=2, num_splits=num_splits, batch_index=1, head=2, **kwargs)
    assert all(m.split is not None for m in plain.merges) and plain.sink is None
    assert (plain.O - r.O).abs().max() > 1e-2
    assert "sink" not in decode_to_experiment(plain)["decode"]


def test_a_step_that_sees_no_key_ends_at_the_sink():
    q, k_cache, v_cache, _, _ = step_inputs()
    r = replay_decode(q, k_cache, v_cache, cache_seqlens=0, block_n=2, num_splits=2, head=3, sinks=SINKS)
    assert r.splits == () and len(r.merges) == 1 and r.merges[0].merged == ()
    assert r.O.abs().max() == 0
    torch.testing.assert_close(r.lse, torch.zeros(2, dtype=torch.float64))  # sink_3 = 0
    torch.testing.assert_close(r.merges[0]["w_b"], torch.ones(2, dtype=torch.float64))


def test_decode_sinks_are_checked_and_shown_in_the_table_json_and_cli(capsys):
    q, k_cache, v_cache, k, v = step_inputs()
    with pytest.raises(AttentionValueError, match=r"sinks must have shape \(4,\)"):
        replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=3, block_n=2, sinks=torch.zeros(2))
    r = replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=3, block_n=2, num_splits=2, head=2, sinks=SINKS)
    out = io.StringIO()
    render_table(r, file=out, width=200)
    assert "(0 1) + sink" in out.getvalue() and "sink 1.5" in out.getvalue()
    experiment = decode_to_experiment(r)
    assert experiment["decode"]["sink"] == 1.5 and experiment["decode"]["merges"][-1]["split"] is None
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(schema()).validate(experiment)

    assert main(["decode", "--sinks", "0.5", "--format", "json"]) == 0
    decode = json.loads(capsys.readouterr().out)["decode"]
    assert decode["sink"] == 0.5 and decode["merges"][-1]["split"] is None
    assert decode["maxDiff"] < 1e-13
