"""``flashattn-teach replay backward --source triton --format html``: the Backward view's kernel panel in a real
headless Chromium, at every dK/dV and dQ step of the one-kernel backward, its numbers the JSON's (``--format json``
of the same call), each dQ partial's place among the atomic adds; a page of the reference alone has no such panel."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from test_trace_kernel_page import assert_fits_a_phone, check_terms, read_panel

from flashattn_teach.replay.kernel_trace_backward import NOTE

from replay_cli import main

# 40 queries and keys, D = 16, float32, causal, the kernels' 32 x 16 tiles: T_r = 2, T_c = 3, the one-kernel
# backward (N_q >= its BLOCK_M), so dQ comes by atomic adds and each dQ step has its place among them
ARGS = "backward --dtype float32 --seq-len 40 --head-dim 16 --block-m 32 --block-n 16 --causal --source triton"
READ = read_panel("bwd-kernel", "bwd-kernel-terms", "bwd-counter")


def row_label(step: dict):
    """A term's n-th row as the panel labels it: dV_j and dK_j by key row, the rest by query row."""
    return lambda name, n: f"key {step['cols'][0] + n}" if name in ("dV_j", "dK_j") else f"query {step['rows'][0] + n}"


def test_every_backward_step_shows_the_kernels_numbers_of_the_json(browser, tmp_path, capsys) -> None:
    assert main([*ARGS.split(), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    head, steps = doc["kernel"], doc["steps"]
    assert head["oneKernel"] is True and head["note"] == NOTE
    page_path = tmp_path / "backward.html"
    assert main([*ARGS.split(), "--format", "html", "--out", str(page_path)]) == 0
    browser.open(page_path)
    assert browser.evaluate("document.body.dataset.view") == "backward"
    assert browser.evaluate('document.getElementById("kernel") === null') is True  # the forward: the reference's
    places, differences = [], []
    for n, step in enumerate([*steps, None]):  # the steps, then the result
        if n:
            browser.evaluate('document.getElementById("bwd-next").click()')
        page = browser.evaluate(READ)
        assert page["counter"] == f"Backward step {n + 1} of {len(steps) + 1}"
        if step is None or step["stepKind"] == "preprocess":
            assert page["hidden"] is True
            continue
        assert page["hidden"] is False and page["note"] == NOTE
        assert f"tiles {head['blockM']} × {head['blockN']}" in page["meta"]
        check_terms(page["rows"], step["kernel"]["terms"], row_label(step))
        differences += [float(row["difference"]) for row in page["rows"]]
        if step["stepKind"] == "dq":  # its place among the atomic adds, and the partials of its block before it
            place = step["kernel"]["order"]
            before = [f"j={j}" for i, j, at in head["dqOrder"] if i == step["i"] and at < place]
            (atomics,) = [m for m in page["metas"] if m.startswith("Atomics")]
            assert f"at place {place} of the {len(head['dqOrder'])} atomic adds" in atomics
            assert (f"the partials of {', '.join(before)} and this one" if before else "this partial alone") in atomics
            places.append(place)
        else:
            assert not any(m.startswith("Atomics") for m in page["metas"])
    assert sorted(places) == list(range(len(head["dqOrder"]))) and len(places) > 1
    assert max(differences) > 0  # float32 kernels against a float64 reference: a difference shows as one
    assert_fits_a_phone(browser, page_path, "bwd-kernel", "bwd-next", len(steps) - 1)


def test_the_backward_page_of_the_reference_has_no_kernel_panel(browser, tmp_path) -> None:
    page_path = tmp_path / "reference.html"
    argv = ARGS.replace(" --source triton", "").split()
    assert main([*argv, "--format", "html", "--out", str(page_path)]) == 0
    browser.open(page_path)
    assert browser.evaluate("document.body.dataset.view") == "backward"
    browser.evaluate('document.getElementById("bwd-next").click()')  # the first dK/dV step
    assert browser.evaluate('document.getElementById("bwd-kernel") === null') is True
    assert browser.evaluate('document.querySelector(".kernel-terms") === null') is True
