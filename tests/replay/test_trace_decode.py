"""The replay of one decode step: split-KV ranges replayed tile by tile, merged to the dense float64 oracle."""

from __future__ import annotations

import argparse
import itertools
import json
import math

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach.errors import AttentionValueError
from flashattn_teach.replay import KeyRole, decode_to_experiment, replay_decode
from flashattn_teach.replay.cli import add_arguments, run
from flashattn_teach.replay.manifest import schema
from flashattn_teach.replay.step import numbers

NEG_INF = float("-inf")


def make(cache_len, new_kv, N_new, *, B=1, H_q=1, H_kv=1, D=4, unused=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    N_max = max(cache_len) + new_kv + unused if isinstance(cache_len, list) else cache_len + new_kv + unused
    q = torch.randn(B, H_q, N_new, D, generator=g, dtype=dtype)
    k_cache, v_cache = (torch.randn(B, H_kv, N_max, D, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, H_kv, new_kv, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k_cache, v_cache, k, v


def oracle(q, keys, values, *, causal=True, window=None, softcap=None, slope=None):
    """Dense float64 attention of ``q (N_new, D)`` over ``keys, values (L, D)``, written out from the
    definition: row i sits at position L - N_new + i (bottom-right), as flash-attn's kvcache call."""
    q, keys, values = q.double(), keys.double(), values.double()
    N_new, L = q.shape[0], keys.shape[0]
    pos = torch.arange(L - N_new, L)[:, None]  # (N_new, 1)
    j = torch.arange(L)[None, :]  # (1, L)
    S = (q @ keys.T) / math.sqrt(q.shape[1])  # (N_new, D) @ (D, L) -> (N_new, L)
    if softcap is not None:
        S = softcap * torch.tanh(S / softcap)
    if slope is not None:
        S = S - slope * (pos - j).abs().double()  # an int tensor times a float would be float32
    visible = torch.ones(N_new, L, dtype=torch.bool)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    if left >= 0:
        visible &= j >= pos - left
    if right >= 0:
        visible &= j <= pos + right
    S = S.masked_fill(~visible, NEG_INF)
    empty = ~visible.any(dim=1, keepdim=True)
    P = torch.softmax(S.masked_fill(empty, 0.0), dim=1).masked_fill(empty, 0.0)
    return P @ values  # (N_new, L) @ (L, D) -> (N_new, D)


CASES = [  # cache_len, new_kv, N_new, num_splits, block_n, options
    (5, 2, 1, 3, 2, {}),
    (5, 2, 2, 3, 2, {}),  # row 0 sees no key of split 2 (key 6)
    (11, 3, 3, 4, 3, {"window": (4, 0)}),  # keys before 14 - 3 - 4 = 7 are cut off
    (7, 1, 2, 2, 2, {"softcap": 2.0, "alibi": 0.5}),
    (0, 3, 2, 5, 1, {}),  # more splits than keys: two empty ranges
    (6, 0, 2, 2, 4, {"causal": False}),  # no new keys, no mask
    (0, 0, 1, 2, 2, {}),  # no key at all: O = 0, lse = -inf
]


@pytest.mark.parametrize(("cache_len", "new_kv", "N_new", "num_splits", "block_n", "options"), CASES)
def test_merged_output_matches_the_dense_oracle_and_the_decode(cache_len, new_kv, N_new, num_splits, block_n, options):
    q, k_cache, v_cache, k, v = make(cache_len, new_kv, N_new)
    causal, window, softcap = options.get("causal", True), options.get("window"), options.get("softcap")
    slope = options.get("alibi")
    alibi = None if slope is None else torch.tensor([slope], dtype=torch.float64)
    kwargs = {"causal": causal, "window": window, "softcap": softcap, "alibi_slopes": alibi, "num_splits": num_splits}
    r = replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=cache_len, block_n=block_n, **kwargs)
    L = cache_len + new_kv
    keys = torch.cat([k_cache[0, 0, :cache_len], k[0, 0]])
    values = torch.cat([v_cache[0, 0, :cache_len], v[0, 0]])
    expected = oracle(q[0, 0], keys, values, causal=causal, window=window, softcap=softcap, slope=slope)
    torch.testing.assert_close(r.O, expected, atol=1e-14, rtol=0)
    torch.testing.assert_close(r.O_final, expected, atol=1e-14, rtol=0)
    assert r.max_diff < 1e-14
    decoded = fa.flash_attention_with_kvcache(
        q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=cache_len, backend="online", **kwargs
    )
    torch.testing.assert_close(r.O, decoded[0, 0], atol=1e-14, rtol=0)
    assert [r.role(j) for j in range(r.N_max)] == [KeyRole.OLD] * cache_len + [KeyRole.NEW] * new_kv + [
        KeyRole.UNUSED
    ] * (r.N_max - L)
    if r.merges:  # the error after the last merge is round-off; before it, the partials are far off
        assert r.merges[-1].max_diff < 1e-14
        assert max(step.max_diff for split in r.splits for step in split) > 1e-3


def test_a_row_that_sees_no_key_of_a_split_gets_lse_minus_inf_and_weight_zero_without_nan():
    q, k_cache, v_cache, k, v = make(5, 2, 2)
    r = replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=5, block_n=2, num_splits=3, causal=True)
    assert r.ranges == ((0, 3), (3, 6), (6, 7))
    last = r.splits[2]
    assert last.lse_s[0] == NEG_INF and math.isfinite(last.lse_s[1])  # key 6 is after row 0's position 5
    assert torch.equal(last.O_s[0], torch.zeros(4, dtype=torch.float64))
    merge = r.merges[-1]
    assert merge["lse_b"][0] == NEG_INF and merge["w_b"][0] == 0 and merge["w_a"][0] == 1
    for t in (
        merge["w_a"],
        merge["w_b"],
        merge["lse"],
        merge["O"],
        r.O,
        *(s["O_partial"] for s in last),
        *(s["l_i"] for s in last),
    ):
        assert not t.isnan().any()
    assert r.visible[:, 6].tolist() == [False, True] and not r.visible[:, 7:].any()


def test_the_merge_order_does_not_matter():
    q, k_cache, v_cache, k, v = make(5, 2, 2)
    results = []
    for order in itertools.permutations(range(3)):
        r = replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=5, block_n=2, num_splits=3, merge_order=order)
        assert [m.split for m in r.merges] == list(order[1:])
        assert r.merges[-1].merged == order[:2]
        results.append(r)
    for r in results:
        torch.testing.assert_close(r.O, results[0].O, atol=1e-15, rtol=0)
        torch.testing.assert_close(r.lse, results[0].lse, atol=1e-15, rtol=0)
        assert r.max_diff < 1e-14


