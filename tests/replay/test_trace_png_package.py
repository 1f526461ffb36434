"""The PNG renderer is one package, ``flashattn_teach.replay.png``: ``render_png`` its one entry point for the
three scenarios, one module per scenario's drawing, and the only place the library draws with matplotlib."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch
from teaching import teaching_inputs

import flashattn_teach
from flashattn_teach.errors import AttentionValueError
from flashattn_teach.replay import replay, replay_decode
from flashattn_teach.replay.backward_replay import backward_of

pytest.importorskip("matplotlib")

PACKAGE = Path(flashattn_teach.__file__).parent
PNG = PACKAGE / "replay" / "png"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def imports_matplotlib(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(name.split(".")[0] == "matplotlib" for name in names):
            return True
    return False


def test_only_the_png_package_draws_with_matplotlib():
    drawing = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if imports_matplotlib(p)}
    assert drawing == {f"replay/png/{name}.py" for name in ("forward", "backward", "decode", "common")}
    # Negative control: the probe sees an import inside a function, as these modules place them.
    assert imports_matplotlib(PNG / "common.py") and not imports_matplotlib(PNG / "__init__.py")


def test_the_old_modules_are_gone():
    for name in ("flashattn_teach.replay.backward_png", "flashattn_teach.replay.png.png"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(name)


def test_render_png_draws_each_scenario_with_its_module(tmp_path, monkeypatch):
    from flashattn_teach.replay import png

    calls = []
    for name in ("render_forward_png", "render_backward_png", "render_decode_png"):
        real = getattr(png, name)

        def spy(r, path, *, _name=name, _real=real, **kw):
            calls.append(_name)
            return _real(r, path, **kw)

        monkeypatch.setattr(png, name, spy)
    q, k, v, dO = teaching_inputs(with_dO=True)
    r = replay(q, k, v, block_m=2, block_n=2)
    g = torch.Generator().manual_seed(1)
    cache = [torch.randn(1, 1, 6, 4, generator=g, dtype=torch.float64) for _ in range(2)]
    new = [torch.randn(1, 1, 1, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    d = replay_decode(new[0], *cache, new[1], new[2], cache_seqlens=4, num_splits=2, block_n=2)
    written = [
        png.render_png(r, tmp_path / "forward.png", step=1, dpi=30),
        png.render_png(backward_of(r, dO=dO), tmp_path / "backward.png", step=1, dpi=30),
        png.render_png(d, tmp_path / "decode.png", dpi=30),
    ]
    assert calls == ["render_forward_png", "render_backward_png", "render_decode_png"]
    assert [p.name for p in written] == ["forward.png", "backward.png", "decode.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in written)
    with pytest.raises(AttentionValueError, match="takes no step="):
        png.render_png(d, tmp_path / "x.png", step=1)
