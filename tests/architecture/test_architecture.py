"""The package's layering, checked on the import graph ``import_graph.py`` reads from the source. The checks:

    no import cycle among the package's modules
    no private name (``_x``, not ``__x__``) imported from a module in another package directory
    at most MAX_TOP_MODULES modules directly in ``src/flashattn_teach/``
    the kernel package never imports api, ops or dispatch; dispatch, serving and ops never import api
    no source file over MAX_LINES lines

(``test_architecture_doc.py`` checks the picture in docs/architecture.md against the same graph.) Each check
has a negative control: the same probe run on a small synthetic graph or module text that holds the thing,
so a pass means the probe looked and found nothing, not that it could not see.
"""

from __future__ import annotations

from pathlib import Path

from import_graph import EDGES, GRAPH, MODULES, PACKAGE, SRC, Edge, Module, graph, import_edges, synthetic

MAX_TOP_MODULES = 16
MAX_LINES = 420
KERNEL_PACKAGE = f"{PACKAGE}.triton"
# importer prefix -> the prefixes it must never import
FORBIDDEN = {
    KERNEL_PACKAGE: (f"{PACKAGE}.api", f"{PACKAGE}.ops", f"{PACKAGE}.dispatch"),
    f"{PACKAGE}.dispatch": (f"{PACKAGE}.api",),
    f"{PACKAGE}.serving": (f"{PACKAGE}.api",),
    f"{PACKAGE}.ops": (f"{PACKAGE}.api",),
}


# ----------------------------------------------------------------------------------------------- the probes


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with a cycle (Tarjan), each as one cycle through all its modules'
    component, in import order: ``[a, b, c]`` means a imports b imports c imports a."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # recursion depth is bounded by the module count (~120)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in g.get(v, ()):
                components.append(sorted(component))

    for v in sorted(set(g) | {w for ws in g.values() for w in ws}):
        if v not in index:
            strongconnect(v)
    return [_one_cycle(g, set(c)) for c in components]


