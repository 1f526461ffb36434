"""``flashattn-teach replay --backward``: table, strict JSON and the page, checked against float64 autograd."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flashattn_teach.replay.backward_replay import replay_backward
from flashattn_teach.replay.html import render_html
from flashattn_teach.replay.manifest import build_backward_view, to_backward_json
from flashattn_teach.replay.replay import replay

from replay_cli import main


def _inputs(B=1, N=6, D=4, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(B, N, D, dtype=torch.float64) for _ in range(4)]  # q, k, v, then dO


def _oracle(q, k, v, dO, mask):
    """float64 autograd of dense attention written here: (dQ, dK, dV) as nested lists."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    S = (q @ k.T / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf"))
    P = torch.nan_to_num(torch.softmax(S, -1), nan=0.0)
    (P @ v * dO).sum().backward()
    return {"dQ": q.grad, "dK": k.grad, "dV": v.grad}


def _close(values, t: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(values, dtype=torch.float64), t, atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_json_gradients_are_the_float64_oracle(causal, capsys):
    argv = ["backward", "--format", "json", *(["--causal"] if causal else [])]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "NaN" not in text and "Infinity" not in text
    doc = json.loads(text)
    q, k, v, dO = (t[0] for t in _inputs())
    mask = torch.tril(torch.ones(6, 6, dtype=torch.bool)) if causal else torch.ones(6, 6, dtype=torch.bool)
    for name, ref in _oracle(q, k, v, dO, mask).items():
        _close(doc["gradients"][name], ref)
        _close(doc["oracle"][name], ref)
        assert doc["maxError"][name] <= 1e-12
    _close(doc["inputs"]["dO"], dO)  # dO is the 4th randn of the seeded stream
    passes = [s["stepKind"] for s in doc["steps"]]
    assert passes[0] == "preprocess" and passes.count("preprocess") == 1
    T = 3 * (3 + 1) // 2 if causal else 9  # visited tiles of a 3 x 3 grid
    assert passes.count("dkdv") == passes.count("dq") == T
    assert passes == sorted(passes, key=["preprocess", "dkdv", "dq"].index)
    assert doc["skipped"] == ([[0, 1], [0, 2], [1, 2]] if causal else [])
    if causal:  # a causal row 0 sees only key 0: its lse is its one score, and -inf cells are null
        assert doc["steps"][1]["S_ij"][0][1] is None


def test_json_is_strict_with_a_masked_row(tmp_path, capsys):
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[2] = False
    torch.save(mask, tmp_path / "m.pt")
    assert main(["backward", "--format", "json", "--mask", str(tmp_path / "m.pt")]) == 0
    text = capsys.readouterr().out
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert doc["inputs"]["lse"][2] is None and doc["gradients"]["dQ"][2] == [0.0] * 4
    q, k, v, dO = (t[0] for t in _inputs())
    for name, ref in _oracle(q, k, v, dO, mask).items():
        _close(doc["gradients"][name], ref)


def test_table_shows_every_step_with_numbers_and_the_final_error(capsys):
    assert main(["backward", "--causal", "--block-m", "3"]) == 0
    text = capsys.readouterr().out
    assert "Preprocess" in text and "delta = rowsum(dO * O)" in text
    q, k, v, dO = _inputs()
    r = replay_backward(q, k, v, dO, block_m=3, block_n=2, causal=True)
    n_dkdv, n_dq = len(list(r.dkdv_steps())), len(list(r.dq_steps()))
    assert n_dkdv == n_dq == 5
    for n in range(1, n_dkdv + 1):
        assert f"dK/dV pass · step {n} of {n_dkdv}" in text and f"dQ pass · step {n} of {n_dq}" in text
    assert "dK_j = dK_j + scale dS_ij^T Q_i" in text and "dQ_i = dQ_i + scale dS_ij K_j" in text
    first = next(iter(r.dkdv_steps())).equations[0].substituted
    assert first[:40] in text  # the numbers of the first equation
    worst = text.rsplit("max |grad - oracle| over every gradient:", 1)[1].split()[0]
    assert float(worst) <= 1e-12


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--format", "table", "--step", "1"], "argument --step: draws one step of --format png"),
        (["--seq-len", "100", "--block-m", "1", "--format", "json"], "T_r x T_c = 5000 is more than 1024"),
    ],
)
def test_backward_refuses_what_it_cannot_do_by_name(argv, message, capsys):
    assert main(["backward", *argv]) == 2
    assert message in capsys.readouterr().err


def test_html_opens_on_the_backward_view(tmp_path):
    out = tmp_path / "page.html"
    assert main(["backward", "--format", "html", "--sinks", "0.5", "--out", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert '"openView": "backward"' in page and 'Page.addView("backward"' in page
    views = json.loads(page.split('<script type="application/json" id="view-data">')[1].split("</script>")[0])
    assert views["backward"]["sink"] == 0.5 and "dsink" in views["backward"]["gradients"]


def test_the_page_shows_the_backward_by_default_only_when_small():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 65, 4, dtype=torch.float64) for _ in range(3))
    big = replay(q, k, v, block_m=16, block_n=16)  # 65 x 65 cells: more than DEFAULT_MAX_CELLS
    assert build_backward_view(big, {}) is None and build_backward_view(big, {"backward": True}) is not None
    few = replay(q[:, :8], k[:, :8], v[:, :8], block_m=2, block_n=2)
    assert build_backward_view(few, {}) is not None


def test_the_cli_page_carries_the_backward_with_the_fourth_randn_as_dO(tmp_path):
    out = tmp_path / "page.html"
    assert main(["forward", "--format", "html", "--out", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    views = json.loads(page.split('<script type="application/json" id="view-data">')[1].split("</script>")[0])
    torch.manual_seed(0)
    q, k, v, dO = (torch.randn(1, 6, 4, dtype=torch.float64) for _ in range(4))
    assert views["backward"] == to_backward_json(replay_backward(q, k, v, dO, block_m=2, block_n=2))
    assert '"openView"' not in page  # the forward view opens first


def test_render_html_builds_the_backward_of_the_forward_replay():
    q, k, v, _ = _inputs()
    r = replay(q, k, v, block_m=2, block_n=2, causal=True)
    assert build_backward_view(r, {"backward": False}) is None
    payload = build_backward_view(r, {"backward": True})
    assert payload == to_backward_json(replay_backward(q, k, v, block_m=2, block_n=2, causal=True))
    assert build_backward_view(r, {}) == payload  # a small replay shows its backward without being asked
    assert '"backward"' in render_html(r, backward=True)
    with pytest.raises(ValueError, match="BackwardReplay or True"):
        build_backward_view(r, {"backward": "yes"})
