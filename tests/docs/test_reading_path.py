"""The README's reading path stays true: each of the five things a learner looks for (the dense oracle, the
online-softmax update, the query-major loop, the backward's recompute, a kernel's inner loop) is one link from
the README to a file under src/flashattn_teach/core/; those files exist, are at most 6 and at most 800 lines in
all, and the line counts the README prints are the files' own."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CORE = "src/flashattn_teach/core/"
MAX_FILES, MAX_LINES = 6, 800
# Each thing, and the words of the README's row that names it.
FIVE_THINGS = {
    "the dense oracle": "dense oracle",
    "the online-softmax update": "the update",
    "the query-major loop": "query-major loop",
    "the backward's recompute": "backward recompute",
    "a kernel's inner loop": "inner loop",
}
# A row of the "Read the code" table: | # | [name](path) | lines | what it holds |
ROW = re.compile(r"^\| *\d+ *\| *\[[^\]]*\]\(([^)]+)\) *\| *(\d+) *\| *(.*?) *\|$")


def reading_table() -> list[tuple[str, int, str]]:
    """(path, the line count printed, what the row says) for each row of the README's "Read the code" table."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Read the code", 1)[1].split("\n## ", 1)[0]
    return [(m.group(1), int(m.group(2)), m.group(3)) for m in map(ROW.match, section.splitlines()) if m]


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_each_of_the_five_things_is_one_link_into_core() -> None:
    rows = reading_table()
    assert rows, "the README has no 'Read the code' table"
    for thing, words in FIVE_THINGS.items():
        links = [path for path, _, what in rows if words in what]
        assert links, f"no row of the README's reading table names {thing} ({words!r})"
        assert all(path.startswith(CORE) for path in links), f"{thing} links outside {CORE}: {links}"


def test_the_core_files_exist_and_fit_the_budget() -> None:
    paths = [path for path, _, _ in reading_table()]
    assert all(path.startswith(CORE) for path in paths), paths
    missing = [path for path in paths if not (ROOT / path).is_file()]
    assert not missing, f"the README links core files that do not exist: {missing}"
    assert len(set(paths)) <= MAX_FILES, paths
    total = sum(line_count(ROOT / path) for path in set(paths))
    assert total <= MAX_LINES, f"the core is {total} lines, over the {MAX_LINES}-line budget"


def test_the_readme_prints_each_files_line_count() -> None:
    wrong = [
        f"{path}: README says {printed}, the file has {line_count(ROOT / path)}"
        for path, printed, _ in reading_table()
        if (ROOT / path).is_file() and line_count(ROOT / path) != printed
    ]
    assert not wrong, "update the README's 'Read the code' table:\n" + "\n".join(wrong)


def test_every_core_module_is_in_the_reading_table() -> None:
    listed = {path for path, _, _ in reading_table()}
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / CORE).glob("*.py")}
    assert on_disk <= listed, f"core files the README does not list: {sorted(on_disk - listed)}"


def test_the_table_parser_sees_a_wrong_count() -> None:
    # The negative control: a row whose count is off by one is read as that number, so the check above fails.
    row = "| 2 | [core/dense.py](src/flashattn_teach/core/dense.py) | 41 | the dense oracle |"
    match = ROW.match(row)
    assert match and match.group(1) == "src/flashattn_teach/core/dense.py" and int(match.group(2)) == 41