def _one_cycle(g: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, staying inside the component (BFS)."""
    start = min(component)
    parent: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g.get(v, ()) & component):
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])  # type: ignore[arg-type]
                    return path[::-1]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError("unreachable: a component with a cycle has one through every module")


def private_imports(modules: dict[str, Module], edges: list[Edge]) -> list[str]:
    """``from X import _name`` where X lives in another package directory than the importer."""
    found = []
    for e in edges:
        private = [n for n in e.names if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))]
        if private and modules[e.importer].directory != modules[e.target].directory:
            found.append(f"{e.where(modules)}: {', '.join(private)} from {e.target}")
    return found


def forbidden_imports(edges: list[Edge], modules: dict[str, Module], rules=FORBIDDEN) -> list[str]:
    def under(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    found = []
    for e in edges:
        for importer, banned in rules.items():
            if under(e.importer, importer) and any(under(e.target, b) for b in banned):
                found.append(f"{e.where(modules)}: {e.importer} imports {e.target}")
    return found


def top_level_modules(package_dir: Path) -> list[str]:
    return sorted(p.name for p in package_dir.glob("*.py"))


def long_files(package_dir: Path, limit: int = MAX_LINES) -> list[str]:
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            found.append(f"{path.relative_to(package_dir.parent).as_posix()}: {n} lines")
    return found


def _edge_lines(a: str, b: str) -> str:
    return "; ".join(e.where(MODULES) for e in EDGES if e.importer == a and e.target == b)


# ----------------------------------------------------------------------------------------------- (a) cycles


def test_cycle_finder_control():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"a"}}
    assert cycles(g) == [["a", "b", "c"], ["e"]]
    assert cycles({"a": {"b"}, "b": {"c"}}) == []
    # a TYPE_CHECKING-only import closes a cycle too (the masks/spec <-> masks/tiling shape)
    mods = synthetic(
        {
            "pkg/__init__.py": "",
            "pkg/spec.py": "from .tiling import Tiling\n",
            "pkg/tiling.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .spec import Spec\n",
        }
    )
    assert cycles(graph(import_edges(mods))) == [["pkg.spec", "pkg.tiling"]]


def test_no_import_cycle():
    found = cycles(GRAPH)
    lines = []
    for cycle in found:
        hops = zip(cycle, cycle[1:] + cycle[:1], strict=True)
        lines.append(" -> ".join([*cycle, cycle[0]]))
        lines += [f"    {a} -> {b}: {_edge_lines(a, b)}" for a, b in hops]
    assert not found, "import cycles:\n" + "\n".join(lines)


# ----------------------------------------------------------------------------------------------- (b) private


def test_private_import_finder_control():
    mods = synthetic(
        {
            "pkg/__init__.py": "",
            "pkg/launch.py": (
                "from .kernels.forward import _attn_fwd, LOG2E\nfrom .helpers import _shared\n"
                "from .kernels import __version__\n"
                "def f():\n    from .kernels.backward import _bwd\n"
            ),
            "pkg/helpers.py": "_shared = 1\n",
            "pkg/kernels/__init__.py": "__version__ = '1'\n",
            "pkg/kernels/forward.py": "from ..helpers import _shared\nfrom .backward import _bwd\n",
            "pkg/kernels/backward.py": "",
        }
    )
    assert private_imports(mods, import_edges(mods)) == [
        "pkg/launch.py:1 (top): _attn_fwd from pkg.kernels.forward",
        "pkg/launch.py:5 (lazy): _bwd from pkg.kernels.backward",
        "pkg/kernels/forward.py:1 (top): _shared from pkg.helpers",
    ]


def test_no_private_name_imported_across_package_directories():
    found = private_imports(MODULES, EDGES)
    assert not found, "private names imported from another package directory:\n" + "\n".join(found)


# ----------------------------------------------------------------------------------------------- (c) top level


def test_top_level_count_control(tmp_path):
    for i in range(MAX_TOP_MODULES + 1):
        (tmp_path / f"m{i}.py").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "inner.py").write_text("")  # not directly in the directory: not counted
    assert len(top_level_modules(tmp_path)) == MAX_TOP_MODULES + 1


def test_few_modules_directly_in_the_package():
    found = top_level_modules(SRC / PACKAGE)
    assert len(found) <= MAX_TOP_MODULES, (
        f"{len(found)} modules directly in src/{PACKAGE}/ (at most {MAX_TOP_MODULES}): {', '.join(found)}"
    )


# ----------------------------------------------------------------------------------------------- (d) layers


def test_layer_rule_control():
    mods = synthetic(
        {
            "flashattn_teach/__init__.py": "",
            "flashattn_teach/api/__init__.py": "",
            "flashattn_teach/api/attention.py": "from ..dispatch import run\n",  # allowed: api -> dispatch
            "flashattn_teach/dispatch/__init__.py": "def run(): pass\n",
            "flashattn_teach/dispatch/runner.py": "def f():\n    from ..api.attention import g\n",
            "flashattn_teach/ops/__init__.py": "",
            "flashattn_teach/triton/__init__.py": "",
            "flashattn_teach/triton/kernels/__init__.py": "",
            "flashattn_teach/triton/kernels/forward.py": "from ... import ops\n",
            "flashattn_teach/triton/launch.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flashattn_teach.dispatch import run\n"
            ),
            "flashattn_teach/triton_extra.py": "from .api import attention\n",  # not under triton/
        }
    )
    assert forbidden_imports(import_edges(mods), mods) == [
        "flashattn_teach/dispatch/runner.py:2 (lazy): flashattn_teach.dispatch.runner imports "
        "flashattn_teach.api.attention",
        "flashattn_teach/triton/kernels/forward.py:1 (top): flashattn_teach.triton.kernels.forward imports "
        "flashattn_teach.ops",
        "flashattn_teach/triton/launch.py:3 (TYPE_CHECKING): flashattn_teach.triton.launch imports "
        "flashattn_teach.dispatch",
    ]


def test_layers_import_downward_only():
    found = forbidden_imports(EDGES, MODULES)
    assert not found, "imports against the layering:\n" + "\n".join(found)


# ----------------------------------------------------------------------------------------------- (e) length


def test_long_file_finder_control(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "ok.py").write_text("x = 1\n" * MAX_LINES)
    (pkg / "sub" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_files(pkg) == [f"pkg/sub/long.py: {MAX_LINES + 1} lines"]


def test_no_source_file_over_the_line_limit():
    found = long_files(SRC / PACKAGE)
    assert not found, f"source files over {MAX_LINES} lines:\n" + "\n".join(found)
