"""The replay with an attention sink: each row starts at the sink, and its share matches the library's lse.

The oracle here is written out in float64 (softmax over the visible keys and one more column, the sink,
which is then dropped); the sink share is compared with ``exp(sink - lse)`` from ``flash_attention(...,
sinks=, return_lse=True)``, and a negative control shows that both probes see the sink.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import re

import pytest
import torch

from flashattn_teach import flash_attention
from flashattn_teach.errors import AttentionTypeError, AttentionValueError
from flashattn_teach.replay import replay, to_experiment
from flashattn_teach.replay.html import render_html
from flashattn_teach.replay.manifest import schema
from flashattn_teach.replay.table import render_table

from replay_cli import main

SINK = 0.75


def qkv(N_q: int = 7, N_k: int = 7, D: int = 4, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((1, N_q, D), (1, N_k, D), (1, N_k, D))
    return tuple(torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes)


def oracle(q, k, v, sink: float | None, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(O, lse)`` in float64 for ``(N_q, D)`` inputs and a bool ``(N_q, N_k)`` mask: the sink as one more
    score column of value zero (GPT-OSS's eager attention), written here without the library."""
    S = (q @ k.T) / math.sqrt(q.shape[-1])  # (N_q, D) @ (D, N_k) -> (N_q, N_k)
    S = S.masked_fill(~visible, float("-inf"))
    if sink is not None:
        S = torch.cat([S, torch.full((S.shape[0], 1), sink, dtype=S.dtype)], dim=-1)  # (N_q, N_k + 1)
    lse = torch.logsumexp(S, dim=-1)  # (N_q,)
    P = torch.exp(S - lse[:, None])
    P = P[:, : k.shape[0]]  # the sink's column reaches no value
    return P @ v, lse  # (N_q, N_k) @ (N_k, D_v) -> (N_q, D_v)


CASES = {
    "causal": {"causal": True},
    "key-major": {"causal": True, "order": "key_major"},
    "window": {"window": (2, 1)},
    "bottom-right": {"causal": True, "causal_align": "bottom_right", "N_q": 4},
}


def visible_of(name: str, N_q: int, N_k: int) -> torch.Tensor:
    i = torch.arange(N_q)[:, None]
    j = torch.arange(N_k)[None, :]
    if name == "window":
        return (j >= i - 2) & (j <= i + 1)
    offset = N_k - N_q if name == "bottom-right" else 0
    return j <= i + offset


