"""Every snippet in README.md and docs/*.md is true as printed.

Each fenced ``python`` block runs as printed, with no preamble (a block imports what it uses), as a script's
``__main__`` in a fresh namespace; one separate interpreter runs them all, so torch is imported once. A block that
cannot run here says so in an HTML comment on the line right before its fence:

    <!-- snippet: skip (the reason) -->    never run; the reason is the skip's
    <!-- snippet: gpu -->                  run only where CUDA is available
    <!-- snippet: needs MODULE -->         run only where MODULE imports (an extra)

Every ``flashattn-teach ...`` command line, in a code block or a code span, names a real subcommand with options
its parser takes (parsed, not run); the cheap ones run. Every ``python FILE``, ``python -m MODULE``, ``bash
FILE`` and ``torchrun ... FILE`` in a code block names a file or module that exists.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from flashattn_teach import cli
from flashattn_teach._cli_types import ArgumentParser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- snippet: (skip|gpu|needs)(?: \(?(.*?)\)?)? -->")
FENCE = re.compile(r"^```(\S*)\s*$")
MAX_NOT_RUN_HERE = 3  # python blocks marked skip or gpu: each is code no test runs on a CPU
PLACEHOLDERS = {"W": "4", "DIR": "dumps"}  # what a command line's placeholders stand for when parsed


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # skip, gpu, needs
    detail: str  # the skip's reason, or the module a block needs

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found, n = [], 0
    while n < len(lines):
        opening = FENCE.match(lines[n])
        if not opening:
            n += 1
            continue
        end = next(e for e in range(n + 1, len(lines)) if lines[e].startswith("```"))
        mark = MARKER.fullmatch(lines[n - 1].strip()) if n else None
        found.append(
            Block(
                path,
                n + 1,
                opening.group(1),
                "\n".join(lines[n + 1 : end]) + "\n",
                mark.group(1) if mark else None,
                (mark.group(2) or "") if mark else "",
            )
        )
        n = end + 1
    return found


BLOCKS = [block for path in DOCS for block in fenced_blocks(path)]
PYTHON = [block for block in BLOCKS if block.lang == "python"]


def _env() -> dict[str, str]:
    """``src`` first on the path, so that a checkout works without an install (an editable install finds the
    same files)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


def _run(argv: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)


def skip_reason(block: Block) -> str | None:
    """Why ``block`` does not run on this machine, from its marker; None when it runs."""
    if block.marker == "skip":
        return f"{block.name}: {block.detail}"
    if block.marker == "gpu" and not torch.cuda.is_available():
        return f"{block.name}: needs a CUDA GPU"
    if block.marker == "needs" and importlib.util.find_spec(block.detail) is None:
        return f"{block.name}: needs {block.detail}"
    return None


# One interpreter runs every block, each in a fresh namespace as a script's ``__main__``, its output captured,
# under an alarm of TIMEOUT_S seconds: one torch import instead of one per block. It writes, per block, "ok"
# or the traceback.
RUNNER = """
import contextlib, io, json, signal, sys, traceback

def alarm(signum, frame):
    raise TimeoutError(f"ran past {sys.argv[2]} s")

signal.signal(signal.SIGALRM, alarm)
results = {}
for name, code in json.load(open(sys.argv[1], encoding="utf-8")):
    out = io.StringIO()
    signal.alarm(int(sys.argv[2]))
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
        results[name] = "ok"
    except BaseException:
        results[name] = traceback.format_exc() + out.getvalue()
    finally:
        signal.alarm(0)
json.dump(results, open(sys.argv[3], "w", encoding="utf-8"))
"""
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def snippet_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("snippets")
    runnable = [(block.name, block.code) for block in PYTHON if skip_reason(block) is None]
    (folder / "blocks.json").write_text(json.dumps(runnable), encoding="utf-8")
    argv = [sys.executable, "-c", RUNNER, "blocks.json", str(TIMEOUT_S), "results.json"]
    proc = _run(argv, folder, timeout=TIMEOUT_S * len(runnable))
    assert proc.returncode == 0, proc.stderr
    results: dict[str, str] = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    return results


@pytest.mark.parametrize("block", PYTHON, ids=[block.name for block in PYTHON])
def test_python_block_runs_as_printed(block: Block, snippet_results: dict[str, str]) -> None:
    reason = skip_reason(block)
    if reason is not None:
        pytest.skip(reason)
    assert snippet_results[block.name] == "ok", (
        f"{block.name} fails as printed:\n{block.code}\n{snippet_results[block.name]}"
    )


def test_the_runner_reports_a_failing_block(tmp_path: Path) -> None:
    # The negative control: a block that raises is reported with its traceback, and the blocks after it still run.
    blocks = [("bad.md:1", "raise ValueError('as printed')\n"), ("good.md:1", "x = 1\n")]
    (tmp_path / "blocks.json").write_text(json.dumps(blocks), encoding="utf-8")
    _run([sys.executable, "-c", RUNNER, "blocks.json", "60", "results.json"], tmp_path)
    results = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert "ValueError: as printed" in results["bad.md:1"] and results["good.md:1"] == "ok"


