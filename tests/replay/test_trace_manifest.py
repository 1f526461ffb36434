"""The seed manifest format: field names and labels character for character, strict JSON, the schema."""

from __future__ import annotations

import io
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_trace_replay import make, replay_cases, run

from flashattn_teach.errors import AttentionValueError
from flashattn_teach.replay import replay, to_experiment, to_json, write_json
from flashattn_teach.replay.manifest import schema


def seed_replay(**kwargs):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 4, dtype=torch.float64) for _ in range(3))
    return replay(q, k, v, block_m=2, block_n=2, **kwargs)


def validate(experiment: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(schema())
    jsonschema.Draft202012Validator(schema()).validate(experiment)


def test_seed_example_has_the_seed_manifest_fields_and_labels():
    r = seed_replay()
    experiment = json.loads(to_json(r))
    assert list(experiment) == ["kind", "replayKind", "title", "controlLabel", "cases"]  # the seed's, and the scenario
    assert experiment["kind"] == "schedule"
    assert experiment["title"] == "Finish attention without retaining every score."
    assert experiment["controlLabel"] == "Tile update"
    assert [c["id"] for c in experiment["cases"]] == ["tile-1", "tile-2", "tile-3"]
    assert [c["label"] for c in experiment["cases"]] == [
        "Query rows 0\u20131 \u00b7 key columns 0\u20131",
        "Query rows 0\u20131 \u00b7 key columns 2\u20133",
        "Query rows 0\u20131 \u00b7 key columns 4\u20135",
    ]
    first = experiment["cases"][0]
    assert first["schedule"] == {
        "rows": 6,
        "columns": 6,
        "rowStart": 0,
        "rowCount": 2,
        "columnStart": 0,
        "columnCount": 2,
        "completedColumns": 0,
    }
    assert [c["schedule"]["completedColumns"] for c in experiment["cases"]] == [0, 2, 4]
    assert [v["label"] for v in first["vectors"]] == [
        "Current score tile \u00b7 row-major",
        "Running row maximum",
        "Running denominator",
        "Partial output \u00b7 query 0",
        "Final dense output \u00b7 query 0",
    ]
    assert [len(v["values"]) for v in first["vectors"]] == [4, 2, 2, 4, 4]
    assert [m["label"] for m in first["metrics"]] == [
        "Score elements in current tile",
        "Elements in a full score matrix",
        "Max difference from final output \u00b7 rows 0\u20131",
    ]
    assert [m["value"] for m in first["metrics"][:2]] == [4, 36]
    last = experiment["cases"][-1]
    assert last["metrics"][2]["value"] < 1e-15
    assert last["vectors"][3]["values"] == pytest.approx(last["vectors"][4]["values"], abs=1e-15)
    validate(experiment)


def test_vectors_are_the_replay_step_values_in_full_precision():
    r = seed_replay(query_block=1)
    for step, case in zip(r.steps, to_experiment(r)["cases"], strict=True):
        values = [v["values"] for v in case["vectors"]]
        assert values[0] == step["S_ij"].reshape(-1).tolist()
        assert values[1] == step["m_i"].tolist() and values[2] == step["l_i"].tolist()
        assert values[3] == step["O_partial"][0].tolist() and values[4] == step["O_final"][0].tolist()
        assert case["metrics"][2]["value"] == step.max_diff
        assert case["vectors"][3]["label"] == "Partial output \u00b7 query 2"


@pytest.mark.parametrize("order", ["query_major", "key_major"])
@pytest.mark.parametrize("extensions", [False, True])
def test_causal_json_is_strict_and_validates_against_the_schema(order, extensions):
    r = seed_replay(query_block=2, causal=True, order=order)
    text = to_json(r, extensions=extensions)
    assert "Infinity" not in text and "NaN" not in text
    experiment = json.loads(text)
    validate(experiment)
    assert experiment["cases"][-1]["vectors"][0]["values"][1] is None  # masked score: -inf -> null
    assert ("replay" in experiment) == extensions
    if extensions:
        assert experiment["replay"]["skipped"] == [[0, 1], [0, 2], [1, 2]]
        assert [c["tiles"]["kind"] for c in experiment["cases"]] == ["full", "full", "partial"]


def test_schema_rejects_a_label_with_a_hyphen_instead_of_an_en_dash():
    jsonschema = pytest.importorskip("jsonschema")
    experiment = to_experiment(seed_replay())
    experiment["cases"][0]["label"] = "Query rows 0-1 \u00b7 key columns 0-1"
    with pytest.raises(jsonschema.ValidationError):
        validate(experiment)
    experiment = to_experiment(seed_replay())
    experiment["cases"][0]["vectors"][1]["label"] = "Running maximum"
    with pytest.raises(jsonschema.ValidationError):
        validate(experiment)


@given(replay_cases(), st.sampled_from([None, 0, 2, 4]), st.booleans())
def test_streamed_json_is_json_dumps_of_the_experiment_for_any_replay(case, indent, extensions):
    r = run(case, *make(case))
    expected = json.dumps(to_experiment(r, extensions=extensions), indent=indent, ensure_ascii=False)
    buffer = io.StringIO()
    write_json(r, buffer, extensions=extensions, indent=indent)
    assert buffer.getvalue() == expected == to_json(r, extensions=extensions, indent=indent)


def test_extensions_of_a_long_replay_are_refused_before_anything_is_written():
    q = torch.randn(1, 3000, 4)
    r = replay(q, q, q, block_m=2, block_n=2)
    buffer = io.StringIO()
    with pytest.raises(AttentionValueError, match="extensions=True would list up to"):
        write_json(r, buffer, extensions=True)
    assert buffer.getvalue() == ""
    write_json(r, buffer)  # the seed format alone is written case by case
    assert len(json.loads(buffer.getvalue())["cases"]) == 1500