@pytest.mark.parametrize("name", CASES)
def test_replay_with_a_sink_ends_at_the_float64_oracle_and_its_share_is_exp_sink_minus_lse(name):
    options = dict(CASES[name])
    N_q = options.pop("N_q", 7)
    q, k, v = qkv(N_q=N_q)
    r = replay(q, k, v, block_m=3, block_n=2, query_block=1, sinks=SINK, **options)
    r0, r1 = r.rows
    O, lse = oracle(q[0], k[0], v[0], SINK, visible_of(name, N_q, 7))
    last = r.steps[-1]
    assert (last["O_partial"] - O[r0:r1]).abs().max() <= 1e-12
    assert last.max_diff <= 1e-12  # the replay's own oracle (dense_attention with sinks) agrees
    # The library's lse, sink included: the share is the weight the sink took from the keys.
    flash_options = {key: value for key, value in options.items() if key != "order"}
    _, lse_lib = flash_attention(
        q[:, None],
        k[:, None],
        v[:, None],
        sinks=torch.tensor([SINK], dtype=torch.float64),
        return_lse=True,
        **flash_options,
    )
    share = r.sink_share()
    assert share is not None
    torch.testing.assert_close(share, torch.exp(SINK - lse_lib[0, 0, r0:r1]), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(share, torch.exp(SINK - lse[r0:r1]), rtol=1e-12, atol=1e-15)


def test_each_step_starts_from_the_sink_and_the_share_falls_as_keys_come_in():
    q, k, v = qkv()
    r = replay(q, k, v, block_m=2, block_n=2, query_block=2, causal=True, sinks=SINK)
    shares = [step.get("sink_share") for step in r.steps]
    first = r.steps[0]
    # After one tile from m = sink, l = 1: m = max(sink, rowmax S), l = exp(sink - m) + rowsum exp(S - m).
    m = torch.maximum(first["S_ij"].amax(dim=-1), torch.tensor(SINK, dtype=torch.float64))
    l = torch.exp(SINK - m) + torch.exp(first["S_ij"] - m[:, None]).sum(dim=-1)
    torch.testing.assert_close(first["m_i"], m, rtol=0, atol=0)
    torch.testing.assert_close(first["l_i"], l, rtol=1e-15, atol=0)
    # exp(sink) / (exp(sink) + sum of exp(S) seen so far): every key adds to the denominator only.
    assert len(shares) == 3
    for before, after in itertools.pairwise(shares):
        assert bool((after <= before * (1 + 1e-12)).all())
    assert bool((shares[-1] < shares[0]).any())


def test_without_a_sink_there_is_no_share_and_the_output_differs():
    q, k, v = qkv()
    plain = replay(q, k, v, block_m=3, block_n=2, query_block=1, causal=True)
    with_sink = replay(q, k, v, block_m=3, block_n=2, query_block=1, causal=True, sinks=SINK)
    assert plain.sink_share() is None and plain.steps[-1].get("sink_share") is None and plain.sink is None
    experiment = to_experiment(plain, extensions=True)
    assert "sink" not in experiment and all("sinkShare" not in case for case in experiment["cases"])
    assert "sink" not in " ".join(plain.labels())
    assert (plain.steps[-1]["O_partial"] - with_sink.steps[-1]["O_partial"]).abs().max() > 1e-2
    # The oracle without its sink column is the plain replay's answer, not the sink replay's.
    r0, r1 = plain.rows
    O, _ = oracle(q[0], k[0], v[0], None, visible_of("causal", 7, 7))
    assert (plain.steps[-1]["O_partial"] - O[r0:r1]).abs().max() <= 1e-12


def test_a_block_that_sees_no_key_has_share_one_and_output_zero():
    q, k, v = qkv()
    r = replay(q, k, v, block_m=3, block_n=2, seqlens_k=torch.tensor([0]), sinks=SINK)
    assert len(r.steps) == 0
    torch.testing.assert_close(r.sink_share(), torch.ones(3, dtype=torch.float64))
    assert r.steps.O_final.abs().max() == 0


def test_a_tensor_sink_is_taken_and_bad_sinks_are_refused_by_name():
    q, k, v = qkv()
    as_number = replay(q, k, v, block_m=3, block_n=2, causal=True, sinks=SINK)
    as_tensor = replay(q, k, v, block_m=3, block_n=2, causal=True, sinks=torch.tensor([SINK], dtype=torch.float32))
    torch.testing.assert_close(as_tensor.sink_share(), as_number.sink_share())
    with pytest.raises(AttentionValueError, match=r"sinks must have shape \(1,\)"):
        replay(q, k, v, block_m=3, block_n=2, sinks=torch.zeros(2))
    with pytest.raises(AttentionTypeError, match="sinks must be a number"):
        replay(q, k, v, block_m=3, block_n=2, sinks="0.5")
    with pytest.raises(AttentionValueError, match="sinks must be finite"):
        replay(q, k, v, block_m=3, block_n=2, sinks=float("inf"))


def test_json_html_and_table_show_the_share_and_the_json_validates():
    q, k, v = qkv()
    r = replay(q, k, v, block_m=3, block_n=2, query_block=1, causal=True, sinks=SINK)
    share = r.sink_share()
    assert share is not None
    experiment = to_experiment(r, extensions=True)
    assert experiment["sink"] == {"value": SINK, "rowStart": 3, "share": share.tolist()}
    assert experiment["cases"][-1]["sinkShare"] == share.tolist()
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(schema()).validate(experiment)
    bad = json.loads(json.dumps(experiment))
    bad["cases"][0]["sinkShare"][0] = 1.5  # a share is a weight in [0, 1]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema()).validate(bad)

    page = render_html(r)
    data = json.loads(re.search(r'id="replay-data">(.*?)</script>', page, re.S).group(1))
    assert data["sink"]["share"] == share.tolist()
    assert all(json.dumps(x) in page for x in share.tolist())
    assert "Sink share so far" in page  # the forward view's sink panel (page_forward.js)

    out = io.StringIO()
    render_table(r, out)
    text = out.getvalue()
    assert "sink share" in text and f"{float(share[0]):.4g}" in text and "exp(sink - lse_i)" in text


def test_cli_sinks_flag(capsys, tmp_path):
    argv = ["forward", "--seq-len", "5", "--causal", "--query-block", "1", "--format", "json"]
    assert main([*argv, "--sinks", "0.5"]) == 0
    experiment = json.loads(capsys.readouterr().out)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 5, 4, dtype=torch.float64) for _ in range(3))  # the CLI's recipe
    expected = replay(q, k, v, block_m=2, block_n=2, query_block=1, causal=True, sinks=0.5).sink_share()
    assert expected is not None and experiment["sink"]["share"] == expected.tolist()
    assert main(argv) == 0
    assert "sink" not in json.loads(capsys.readouterr().out)  # negative control
    assert main([*argv, "--sinks", "0.5,1"]) == 2
    assert "argument --sinks: the replay runs one head" in capsys.readouterr().err
    assert main(["decode", "--sinks", "0.5,1"]) == 2
    assert "argument --sinks: the replay runs one head" in capsys.readouterr().err
    png = tmp_path / "sink.png"
    assert (
        main(["forward", "--seq-len", "4", "--sinks", "0.5", "--format", "png", "--out", str(png), "--step", "1"]) == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
