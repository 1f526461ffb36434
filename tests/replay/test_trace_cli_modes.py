"""``flashattn-teach replay forward|backward|decode``: each subcommand takes only its own options, and any
other one is an argparse error (exit 2) naming the option, at any value; the options come from the parsers'
own lists, so an option added later is checked here too (and must be given a value below). The old
spelling (``replay --backward ...``) runs the same replay with a ``DeprecationWarning`` naming the new one.
``--backward --query-block`` used to be accepted and ignored with table, json and png."""

from __future__ import annotations

import warnings

import pytest

from flashattn_teach.replay.cli import SCENARIOS, options_of, refusal
from flashattn_teach.replay.cli_common import FORMATS

from replay_cli import main

# a value each option's parser takes (not necessarily one that fits the others: only the refusal is judged)
VALUES = {
    "--seed": ["1"],
    "--batch": ["2"],
    "--batch-index": ["1"],
    "--seq-len": ["4"],
    "--head-dim": ["8"],
    "--dtype": ["float32"],
    "--block-m": ["1"],
    "--block-n": ["1"],
    "--query-block": ["1"],
    "--causal": [],
    "--causal-align": ["bottom_right"],
    "--scale": ["0.5"],
    "--order": ["query_major"],
    "--source": ["reference"],
    "--kernel": ["core"],
    "--deterministic": [],
    "--window": ["1,1"],
    "--softcap": ["2"],
    "--alibi": ["0.5"],
    "--seqlens-k": ["3"],
    "--cu-seqlens": ["0,2,6"],
    "--sinks": ["0.5"],
    "--pad-left": ["1"],
    "--mask": ["mask.pt"],
    "--extensions": [],
    "--step": ["1"],
    "--cache-len": ["3"],
    "--new-kv": ["1"],
    "--new-queries": ["2"],
    "--num-splits": ["2"],
    "--cache-size": ["9"],
    "--merge-order": ["1,0"],
}


def own(scenario: str) -> set[str]:
    """The long options of ``replay scenario`` but --help, --format and --out (the axes)."""
    return {o for o in options_of(scenario) if o.startswith("--") and o not in ("--help", "--format", "--out")} - {
        "--no-causal"
    }


def test_every_option_of_every_subcommand_has_a_value_here() -> None:
    assert set().union(*(own(s) for s in SCENARIOS)) == set(VALUES)


CASES = [(s, o) for s in SCENARIOS for o in sorted(set(VALUES) - own(s))]


@pytest.mark.parametrize(("scenario", "option"), CASES)
def test_each_subcommand_refuses_by_name_every_option_it_does_not_take(scenario, option, capsys):
    with pytest.raises(SystemExit) as exit_status:
        main([scenario, option, *VALUES[option]])
    assert exit_status.value.code == 2
    err = capsys.readouterr().err
    assert f"replay {scenario}: error: argument {option}: not an option of `replay {scenario}`" in err, err


def test_backward_query_block_is_an_argparse_error_naming_it(capsys, tmp_path):
    out = tmp_path / "b.json"
    for fmt in FORMATS:
        with pytest.raises(SystemExit):
            main(["backward", "--query-block", "1", "--format", fmt, "--out", str(out)])
        assert "argument --query-block: not an option of `replay backward`" in capsys.readouterr().err
        assert not out.exists()
    assert main(["backward", "--format", "json", "--out", str(out)]) == 0  # the control: without it, it runs


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["forward", "--step", "1"], "argument --step: draws one step of --format png, not --format table"),
        (["backward", "--format", "json", "--step", "1"], "argument --step: draws one step of --format png"),
        (["forward", "--extensions", "--format", "html"], "argument --extensions: adds to --format json"),
        (["forward", "--format", "png"], "argument --format: png needs --out FILE"),
        (["decode", "--format", "png"], "argument --format: png needs --out FILE"),
    ],
)
def test_options_that_belong_to_one_format_are_refused_with_the_others(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (["--seq-len", "4", "--format", "json"], ["forward", "--seq-len", "4", "--format", "json"]),
        (["--seq-len", "4", "--backward", "--format", "json"], ["backward", "--seq-len", "4", "--format", "json"]),
        (["--decode", "--cache-len", "3", "--format", "json"], ["decode", "--cache-len", "3", "--format", "json"]),
    ],
)
def test_the_old_spelling_warns_naming_the_subcommand_and_runs_it(old, new, capsys):
    with pytest.warns(DeprecationWarning, match=f"use `flashattn-teach replay {new[0]} ...`"):
        assert main(old) == 0
    was = capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new spelling does not warn
        assert main(new) == 0
    assert capsys.readouterr().out == was and was.startswith("{")


def test_both_old_selectors_together_are_refused_naming_the_second(capsys):
    with pytest.warns(DeprecationWarning), pytest.raises(SystemExit):
        main(["--backward", "--decode"])
    assert "argument --decode: the old spelling of `replay decode`" in capsys.readouterr().err


def test_an_unknown_option_is_still_argparses_own_error():
    assert refusal("forward", ["--bogus"]) == "unrecognized arguments: --bogus"
