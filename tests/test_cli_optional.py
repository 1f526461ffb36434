"""``flashattn-teach`` after ``pip install .`` alone: a command that needs an optional library which is not
installed prints one line on stderr naming it and the extra that brings it, no traceback, exit status 1; and
``kernels --schedule``, a pure simulation, runs without triton.

A missing library is simulated in a fresh interpreter: each ``sys.meta_path`` finder, wrapped before the package
is imported, finds nothing for it (nor its submodules), as for a package that is not installed.
Each such test has its control: the same command with the library present succeeds.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashattn_teach import _optional, cli

# Runs main(argv) with the named top-level libraries made unimportable; argv[1] is a comma-separated list
# ("" blocks nothing), argv[2:] the command line. With --no-require the replay's up-front check is skipped,
# so the import deep in the renderer is what fails (the net in cli.main).
BLOCKED_MAIN = textwrap.dedent(
    """
    import sys

    # one of the interpreter's finders, blind to the blocked packages: `import` then raises ModuleNotFoundError
    # and importlib.util.find_spec returns None, as for a package that is not installed
    class Absent:
        def __init__(self, finder, names):
            self.finder, self.names = finder, names

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in self.names:
                return None
            find = getattr(self.finder, "find_spec", None)
            return None if find is None else find(name, path, target)

        def __getattr__(self, attr):
            return getattr(self.finder, attr)

    blocked = {n for n in sys.argv[1].split(",") if n}
    assert not blocked & set(sys.modules), "already imported: cannot be blocked"
    sys.meta_path[:] = [Absent(finder, blocked) for finder in sys.meta_path]
    argv = sys.argv[2:]
    if argv[0] == "--no-require":
        argv = argv[1:]
        import flashattn_teach.replay.cli_run as replay_cli

        replay_cli.require_format = lambda fmt: None
    from flashattn_teach.cli import main

    raise SystemExit(main(argv))
    """
)

SMALL = ["--seq-len", "4", "--block-m", "2", "--block-n", "2"]


def run_without(blocked: list[str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED_MAIN, ",".join(blocked), *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )


def assert_one_line_naming(result: subprocess.CompletedProcess[str], command: str, library: str, extra: str) -> None:
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"flashattn-teach {command}: "), result.stderr
    assert f"needs {library}, which is not installed" in result.stderr
    assert f'pip install "flashattn-teach[{extra}]"' in result.stderr
    assert result.stdout == ""


def test_the_blocker_blocks():
    """Control for the harness: under the finder the library does not import, and without it it does."""
    for blocked, expect in ((["matplotlib"], "blocked"), ([], "imported")):
        script = BLOCKED_MAIN.split("argv = sys.argv[2:]")[0] + textwrap.dedent(
            """
            import importlib.util
            try:
                import matplotlib.figure
                print("imported")
            except ModuleNotFoundError as e:
                assert importlib.util.find_spec("matplotlib") is None
                print("blocked", e.name)
            """
        )
        out = subprocess.run([sys.executable, "-c", script, ",".join(blocked)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[0] == expect, out.stdout


# the replay's three modes, small (--decode has its own sizes: its defaults)
MODES = [["forward", *SMALL], ["backward", *SMALL], ["decode"]]


@pytest.mark.parametrize("mode", MODES, ids=["forward", "backward", "decode"])
def test_png_without_matplotlib_is_one_line_naming_viz(mode, tmp_path):
    out = tmp_path / "replay.png"
    result = run_without(["matplotlib"], "replay", *mode, "--format", "png", "--out", str(out))
    assert_one_line_naming(result, "replay", "matplotlib", "viz")
    assert "--format png needs matplotlib" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("mode", MODES, ids=["forward", "backward", "decode"])
def test_png_with_matplotlib_is_written(mode, tmp_path):
    """The control: nothing blocked, the same command writes a PNG."""
    out = tmp_path / "replay.png"
    result = run_without([], "replay", *mode, "--format", "png", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("mode", MODES, ids=["forward", "backward", "decode"])
def test_table_without_rich_is_one_line_naming_viz(mode):
    result = run_without(["rich"], "replay", *mode)  # the default format is the table
    assert_one_line_naming(result, "replay", "rich", "viz")
    assert "--format table needs rich" in result.stderr


@pytest.mark.parametrize("fmt", ["json", "html"])
def test_json_and_html_need_neither_rich_nor_matplotlib(fmt, tmp_path):
    out = tmp_path / f"replay.{fmt}"
    result = run_without(
        ["rich", "matplotlib", "triton"], "replay", "forward", *SMALL, "--format", fmt, "--out", str(out)
    )
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 0


def test_an_import_no_check_caught_is_still_one_line(tmp_path):
    """The net in cli.main: with the up-front check skipped, the renderer's own ``import matplotlib`` fails,
    and that is the same one line (naming the command, not the format)."""
    out = tmp_path / "replay.png"
    result = run_without(
        ["matplotlib"], "--no-require", "replay", "forward", *SMALL, "--format", "png", "--out", str(out)
    )
    assert_one_line_naming(result, "replay", "matplotlib", "viz")
    assert not out.exists()


@pytest.mark.parametrize("command", ["kernels", "kernels-decode", "kernels-fp8"])
def test_kernels_without_triton_is_one_line_naming_triton(command):
    result = run_without(["triton"], command)
    assert_one_line_naming(result, command, "triton", "triton")
    assert "the ahead-of-time compile (which needs no GPU) needs triton" in result.stderr


SCHEDULE = ["kernels", "--schedule", "--head-dim", "64", "--seq-len", "1024", "2048"]


def table_rows(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if not line.startswith("#")]


def test_schedule_runs_without_triton_as_with_one_program_per_sm():
    """``kernels --schedule`` without triton: the table, P/SM 1 said in the header, and the same rows as
    ``--programs-per-sm 1`` with triton present (which compiles nothing either)."""
    without = run_without(["triton"], *SCHEDULE)
    assert without.returncode == 0, without.stderr
    assert "Traceback" not in without.stderr
    assert "# P/SM 1 assumed" in without.stdout and 'pip install "flashattn-teach[triton]"' in without.stdout
    rows = table_rows(without.stdout)
    assert rows[0].split()[:2] == ["kernel", "D"]
    assert sorted(r.split()[0] for r in rows[1:]) == sorted(["forward", "dkdv", "dq"] * 2)
    control = run_without([], *SCHEDULE, "--programs-per-sm", "1")
    assert control.returncode == 0, control.stderr
    assert "assumed" not in control.stdout
    assert table_rows(control.stdout) == rows


# ------------------------------------------------------------------------------------- the helper, in process


def test_require_passes_for_an_installed_library_and_names_the_extra_otherwise(monkeypatch):
    _optional.require("rich", "--format table")  # installed here: no error
    monkeypatch.setitem(_optional.EXTRAS, "flashattn_teach_no_such_library", "viz")
    with pytest.raises(_optional.MissingLibrary, match=r"^--format x needs flashattn_teach_no_such_library, which "):
        _optional.require("flashattn_teach_no_such_library", "--format x")
    with pytest.raises(ValueError, match="not an optional library"):
        _optional.require("numpy", "anything")


def test_a_library_that_is_installed_but_breaks_on_import_is_told_apart():
    broken = ModuleNotFoundError("No module named 'triton._C'", name="triton._C")
    assert "which does not import (No module named 'triton._C')" in str(_optional.missing("triton", "x", broken))


def test_cli_main_lets_other_missing_modules_raise(monkeypatch, capsys):
    """Only the optional libraries become one line; any other missing module is a bug and keeps its traceback."""

    def fails(name: str):
        def run(command: str, argv: list[str]) -> int:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        return run

    monkeypatch.setattr(cli, "_run", fails("flashattn_teach_no_such_module"))
    with pytest.raises(ModuleNotFoundError):
        cli.main(["demo"])
    monkeypatch.setattr(cli, "_run", fails("matplotlib"))
    assert cli.main(["demo"]) == cli.EXIT_MISSING_LIBRARY
    err = capsys.readouterr().err
    assert err.startswith("flashattn-teach demo: this command needs matplotlib") and err.count("\n") == 1


def test_pyproject_extras_hold_what_the_messages_name():
    """Each extra a message names installs that library (pyproject.toml's optional dependencies)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    for library, extra in _optional.EXTRAS.items():
        names = [r.split(">")[0].split("=")[0].split(";")[0].strip() for r in project["optional-dependencies"][extra]]
        assert library in names, (library, extra, names)
    assert "rich" in [r.split(">")[0] for r in project["dependencies"]]  # the table works after `pip install .`
