"""The package's import graph, read from the source with ``ast`` (nothing is imported), for the checks of
``test_architecture.py`` and ``test_architecture_doc.py``.

Every import counts: top-level, lazy (inside a function), under ``if TYPE_CHECKING:``, and
``importlib.import_module("...")`` with a constant string. Relative imports are resolved; ``from pkg import
name`` is an import of ``pkg.name`` when that is a module of the package (and of ``pkg``, whose ``__init__``
runs first), else of ``pkg``; importing a package is importing its ``__init__``. ``test_import_graph.py``
is the reader's own control.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PACKAGE = "flashattn_teach"


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
        elif base != self.module.name:  # from pkg import module runs pkg's __init__ first: an import of pkg too
            self._add(base, (), node.lineno)

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


# ----------------------------------------------------------------------------------------------- the real tree

MODULES = read_modules()
EDGES = import_edges(MODULES)
GRAPH = graph(EDGES)
