"""The replay under the mask contract: window, softcap, ALiBi, seqlens_k and attn_mask, against the dense oracle."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashattn_teach.masks.causal import TileKind
from flashattn_teach.reference import dense_attention
from flashattn_teach.replay import replay, to_experiment
from flashattn_teach.replay.cli import add_arguments, run
from flashattn_teach.replay.html import render_html
from flashattn_teach.replay.manifest import schema


@st.composite
def variant_cases(draw):
    B, N_q, N_k = draw(st.integers(1, 3)), draw(st.integers(1, 10)), draw(st.integers(1, 10))
    block_m, block_n = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    mask_kind = draw(st.sampled_from([None, "bool", "additive", "left_pad"]))
    attn_mask = None
    if mask_kind == "bool":
        attn_mask = torch.rand(B, N_q, N_k, generator=g) > 0.3
    elif mask_kind == "additive":
        attn_mask = torch.randn(N_q, N_k, generator=g, dtype=torch.float64).masked_fill(
            torch.rand(N_q, N_k, generator=g) < 0.3, float("-inf")
        )
    elif mask_kind == "left_pad":
        pads = torch.randint(0, N_k + 1, (B,), generator=g)
        attn_mask = (torch.arange(N_k)[None, :] >= pads[:, None])[:, None, :]  # (B, 1, N_k)
    return {
        "qkv": tuple(torch.randn(B, n, 3, generator=g, dtype=torch.float64) for n in (N_q, N_k, N_k)),
        "block_m": block_m,
        "block_n": block_n,
        "query_block": draw(st.integers(0, -(-N_q // block_m) - 1)),
        "batch_index": draw(st.integers(0, B - 1)),
        "causal": draw(st.booleans()),
        "causal_align": draw(st.sampled_from(["top_left", "bottom_right"])),
        "order": draw(st.sampled_from(["query_major", "key_major"])),
        "window": draw(st.none() | st.tuples(st.integers(-1, 4), st.integers(-1, 4))),
        "softcap": draw(st.none() | st.floats(0.5, 5.0)),
        "alibi": draw(st.none() | st.floats(0.0, 1.0)),
        "seqlens_k": draw(st.none() | st.lists(st.integers(0, N_k), min_size=B, max_size=B)),
        "attn_mask": attn_mask,
    }


def options(case) -> dict:
    return {
        "causal": case["causal"],
        "causal_align": case["causal_align"],
        "window": case["window"],
        "softcap": case["softcap"],
        "seqlens_k": None if case["seqlens_k"] is None else torch.tensor(case["seqlens_k"]),
    }


@given(variant_cases())
def test_replay_with_any_mask_option_ends_at_the_dense_oracle(case):
    q, k, v = case["qkv"]
    B = q.shape[0]
    r = replay(
        q,
        k,
        v,
        block_m=case["block_m"],
        block_n=case["block_n"],
        query_block=case["query_block"],
        order=case["order"],
        batch_index=case["batch_index"],
        alibi_slopes=case["alibi"],
        attn_mask=case["attn_mask"],
        **options(case),
    )
    # The oracle on the whole (B, 1, N, D) problem, with the same options spelt the dense way.
    mask = case["attn_mask"]
    mask4 = None if mask is None else mask.unsqueeze(-3) if mask.dim() == 3 else mask
    slopes = None if case["alibi"] is None else torch.full((1,), case["alibi"], dtype=torch.float64)
    O = dense_attention(
        q[:, None], k[:, None], v[:, None], alibi_slopes=slopes, attn_mask=mask4, **options(case)
    )  # (B, 1, N_q, 3)
    b = case["batch_index"] if B > 1 else 0
    r0, r1 = r.rows
    expected = O[b, 0, r0:r1]
    last = r.steps[-1]["O_partial"] if len(r.steps) else torch.zeros_like(expected)  # no tile visited: O = 0
    torch.testing.assert_close(last, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(r.steps.O_final, expected, rtol=0, atol=1e-12)
    # Steps visit exactly the tiles the references' tiling visits, each with the tiling's kind, never SKIP.
    tiling = r.mask.tiling(case["block_m"], case["block_n"])
    i = case["query_block"]
    assert [s.j for s in r.steps] == tiling.key_blocks(i, b=b, h=0)
    assert all(s.kind is tiling.kind(i, s.j, b=b, h=0) and s.kind is not TileKind.SKIP for s in r.steps)
    assert sorted(j for i_t, j in r.skipped if i_t == i) == sorted(
        set(range(r.T_c)) - set(tiling.key_blocks(i, b=b, h=0))
    )


def band_replay(query_block: int = 3, order: str = "query_major"):
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 4, dtype=torch.float64) for _ in range(3))
    return replay(q, k, v, block_m=2, block_n=2, query_block=query_block, window=(2, 0), order=order)


@pytest.mark.parametrize("order", ["query_major", "key_major"])
def test_a_window_2_0_replay_visits_only_the_bands_tiles(order):
    r = band_replay(order=order)
    band = [(0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3)]  # rows 2i, 2i+1 see keys 2i-2 .. 2i+1
    assert sorted(r.schedule) == band
    assert list(r.skipped) == [(i, j) for i in range(4) for j in range(4) if (i, j) not in band]
    assert [(s.j, s.kind) for s in r.steps] == [(2, TileKind.PARTIAL), (3, TileKind.PARTIAL)]
    assert r.variants == ("window",) and r.window == (2, 0)


def test_a_causal_window_folds_right_into_causal_and_keeps_full_tiles():
    torch.manual_seed(0)
    q, k, v = (torch.randn(16, 2, dtype=torch.float64) for _ in range(3))
    r = replay(q, k, v, block_m=4, block_n=4, query_block=3, causal=True, window=(8, 5))
    assert r.window == (8, 0)
    # Rows 12-15 see keys i-8 .. i: block 1 (4-7) partly, block 2 (8-11) wholly, block 3 (12-15) on the diagonal.
    assert [(s.j, s.kind) for s in r.steps] == [(1, TileKind.PARTIAL), (2, TileKind.FULL), (3, TileKind.PARTIAL)]


def test_a_long_window_replay_keeps_the_schedule_as_ranges():
    N = 100_000
    q = torch.zeros(N, 1)
    r = replay(q, q, q, block_m=2, block_n=2, query_block=N // 2 - 1, window=(3, 0))
    assert len(r.schedule) == 3 * (N // 2) - 3  # three key blocks per query block; blocks 0 and 1 have 1 and 2
    assert all(isinstance(r.schedule.key_blocks(i), range) for i in (0, 1, N // 2 - 1))
    assert [s.j for s in r.steps] == [N // 2 - 3, N // 2 - 2, N // 2 - 1]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv if argv[:1] in (("backward",), ("decode",)) else ("forward", *argv))


def test_cli_window_2_0_lists_the_band_and_the_skipped_tiles(tmp_path):
    out = tmp_path / "replay.txt"
    assert run(parse("--seq-len", "8", "--window", "2,0", "--query-block", "3", "--out", str(out))) == 0
    text = out.read_text(encoding="utf-8")
    assert "window (2, 0)" in text and "Tile update 2/2" in text and "PARTIAL tile (masked)" in text
    assert "Skipped (SKIP) tiles of this block: key blocks j = 0–1" in text


def test_cli_json_carries_every_option_and_equals_the_replay(capsys):
    argv = "--batch 2 --batch-index 1 --seq-len 8 --causal --pad-left 0,3 --alibi 0.5 --softcap 5 --seqlens-k 8,7"
    assert run(parse(*argv.split(), "--query-block", "2", "--format", "json", "--extensions")) == 0
    got = json.loads(capsys.readouterr().out)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 4, dtype=torch.float64) for _ in range(3))
    pad = torch.tensor([[True] * 8, [False] * 3 + [True] * 5])[:, None, :]  # (B, 1, N_k), HF's left padding
    r = replay(
        q, k, v, block_m=2, block_n=2, query_block=2, causal=True, batch_index=1, attn_mask=pad,
        alibi_slopes=0.5, softcap=5.0, seqlens_k=torch.tensor([8, 7]),
    )  # fmt: skip
    assert got == to_experiment(r, extensions=True)
    assert got["replay"]["variants"] == ["softcap", "alibi_slopes", "seqlens_k", "attn_mask"]
    assert [c["tiles"]["j"] for c in got["cases"]] == [1, 2]  # key block 0 is all padding for element 1
    assert [2, 0] in got["replay"]["skipped"] and [2, 3] in got["replay"]["skipped"]  # padding, causal
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(schema()).validate(got)
    page = render_html(r)
    jsonschema.Draft202012Validator(schema()).validate(
        json.loads(page.split('<script type="application/json" id="replay-data">')[1].split("</script>")[0])
    )


def test_cli_reads_a_saved_mask(tmp_path, capsys):
    mask = torch.ones(6, 6, dtype=torch.bool).tril(-1) | torch.eye(6, dtype=torch.bool)
    torch.save(mask, tmp_path / "mask.pt")
    assert run(parse("--mask", str(tmp_path / "mask.pt"), "--query-block", "0", "--format", "json")) == 0
    causal = json.loads(capsys.readouterr().out)
    assert run(parse("--causal", "--query-block", "0", "--format", "json")) == 0
    assert causal == json.loads(capsys.readouterr().out)  # a tril mask replays as causal does


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (("--window", "2"), "--window"),
        (("--window", "-2,0"), "--window"),
        (("--softcap", "0"), "--softcap"),
        (("--batch", "2", "--alibi", "1,2,3"), "--alibi"),
        (("--pad-left", "1", "--mask", "m.pt"), "not allowed with"),
        (("--mask", "missing.pt"), "--mask"),
    ],
)
def test_bad_mask_options_exit_2_naming_the_option(argv, named, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        status = run(parse(*argv))
    except SystemExit as exit_:  # argparse rejects a malformed value itself
        status = exit_.code
    assert status == 2
    assert named in capsys.readouterr().err


def test_pictures_grey_out_exactly_the_masked_cells():
    r = band_replay()
    visible = r.visible()
    rows, cols = torch.arange(8)[:, None], torch.arange(8)[None, :]
    assert torch.equal(visible, (cols <= rows) & (cols >= rows - 2))
    page = render_html(r)
    data = json.loads(page.split('<script type="application/json" id="replay-data">')[1].split("</script>")[0])
    assert data["replay"]["visible"][7] == "00000111"
