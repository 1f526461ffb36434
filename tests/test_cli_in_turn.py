"""tests/cli_in_turn.py: commands run in turn in one process keep their own tables and exit statuses."""

from __future__ import annotations

from cli_in_turn import run_in_turn
from flashattn_teach import __version__
from flashattn_teach.cli import main


def test_each_command_gets_its_own_table_and_status_in_one_process(capsys) -> None:
    commands = {
        "version": ["--version"],
        "refused": ["iomodel", "--no-such-flag"],  # argparse's exit 2, nothing on stdout
        "iomodel": ["iomodel"],
        "version again": ["--version"],
    }
    results = run_in_turn(commands, group=lambda key: "one process")
    assert main(["iomodel"]) == 0
    iomodel = capsys.readouterr().out
    assert results["iomodel"][0] == iomodel and results["iomodel"][2] == 0
    for key in ("version", "version again"):
        assert results[key][0].split() == ["flashattn-teach", __version__] and results[key][2] == 0
    assert results["refused"][0] == "" and results["refused"][2] == 2
    assert "--no-such-flag" in results["refused"][1]  # the process's stderr