@pytest.mark.parametrize(("cache_len", "new_kv", "num_splits", "block_n"), [(5, 2, 3, 2), (13, 4, 2, 3), (9, 1, 4, 1)])
def test_each_split_takes_ceil_of_its_keys_over_block_n_tile_steps(cache_len, new_kv, num_splits, block_n):
    q, k_cache, v_cache, k, v = make(cache_len, new_kv, 1)
    r = replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=cache_len, block_n=block_n, num_splits=num_splits)
    for split in r.splits:
        s0, s1 = split.keys
        assert len(split) == -(-(s1 - s0) // block_n)
        cols = [step.cols for step in split]
        assert cols == [(c, min(c + block_n, s1)) for c in range(s0, s1, block_n)]  # tiles start at s0
    assert [s.keys for s in r.splits] == [rng for rng in r.ranges if rng[0] < rng[1]]
    assert r.ranges[0][0] == 0 and r.ranges[-1][1] == cache_len + new_kv


def test_unused_and_overwritten_slots_are_never_read_and_the_caches_are_not_written():
    q, k_cache, v_cache, k, v = make(5, 2, 2)
    clean = replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=5, block_n=2, num_splits=3)
    k_cache[:, :, 5:] = float("nan")  # the step overwrites [5, 7) and never reads [7, 9)
    v_cache[:, :, 5:] = float("nan")
    before = k_cache.clone()
    r = replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=5, block_n=2, num_splits=3)
    assert torch.equal(r.O, clean.O)
    assert torch.equal(k_cache.isnan(), before.isnan())  # still NaN: the replay wrote a copy


def test_batch_index_and_head_pick_their_cache_and_slope():
    lengths = [3, 6]
    q, k_cache, v_cache, k, v = make(lengths, 1, 1, B=2, H_q=4, H_kv=2)
    slopes = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]], dtype=torch.float64)
    seqlens = torch.tensor(lengths)
    r = replay_decode(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_n=2, num_splits=2, batch_index=1, head=3,
        alibi_slopes=slopes,
    )  # fmt: skip
    keys, values = (torch.cat([c[1, 1, :6], new[1, 1]]) for c, new in ((k_cache, k), (v_cache, v)))
    torch.testing.assert_close(r.O, oracle(q[1, 3], keys, values, slope=0.8), atol=1e-14, rtol=0)
    assert r.alibi_slope == 0.8 and r.L == 7