def test_the_snippets_are_found_and_few_are_left_unrun() -> None:
    # A broken extractor would find nothing and pass every test above: the docs hold at least these many.
    assert len(PYTHON) >= 9, [block.name for block in PYTHON]
    assert any(block.path.name == "README.md" for block in PYTHON)
    not_run = [block.name for block in PYTHON if block.marker in ("skip", "gpu")]
    assert len(not_run) <= MAX_NOT_RUN_HERE, f"too many snippets no CPU test runs: {not_run}"


def test_every_snippet_marker_sits_right_before_a_fence() -> None:
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines):
            if "<!-- snippet" in line:
                assert MARKER.fullmatch(line.strip()), f"{path.name}:{n + 1}: unknown marker {line.strip()!r}"
                assert n + 1 < len(lines) and lines[n + 1].startswith("```python"), (
                    f"{path.name}:{n + 1}: a snippet marker must be the line right before a ```python fence"
                )


# ---- command lines ----------------------------------------------------------------------------------------------


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """The lines of a doc's code: fenced non-python blocks and indented code, with ``\\`` continuations joined."""
    out: list[tuple[int, str]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    in_fence, lang, pending, start = False, "", "", 0
    for n, line in enumerate(lines, 1):
        fence = FENCE.match(line)
        if fence:
            in_fence, lang = (not in_fence), fence.group(1)
            continue
        code = (in_fence and lang != "python") or (not in_fence and line.startswith("    "))
        if not code:
            continue
        text = line.strip()
        if pending:
            text, start = pending + " " + text, start
        else:
            start = n
        if text.endswith("\\"):
            pending = text[:-1].rstrip()
            continue
        pending = ""
        out.append((start, text))
    return out


SPAN = re.compile(r"`(flashattn-teach[^`]*)`")  # a code span may run over a line break in a list item


def command_lines() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        name = path.relative_to(ROOT)
        for n, text in _code_lines(path):
            if text.startswith("flashattn-teach"):
                found.append((f"{name}:{n}", text))
        text = path.read_text(encoding="utf-8")
        for span in SPAN.finditer(text):
            line = text.count("\n", 0, span.start()) + 1
            found.append((f"{name}:{line}", " ".join(span.group(1).split())))
    return found


COMMANDS = command_lines()


def _argv(text: str) -> list[str] | None:
    """The argv a documented command line stands for: comments dropped, ``[--opt]`` optional parts kept,
    placeholders given a value; None for the generic ``flashattn-teach COMMAND --help``."""
    words = shlex.split(text.replace("[", " ").replace("]", " "), comments=True)[1:]
    if "COMMAND" in words:
        return None
    return [PLACEHOLDERS.get(word, word) for word in words]


def parse_command(argv: list[str]) -> None:
    """Parse ``argv`` as ``flashattn-teach`` would, without running the command: a bad command or option fails."""
    if not argv or argv[0].startswith("-"):
        assert argv in ([], ["--version"]), f"unknown top-level options {argv}"
        return
    command, rest = argv[0], argv[1:]
    assert command in cli.COMMANDS, f"flashattn-teach has no command {command!r}: {sorted(cli.COMMANDS)}"
    module = importlib.import_module(cli.COMMANDS[command][0])
    parser = ArgumentParser(prog=f"flashattn-teach {command}")
    module.add_arguments(parser)
    options = parser  # a command with subcommands (replay forward|backward|decode): the options are the subcommand's
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and rest and rest[0] in action.choices:
            options = action.choices[rest[0]]
    for word in rest:
        if word.startswith("--") and word not in ("--help",):
            assert any(word in action.option_strings for action in options._actions), f"unknown option {word}"
    if "--help" in rest:
        return
    try:
        parser.parse_args(rest)
    except SystemExit as exit_:
        pytest.fail(f"flashattn-teach {' '.join(argv)}: the parser refused it (exit {exit_.code})")


@pytest.mark.parametrize("where,text", COMMANDS, ids=[f"{where} {text}" for where, text in COMMANDS])
def test_documented_command_parses(where: str, text: str) -> None:
    argv = _argv(text)
    if argv is None:
        return
    parse_command(argv)


def test_the_command_lines_are_found() -> None:
    texts = {text for _, text in COMMANDS}
    assert {"flashattn-teach demo", "flashattn-teach ladder"} <= texts
    assert any(text.startswith("flashattn-teach replay forward --format html") for text in texts)
    assert len(COMMANDS) >= 20


def test_a_wrong_command_line_is_caught() -> None:
    # The negative controls: the check above fails on a command or an option that does not exist.
    with pytest.raises(AssertionError, match="no command"):
        parse_command(["replays"])
    with pytest.raises(AssertionError, match="unknown option --formats"):
        parse_command(["replay", "forward", "--formats", "json"])
    with pytest.raises(pytest.fail.Exception, match="refused"):
        parse_command(["replay", "forward", "--format", "jpeg"])


FILE_ARG = re.compile(r"^(?:python3?|bash|torchrun)\b(.*)$")


def test_documented_scripts_and_modules_exist() -> None:
    missing = []
    for path in DOCS:
        for n, text in _code_lines(path):
            run = FILE_ARG.match(text)
            if not run:
                continue
            words = shlex.split(run.group(1), comments=True)
            if words[:1] == ["-m"]:
                if importlib.util.find_spec(words[1]) is None:
                    missing.append(f"{path.name}:{n}: module {words[1]}")
                continue
            files = [w for w in words if w.endswith((".py", ".sh"))]
            missing += [f"{path.name}:{n}: {f}" for f in files if not (ROOT / f).is_file()]
    assert not missing, missing


# A path in a code span (`src/...`, `tests/...`, `reference/parallel.py` under the package, ...) or a relative link.
PATH = re.compile(r"`([\w.-]+(?:/[\w.*-]+)+/?)`|\]\(([^)#:]+)(?:#[^)]*)?\)")
FILE_LIKE = re.compile(r"\.(py|sh|md|json|ipynb|png|js|css|csv|toml)$|/$")
# Paths in other projects' repositories, and the untracked folder a benchmark writes to.
NOT_HERE = {
    "test/inductor/test_flex_attention.py",
    "test/inductor/test_flex_decoding.py",
    "tests/test_flash_attn.py",
    "benchmarks/results/local/cpu/",
}


def test_documented_paths_exist() -> None:
    missing = []
    for doc in DOCS:
        for match in PATH.finditer(doc.read_text(encoding="utf-8")):
            code, link = match.groups()
            if (link and link.startswith(("http", "..."))) or code in NOT_HERE:
                continue
            if link:
                candidates = [doc.parent / link]
            elif FILE_LIKE.search(code):
                package = ROOT / "src" / "flashattn_teach"
                candidates = [
                    ROOT / code,
                    ROOT / "src" / code,
                    package / code,
                    package / "triton" / code,
                    doc.parent / code,
                ]
            else:
                continue
            if not any(glob.glob(str(candidate), recursive=True) for candidate in candidates):
                missing.append(f"{doc.name}: {code or link}")
    assert not missing, missing


# The module paths the house's moves renamed (docs/architecture.md lists them): the old ones still import, with a
# DeprecationWarning, so a doc that names one teaches a path that is going away.
MOVED = re.compile(
    r"flashattn_teach[./](trace|online_softmax|iomodel|decode|splitkv)\b|\btrace/|triton[./]inspect|masks[./]scheduler"
    r"|_validate[./](decode|pages|varlen_pages)\b|ops[./]decode|decode_launch|api[./](decode|explain_decode|varlen_pages)\b"
    r"|`(decode|iomodel)/|(?<!core/)\bonline_softmax\.py|python -m flashattn_teach\.tools"
)


def test_no_doc_names_a_moved_module_path() -> None:
    assert MOVED.search("flashattn_teach.trace.replay(q, k, v)") and MOVED.search("`decode/pages.py`")  # control
    assert not MOVED.search("flashattn_teach.replay.replay(q, k, v)") and not MOVED.search("core/online_softmax.py")
    found = [
        f"{doc.name}:{n}: {line.strip()[:100]}"
        for doc in DOCS
        if doc.name != "architecture.md"  # the lead's map of the moves names the old paths on purpose
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
        if MOVED.search(line)
    ]
    assert not found, found


def test_the_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    test_section = readme.split("## Test", 1)[1]
    command = fenced_blocks_text(test_section)[0].strip()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()
    assert ci[-1] == command, f"the README's test command {command!r} is not what .ci/run ends with: {ci[-1]!r}"


def fenced_blocks_text(markdown: str) -> list[str]:
    return re.findall(r"^```\w*\n(.*?)^```", markdown, flags=re.S | re.M)


def test_the_console_script_is_the_cli_parsed_here() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    scripts = pyproject.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert 'flashattn-teach = "flashattn_teach.cli:main"' in scripts


# ---- the cheap commands, run ------------------------------------------------------------------------------------


def _flashattn_teach(*argv: str, cwd: Path) -> str:
    proc = _run([sys.executable, "-m", "flashattn_teach.cli", *argv], cwd)
    assert proc.returncode == 0, f"flashattn-teach {' '.join(argv)}: exit {proc.returncode}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout


def test_demo_runs_and_prints_the_readme_line(tmp_path: Path) -> None:
    out = _flashattn_teach("demo", cwd=tmp_path)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quoted = re.search(r"^max \|dense - tiled\|.*$", readme, flags=re.M)
    assert quoted, "the README quotes the demo's line"
    assert quoted.group(0) in out.splitlines(), f"the demo no longer prints {quoted.group(0)!r}:\n{out}"


def test_ladder_help_runs(tmp_path: Path) -> None:
    assert "ladder" in _flashattn_teach("ladder", "--help", cwd=tmp_path)


def test_replay_writes_json(tmp_path: Path) -> None:
    _flashattn_teach("replay", "forward", "--format", "json", "--out", "replay.json", cwd=tmp_path)
    assert (tmp_path / "replay.json").read_text(encoding="utf-8").lstrip().startswith("{")
