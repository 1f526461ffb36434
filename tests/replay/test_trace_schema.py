"""One schema (``replay.schema.json``) for the three scenarios: the JSON of every format that writes JSON (``--format
json``, and the data a ``--format html`` page embeds) validates against it for ``replay forward``, ``backward``
and ``decode``; every document names its scenario (``replayKind``) and every step its kind (``stepKind``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flashattn_teach.replay import Step, StepKind, replay, replay_backward, replay_decode, to_json
from flashattn_teach.replay.manifest import schema

from replay_cli import main

jsonschema = pytest.importorskip("jsonschema")
VALIDATOR = jsonschema.Draft202012Validator(schema())

CASES = {
    "forward": ["forward", "--causal", "--sinks", "0.5"],
    "forward --extensions": ["forward", "--window", "2,0", "--extensions"],
    "backward": ["backward", "--causal", "--sinks", "0.5"],
    "decode": ["decode", "--sinks", "0.5"],
}
STEP_KINDS = {"forward": {"update"}, "backward": {"preprocess", "dkdv", "dq"}, "decode": {"update", "merge"}}


def page_data(path: Path, element: str) -> dict:
    page = path.read_text(encoding="utf-8")
    return json.loads(page.split(f'<script type="application/json" id="{element}">')[1].split("</script>")[0])


def step_kinds(doc: dict) -> set[str]:
    steps = doc.get("steps", doc.get("cases", []))
    return {s["stepKind"] for s in steps} | {m["stepKind"] for m in doc.get("decode", {}).get("merges", [])}


def test_the_schema_is_a_valid_schema():
    jsonschema.Draft202012Validator.check_schema(schema())


@pytest.mark.parametrize("case", CASES)
def test_every_scenarios_json_validates_with_its_kinds(case, capsys):
    argv = CASES[case]
    assert main([*argv, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    VALIDATOR.validate(doc)
    assert doc["replayKind"] == argv[0]
    assert step_kinds(doc) == STEP_KINDS[argv[0]]


@pytest.mark.parametrize("scenario", ["forward", "backward", "decode"])
def test_every_pages_embedded_json_validates(scenario, tmp_path):
    out = tmp_path / "page.html"
    assert main([scenario, "--format", "html", "--out", str(out)]) == 0
    data = page_data(out, "replay-data")  # the forward's experiment (backward: beside it), or the decode step's
    VALIDATOR.validate(data)
    assert data["replayKind"] == ("decode" if scenario == "decode" else "forward")
    if scenario != "decode":
        backward = page_data(out, "view-data")["backward"]  # the Backward tab: the backward document itself
        VALIDATOR.validate(backward)
        assert backward["replayKind"] == "backward"


@pytest.mark.parametrize("scenario", ["forward", "backward", "decode"])
def test_the_schema_refuses_a_document_of_the_wrong_kind(scenario, capsys):
    """The negative controls: each document under another scenario's name, or with a step of another kind."""
    assert main([scenario, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for other in {"forward", "backward", "decode"} - {scenario}:
        with pytest.raises(jsonschema.ValidationError):
            VALIDATOR.validate({**doc, "replayKind": other})
    steps = "steps" if scenario == "backward" else "cases"
    wrong = {**doc, steps: [{**doc[steps][-1], "stepKind": "merge"}]}
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(wrong)


def scenarios() -> dict[str, object]:
    torch.manual_seed(0)
    q, k, v, dO = (torch.randn(1, 6, 4, dtype=torch.float64) for _ in range(4))
    cache = torch.randn(1, 1, 9, 4, dtype=torch.float64)
    new = torch.randn(1, 1, 2, 4, dtype=torch.float64)
    return {
        "forward": replay(q, k, v, block_m=2, block_n=2, causal=True, query_block=2),  # 3 key blocks
        "backward": replay_backward(q, k, v, dO, block_m=2, block_n=2, causal=True),
        "decode": replay_decode(
            q[:, None, :1], cache, cache.clone(), new, new.clone(), cache_seqlens=5, num_splits=3, block_n=2
        ),
    }


@pytest.mark.parametrize("scenario", ["forward", "backward", "decode"])
def test_every_scenario_yields_steps_of_one_kind_enum_in_the_order_its_json_lists_them(scenario):
    r = scenarios()[scenario]
    assert r.replay_kind == scenario
    steps = list(r.all_steps())
    # One step type for every scenario: each carries its kind, its named terms and its equations.
    assert all(type(s) is Step and isinstance(s.step_kind, StepKind) and isinstance(s.index, int) for s in steps)
    assert all(s.terms and all(isinstance(t, torch.Tensor) for t in s.terms.values()) for s in steps)
    assert all(len(s.equations) > 0 for s in steps)
    doc = json.loads(to_json(r))
    listed = [s["stepKind"] for s in doc.get("steps", doc.get("cases", []))]
    listed += [m["stepKind"] for m in doc.get("decode", {}).get("merges", [])]
    assert [s.step_kind.value for s in steps] == listed and len(steps) > 1


def test_each_scenarios_last_step_reaches_float64_attention():
    """The steps' own end state against torch's float64 SDPA (forward, decode) and autograd (backward)."""
    r = scenarios()
    q, k, v = r["forward"].inputs
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[4:]  # rows 4, 5
    dense = F.scaled_dot_product_attention(q[:, 4:], k, v, attn_mask=causal)
    assert torch.allclose(list(r["forward"].all_steps())[-1]["O_partial"], dense[0], atol=1e-12)
    assert max(r["backward"].max_error().values()) < 1e-12
    last = list(r["decode"].all_steps())[-1]
    assert last.step_kind is StepKind.MERGE and last.max_diff < 1e-12
