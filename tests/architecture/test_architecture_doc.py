"""docs/architecture.md against the package's imports (``import_graph.py``): every arrow drawn in the doc is
an import in the graph, every import between layers is drawn, and the arrows point down the tiers.

The checker has a negative control: the same probe run on a synthetic package and picture that hold each
kind of error, so a pass means the probe looked and found nothing, not that it could not see.
"""

from __future__ import annotations

import re

import pytest

from import_graph import EDGES, MODULES, PACKAGE, ROOT, Edge, Module, import_edges, synthetic

DOC = ROOT / "docs" / "architecture.md"


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


@pytest.mark.parametrize("layer", ["api", "ops", "serving", "dispatch", "reference", "triton", "triton.kernels"])
def test_doc_draws_the_main_layers(layer):
    assert layer in drawn_tiers(DOC.read_text(encoding="utf-8")), layer
