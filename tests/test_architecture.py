"""The package's layering, read from the source with ``ast`` (nothing is imported).

Every import counts: top-level, lazy (inside a function), under ``if TYPE_CHECKING:``, and
``importlib.import_module("...")`` with a constant string. Relative imports are resolved; ``from pkg import
name`` is an import of ``pkg.name`` when that is a module of the package, else of ``pkg``; importing a
package is importing its ``__init__``. The checks:

    no import cycle among the package's modules
    no private name (``_x``, not ``__x__``) imported from a module in another package directory
    at most MAX_TOP_MODULES modules directly in ``src/flashattn_teach/``
    the kernel package never imports api, ops or dispatch; dispatch, decode and ops never import api
    no source file over MAX_LINES lines
    every arrow drawn in docs/architecture.md is an import in the graph

Each check has a negative control: the same probe run on a small synthetic graph or module text that holds
the thing, so a pass means the probe looked and found nothing, not that it could not see.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "flashattn_teach"
DOC = ROOT / "docs" / "architecture.md"
MAX_TOP_MODULES = 16
MAX_LINES = 420
KERNEL_PACKAGE = f"{PACKAGE}.triton"
# importer prefix -> the prefixes it must never import
FORBIDDEN = {
    KERNEL_PACKAGE: (f"{PACKAGE}.api", f"{PACKAGE}.ops", f"{PACKAGE}.dispatch"),
    f"{PACKAGE}.dispatch": (f"{PACKAGE}.api",),
    f"{PACKAGE}.decode": (f"{PACKAGE}.api",),
    f"{PACKAGE}.ops": (f"{PACKAGE}.api",),
}


# ----------------------------------------------------------------------------------------------- the graph


@dataclass(frozen=True)
class Module:
    name: str  # dotted: flashattn_teach.masks.spec; a package is named by its __init__'s dotted name
    path: str  # relative to src/, for messages
    is_package: bool
    text: str

    @property
    def directory(self) -> str:
        """The package directory the file lives in (a package's ``__init__`` lives in its own)."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass(frozen=True)
class Edge:
    importer: str
    target: str  # a module of the package
    names: tuple[str, ...]  # the names taken by ``from target import ...`` (empty otherwise)
    kind: str  # "top", "lazy", "TYPE_CHECKING" or "importlib"
    line: int

    def where(self, modules: dict[str, Module]) -> str:
        return f"{modules[self.importer].path}:{self.line} ({self.kind})"


def read_modules(src: Path = SRC, package: str = PACKAGE) -> dict[str, Module]:
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        rel = path.relative_to(src)
        parts = list(rel.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join(parts)
        modules[name] = Module(name, rel.as_posix(), is_package, path.read_text(encoding="utf-8"))
    return modules


def synthetic(sources: dict[str, str]) -> dict[str, Module]:
    """Modules from texts: ``{"pkg/a/__init__.py": "...", "pkg/a/b.py": "..."}``, for the controls."""
    modules = {}
    for path, text in sources.items():
        parts = path.removesuffix(".py").split("/")
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join(parts)
        modules[name] = Module(name, path, is_package, text)
    return modules


def _resolve_relative(module: Module, level: int, name: str | None) -> str:
    base = module.name if module.is_package else module.name.rpartition(".")[0]
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    return ".".join(part for part in (base, name) if part)


def _known(dotted: str, modules: dict[str, Module]) -> str | None:
    """The module itself, or the longest prefix of it that is a module (``import a.b.Thing`` is not legal,
    but ``import_module`` strings and attribute paths may overshoot)."""
    while dotted:
        if dotted in modules:
            return dotted
        dotted = dotted.rpartition(".")[0]
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    def __init__(self, module: Module, modules: dict[str, Module]):
        self.module, self.modules = module, modules
        self.edges: list[Edge] = []
        self.depth = 0  # functions (and lambdas) around the node
        self.type_checking = 0
        self.dynamic = False  # import_module of a computed name

    def _kind(self) -> str:
        return "TYPE_CHECKING" if self.type_checking else "lazy" if self.depth else "top"

    def _add(self, dotted: str, names: tuple[str, ...], line: int, kind: str | None = None) -> None:
        target = _known(dotted, self.modules)
        if target is not None:
            self.edges.append(Edge(self.module.name, target, names, kind or self._kind(), line))

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self.type_checking += 1
            for child in node.body:
                self.visit(child)
            self.type_checking -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, (), node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve_relative(self.module, node.level, node.module) if node.level else node.module or ""
        plain = []
        for alias in node.names:
            if f"{base}.{alias.name}" in self.modules:  # from pkg import module
                self._add(f"{base}.{alias.name}", (), node.lineno)
            else:
                plain.append(alias.name)
        if plain:
            self._add(base, tuple(plain), node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if called == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            name = node.args[0].value
            if isinstance(name, str):
                if name.startswith("."):  # import_module(".x", package=__package__): relative to this module
                    level = len(name) - len(name.lstrip("."))
                    name = _resolve_relative(self.module, level, name.lstrip(".") or None)
                self._add(name, (), node.lineno, "importlib")
        elif called == "import_module" and node.args:
            self.dynamic = True  # a name computed at run time: see import_edges
        self.generic_visit(node)


def import_edges(modules: dict[str, Module]) -> list[Edge]:
    edges = []
    for module in modules.values():
        visitor = _Imports(module, modules)
        tree = ast.parse(module.text, filename=module.path)
        visitor.visit(tree)
        if visitor.dynamic:  # import_module(name) of a name from a table (cli.py's COMMANDS): every module
            for node in ast.walk(tree):  # the file names as a string is one it may import
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
                    visitor._add(node.value, (), node.lineno, "importlib")
        edges += visitor.edges
    return edges


def graph(edges: list[Edge]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for e in edges:
        out.setdefault(e.importer, set()).add(e.target)
    return out


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


MODULES = read_modules()
EDGES = import_edges(MODULES)
GRAPH = graph(EDGES)


def _edge_lines(a: str, b: str) -> str:
    return "; ".join(e.where(MODULES) for e in EDGES if e.importer == a and e.target == b)


# ----------------------------------------------------------------------------------------------- the parser


def test_parser_sees_every_kind_of_import():
    """The control of the reader itself: each import form in a synthetic package becomes its edge."""
    mods = synthetic(
        {
            "pkg/__init__.py": "from .a import thing\n",
            "pkg/a.py": (
                "import importlib\nfrom typing import TYPE_CHECKING\nfrom . import sub\nfrom .sub import leaf, helper\n"
                "if TYPE_CHECKING:\n    from .sub.leaf import Leaf\n"
                "def f():\n    from . import b\n    return importlib.import_module('pkg.c')\n"
                "thing = 1\n"
            ),
            "pkg/b.py": "import pkg.sub.leaf\n",
            "pkg/c.py": "",
            "pkg/sub/__init__.py": "def helper(): pass\n",
            "pkg/sub/leaf.py": "import os\nclass Leaf: pass\n",
        }
    )
    got = {(e.importer, e.target, e.kind, e.names) for e in import_edges(mods)}
    assert got == {
        ("pkg", "pkg.a", "top", ("thing",)),
        ("pkg.a", "pkg.sub", "top", ()),  # from . import sub: the package, a module
        ("pkg.a", "pkg.sub.leaf", "top", ()),  # from .sub import leaf: a module
        ("pkg.a", "pkg.sub", "top", ("helper",)),  # from .sub import helper: a name, so the package
        ("pkg.a", "pkg.sub.leaf", "TYPE_CHECKING", ("Leaf",)),
        ("pkg.a", "pkg.b", "lazy", ()),
        ("pkg.a", "pkg.c", "importlib", ()),
        ("pkg.b", "pkg.sub.leaf", "top", ()),
    }, got


def test_parser_sees_the_real_trees_lazy_imports():
    """On the real tree: the launcher's kernels are imported lazily; that must be in the graph, or a pass of
    the checks below would mean nothing (TYPE_CHECKING and importlib imports have synthetic controls)."""
    kinds = {(e.importer, e.target): e.kind for e in EDGES}
    assert kinds.get((f"{PACKAGE}.triton.launch", f"{PACKAGE}.triton.kernels.forward")) == "lazy"
    assert kinds.get((f"{PACKAGE}.cli", f"{PACKAGE}.trace.cli")) == "importlib"  # named in cli.COMMANDS
    assert kinds.get((f"{PACKAGE}.api.attention", f"{PACKAGE}._options")) == "top"
    assert len(MODULES) > 50 and len(EDGES) > 200


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


# ----------------------------------------------------------------------------------------------- the picture

# docs/architecture.md draws the layers between LAYERS_BEGIN/END as numbered tiers, ``[3] ops``, top to bottom,
# and lists each arrow between ARROWS_BEGIN/END as ``a -> b, c``, in layer names: a package directory under
# flashattn_teach/ (``api``, ``triton.kernels``) or a top-level module (``_options``). An arrow a -> b says some
# module of a imports some module of b; a module belongs to the deepest named layer above it.
LAYERS_BEGIN, LAYERS_END = "<!-- layers: begin -->", "<!-- layers: end -->"
ARROWS_BEGIN, ARROWS_END = "<!-- arrows: begin -->", "<!-- arrows: end -->"


def _between(text: str, begin: str, end: str) -> str:
    assert begin in text and end in text, f"docs/architecture.md lacks {begin} ... {end}"
    return text.split(begin, 1)[1].split(end, 1)[0]


def layer_of(module: str, layers: set[str]) -> str | None:
    rel = module.removeprefix(PACKAGE).lstrip(".")
    while rel:
        if rel in layers:
            return rel
        rel = rel.rpartition(".")[0]
    return None


def drawn_tiers(text: str) -> dict[str, int]:
    """``{layer: tier}`` from the picture's ``[n] name name ...`` lines (words up to the first double
    space after the names; the rest of a line is commentary)."""
    tiers = {}
    for line in _between(text, LAYERS_BEGIN, LAYERS_END).splitlines():
        m = re.match(r"^\[(\d+)\]\s+(.*)$", line)
        if m:
            names = re.split(r"\s{3,}|\s+\(|\s+\|", m.group(2).strip())[0]
            for name in names.split():
                tiers[name] = int(m.group(1))
    return tiers


def drawn_arrows(text: str) -> list[tuple[str, str]]:
    arrows = []
    for line in _between(text, ARROWS_BEGIN, ARROWS_END).splitlines():
        m = re.match(r"^\s*([\w.]+)\s*->\s*(.+?)\s*$", line)
        if m:
            arrows += [(m.group(1), b.strip()) for b in m.group(2).split(",") if b.strip()]
    return arrows


def layer_edges(layers: set[str], edges: list[Edge]) -> set[tuple[str, str]]:
    pairs = {(layer_of(e.importer, layers), layer_of(e.target, layers)) for e in edges}
    return {(a, b) for a, b in pairs if a is not None and b is not None and a != b}


def picture_errors(text: str, modules: dict[str, Module], edges: list[Edge]) -> list[str]:
    """What the picture gets wrong: unknown layers, arrows with no import, imports with no arrow, arrows
    that do not point down the tiers, layers in the arrow list but not in the picture."""
    tiers, arrows = drawn_tiers(text), drawn_arrows(text)
    layers = set(tiers) | {x for arrow in arrows for x in arrow}
    errors = [f"no such layer: {x}" for x in sorted(layers) if f"{PACKAGE}.{x}" not in modules]
    errors += [f"in the arrows but not in the picture: {x}" for x in sorted(layers - set(tiers))]
    real = layer_edges(layers, edges)
    errors += [f"{a} -> {b}: drawn, but no module of {a} imports {b}" for a, b in arrows if (a, b) not in real]
    errors += [
        f"{a} -> {b}: an import, not drawn ({_lines(edges, modules, a, b, layers)})"
        for a, b in sorted(real - set(arrows))
    ]
    errors += [
        f"{a} -> {b}: points up or sideways (tier {tiers[a]} -> {tiers[b]})"
        for a, b in arrows
        if a in tiers and b in tiers and tiers[a] >= tiers[b]
    ]
    return errors


def _lines(edges: list[Edge], modules: dict[str, Module], a: str, b: str, layers: set[str]) -> str:
    return "; ".join(
        e.where(modules) for e in edges if layer_of(e.importer, layers) == a and layer_of(e.target, layers) == b
    )


def test_picture_checker_control():
    mods = synthetic(
        {
            "flashattn_teach/__init__.py": "",
            "flashattn_teach/api/__init__.py": "",
            "flashattn_teach/api/attention.py": "from ..dispatch.runner import run\nfrom .. import errors\n",
            "flashattn_teach/dispatch/__init__.py": "",
            "flashattn_teach/dispatch/runner.py": "",
            "flashattn_teach/errors.py": "",
        }
    )
    picture = f"{LAYERS_BEGIN}\n[1] dispatch   the route\n   |\n[2] api  errors\n{LAYERS_END}\n"
    arrows = f"{ARROWS_BEGIN}\n    api -> dispatch\n    dispatch -> api, nowhere\n{ARROWS_END}\n"
    assert drawn_tiers(picture) == {"dispatch": 1, "api": 2, "errors": 2}
    assert picture_errors(picture + arrows, mods, import_edges(mods)) == [
        "no such layer: nowhere",
        "in the arrows but not in the picture: nowhere",
        "dispatch -> api: drawn, but no module of dispatch imports api",
        "dispatch -> nowhere: drawn, but no module of dispatch imports nowhere",
        "api -> errors: an import, not drawn (flashattn_teach/api/attention.py:2 (top))",
        "api -> dispatch: points up or sideways (tier 2 -> 1)",
    ]


def test_architecture_doc_picture_matches_the_imports():
    text = DOC.read_text(encoding="utf-8")
    assert len(drawn_arrows(text)) >= 10 and len(drawn_tiers(text)) >= 10, "the doc's picture is missing or empty"
    found = picture_errors(text, MODULES, EDGES)
    assert not found, "docs/architecture.md does not match the source's imports:\n" + "\n".join(found)


@pytest.mark.parametrize("layer", ["api", "ops", "decode", "dispatch", "reference", "triton", "triton.kernels"])
def test_doc_draws_the_main_layers(layer):
    assert layer in drawn_tiers(DOC.read_text(encoding="utf-8")), layer
