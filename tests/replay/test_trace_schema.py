"""One schema (``replay.schema.json``) for the three scenarios: the JSON of every format that writes JSON (``--format
json``, and the data a ``--format html`` page embeds) validates against it for ``replay forward``, ``backward``
and ``decode``; every document names its scenario (``replayKind``) and every step its kind (``stepKind``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
