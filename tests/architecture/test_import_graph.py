"""The control of the import reader (``import_graph.py``) itself: each import form in a synthetic package
becomes its edge, and the real tree's lazy and importlib imports are in the graph."""

from __future__ import annotations

from import_graph import EDGES, MODULES, PACKAGE, import_edges, synthetic


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
        ("pkg.a", "pkg", "top", ()),  # ... whose parent's __init__ runs first: pkg too
        ("pkg.a", "pkg.sub.leaf", "top", ()),  # from .sub import leaf: a module (and pkg.sub, listed above)
        ("pkg.a", "pkg.sub", "top", ("helper",)),  # from .sub import helper: a name, so the package
        ("pkg.a", "pkg.sub.leaf", "TYPE_CHECKING", ("Leaf",)),
        ("pkg.a", "pkg.b", "lazy", ()),
        ("pkg.a", "pkg", "lazy", ()),  # from . import b, inside f
        ("pkg.a", "pkg.c", "importlib", ()),
        ("pkg.b", "pkg.sub.leaf", "top", ()),
    }, got


def test_parser_sees_the_real_trees_lazy_imports():
    """On the real tree: the launcher's kernels are imported lazily; that must be in the graph, or a pass of
    the checks below would mean nothing (TYPE_CHECKING and importlib imports have synthetic controls)."""
    kinds = {(e.importer, e.target): e.kind for e in EDGES}
    assert kinds.get((f"{PACKAGE}.triton.launch", f"{PACKAGE}.triton.kernels.forward")) == "lazy"
    assert kinds.get((f"{PACKAGE}.cli", f"{PACKAGE}.replay.cli")) == "importlib"  # named in cli.COMMANDS
    assert kinds.get((f"{PACKAGE}.api.attention", f"{PACKAGE}._options")) == "top"
    assert len(MODULES) > 50 and len(EDGES) > 200