def test_float32_ends_within_float32_round_off():
    q, k_cache, v_cache, k, v = make(9, 2, 2, dtype=torch.float32)
    r = replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=9, block_n=2, num_splits=3)
    assert r.O.dtype == torch.float32 and r.O_final.dtype == torch.float64
    assert r.max_diff < 1e-6


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"merge_order": (0, 0, 1)}, "merge_order must list every split"),
        ({"head": 1}, "head must be in"),
        ({"batch_index": 2}, "batch_index must be in"),
        ({"block_n": 0}, "block_n"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    q, k_cache, v_cache, k, v = make(5, 2, 1)
    args = {"cache_seqlens": 5, "block_n": 2, "num_splits": 3, **kwargs}
    with pytest.raises((AttentionValueError, TypeError), match=match):
        replay_decode(q, k_cache, v_cache, k, v, **args)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv if argv[:1] in (("backward",), ("decode",)) else ("forward", *argv))


DECODE = ("decode", "--cache-len", "5", "--new-kv", "2", "--new-queries", "2", "--num-splits", "3")


def test_cli_json_is_the_replay_of_the_recorded_recipe_and_validates(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    out = tmp_path / "decode.json"
    assert run(parse(*DECODE, "--format", "json", "--out", str(out))) == 0
    experiment = json.loads(out.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema())
    jsonschema.Draft202012Validator(schema()).validate(experiment)
    torch.manual_seed(0)  # the recipe: q, k_cache, v_cache, k, v in this order
    shapes = [(1, 1, 2, 4), (1, 1, 9, 4), (1, 1, 9, 4), (1, 1, 2, 4), (1, 1, 2, 4)]
    q, k_cache, v_cache, k, v = (torch.randn(s, dtype=torch.float64) for s in shapes)
    r = replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=5, block_n=2, num_splits=3, causal=True)  # the CLI's
    assert experiment == json.loads(json.dumps(decode_to_experiment(r)))
    assert [c["split"]["index"] for c in experiment["cases"]] == [0, 0, 1, 1, 2]
    assert experiment["decode"]["keyRoles"] == ["old"] * 5 + ["new"] * 2 + ["unused"] * 2
    assert experiment["decode"]["merges"][-1]["lseB"][0] is None  # -inf, written as null
    assert experiment["decode"]["maxDiff"] < 1e-14


def test_cli_table_and_png_are_written(tmp_path):
    table = tmp_path / "decode.txt"
    assert run(parse(*DECODE, "--out", str(table))) == 0
    text = table.read_text(encoding="utf-8")
    for heading in ("Decode step replay", "Split 0 · keys 0–2", "Split 2 · keys 6–6", "Merges", "-inf"):
        assert heading in text
    pytest.importorskip("matplotlib")
    png = tmp_path / "decode.png"
    assert run(parse(*DECODE, "--format", "png", "--out", str(png))) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((*DECODE, "--cache-size", "6"), "--cache-size: must hold"),
        ((*DECODE, "--merge-order", "0,1"), "--merge-order: must list every split"),
        ((*DECODE, "--cache-len", "60", "--format", "png", "--out", "x.png"), "draws every cache slot"),
    ],
)
def test_cli_refuses_options_that_do_not_fit(argv, message, capsys):
    assert run(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_each_merge_carries_its_equations_with_torchs_numbers():
    """A MERGE step's equations: lse = logaddexp(lse_a, lse_b), w = exp(lse_x - lse), O = w_a O_a + w_b O_b, each
    value against torch's own functions on the step's inputs."""
    torch.manual_seed(3)
    q = torch.randn(1, 1, 2, 4, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(1, 1, 9, 4, dtype=torch.float64) for _ in range(2))
    r = replay_decode(q, k_cache, v_cache, cache_seqlens=7, num_splits=3, block_n=2, causal=True)
    partials = {p.index: p.O_s for p in r.splits}
    for n, m in enumerate(r.merges):
        eq = {e.name: e for e in m.equations}
        assert list(eq) == ["lse", "w_a", "w_b", "O"]
        lse = torch.logaddexp(m["lse_a"], m["lse_b"])
        torch.testing.assert_close(eq["lse"].value, lse, rtol=0, atol=1e-14)
        torch.testing.assert_close(eq["w_a"].value, torch.exp(m["lse_a"] - lse), rtol=0, atol=1e-14)
        O_a = partials[m.merged[0]] if n == 0 else r.merges[n - 1]["O"]
        O = eq["w_a"].value[:, None] * O_a + eq["w_b"].value[:, None] * partials[m.split]
        torch.testing.assert_close(eq["O"].value, O, rtol=0, atol=1e-14)
        assert eq["lse"].substituted.endswith(f"= {numbers(lse)}")
