"""tests/cli_in_turn.py: commands run in turn in one process keep their own tables and exit statuses; commands
shared among processes run once each."""

from __future__ import annotations

from cli_in_turn import run_in_turn, run_shared
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


def test_shared_commands_run_once_each_in_whichever_process_is_free(capsys) -> None:
    commands = {"iomodel": ["iomodel"], **{f"refused {i}": ["iomodel", f"--no-such-flag-{i}"] for i in range(4)}}
    results = run_shared(commands, processes=3)
    assert main(["iomodel"]) == 0
    assert results["iomodel"] == (capsys.readouterr().out, results["iomodel"][1], 0)
    for i in range(4):
        out, err, code = results[f"refused {i}"]
        assert out == "" and code == 2 and f"--no-such-flag-{i}" in err
        # its stderr is that of the process that ran it, which names it (run_shared raises if two processes did)
        assert f"runs flashattn-teach iomodel --no-such-flag-{i}\n" in err
