"""The Triton translation of a user's functions never writes or reads generated code in a shared folder.

On a machine with several users, ``<temp dir>/flashattn_teach_usermod/`` may already exist, created by
another user with mode 0o777, holding files named as the translator would name them (a hash of the
source, predictable for common functions). A call must neither import such a file nor write there; the
generated module is compiled from memory, and triton still reads its source (``inspect.getsource``).
"""

from __future__ import annotations

import builtins
import hashlib
import inspect
import linecache
import os
import sys
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402

import flashattn_teach as fa  # noqa: E402
from flashattn_teach.triton.usermod import compile_mask_mod, generated_source  # noqa: E402

PLANTED = "_flashattn_teach_planted_module_ran"


def _window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 37)


def _bias(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) * 0.0371


def _snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file and folder under ``root``: mode, modification time, content."""
    out = {}
    for path in sorted(root.rglob("*")):
        stat, content = path.stat(), path.read_bytes() if path.is_file() else b""
        out[str(path.relative_to(root))] = (stat.st_mode, stat.st_mtime_ns, content)
    return out


def _module_name(source: str) -> str:
    return f"flashattn_teach_usermod_{hashlib.sha256(source.encode()).hexdigest()[:20]}"


@pytest.fixture
def shared_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp dir whose ``flashattn_teach_usermod/`` another user made first: world-writable, holding a
    file named as each of this test's functions would be, which sets a flag and raises if imported."""
    root = tmp_path / "shared-tmp"
    folder = root / "flashattn_teach_usermod"
    folder.mkdir(parents=True)
    os.chmod(folder, 0o777)
    for source in (generated_source(_window, (), "mask_mod"), generated_source(_bias, (), "score_mod")):
        name = _module_name(source)
        monkeypatch.delitem(sys.modules, name, raising=False)  # loaded by an earlier test: load it again
        (folder / f"{name}.py").write_text(f"import builtins\nbuiltins.{PLANTED} = True\nraise SystemExit(3)\n")
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    monkeypatch.delattr(builtins, PLANTED, raising=False)
    return root


def test_a_translated_call_neither_imports_nor_writes_the_shared_folder(shared_temp: Path) -> None:
    before = _snapshot(shared_temp)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 70, 16, generator=g) for _ in range(3))

    got = fa.flash_attention(q, k, v, mask_mod=_window, score_mod=_bias, backend="triton")

    assert not hasattr(builtins, PLANTED), "a file from the shared folder was imported"
    assert _snapshot(shared_temp) == before, "the call wrote to the shared temp dir"
    want = fa.flash_attention(q.double(), k.double(), v.double(), mask_mod=_window, score_mod=_bias, backend="dense")
    assert (got - want).abs().max().item() < 1e-5


def test_a_file_identical_to_the_source_in_the_shared_folder_is_not_read(shared_temp: Path) -> None:
    source = generated_source(_window, (), "mask_mod")
    planted = shared_temp / "flashattn_teach_usermod" / f"{_module_name(source)}.py"
    planted.write_text(source)  # what another user can swap for other code at any moment
    before = _snapshot(shared_temp)

    compiled = compile_mask_mod(_window, ())

    function = getattr(compiled.jit, "fn", compiled.jit)
    where = function.__code__.co_filename
    assert not where.startswith(str(shared_temp)) and not os.path.exists(where), where
    assert inspect.getsource(function) in compiled.source  # what triton.jit reads, from memory
    assert _snapshot(shared_temp) == before


def test_the_source_survives_linecache_being_cleared_before_a_first_launch() -> None:
    def stripes(b, h, q_idx, kv_idx):  # a source no other test loads: its first launch is here
        return (q_idx + 3 * kv_idx) % 5 != 1

    compile_mask_mod(stripes, ())
    linecache.clearcache()  # torch's inductor does this; the interpreter reads the source at first launch
    compiled = compile_mask_mod(stripes, ())
    assert inspect.getsource(getattr(compiled.jit, "fn", compiled.jit)) in compiled.source
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 40, 16, generator=g) for _ in range(3))
    got = fa.flash_attention(q, k, v, mask_mod=stripes, backend="triton")
    want = fa.flash_attention(q.double(), k.double(), v.double(), mask_mod=stripes, backend="dense")
    assert (got - want).abs().max().item() < 1e-5
