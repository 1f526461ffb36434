"""The compile tests' disassembly cache (tests/sass_cache.py) never returns another cubin's reading.

- With a stand-in disassembler: one reading per distinct cubin, a changed cubin or changed tools miss, a
  damaged or mismatched entry is read again, ``off`` turns the cache off.
- End to end, ahead of time for sm_90 (a subprocess without ``TRITON_INTERPRET``, started as the compile
  tests start theirs): a kernel that stores a constant, compiled from one source, then from a second source
  that differs only in the constant, then from the first again, with both triton's cache and this one
  shared; each SASS holds its own constant and only that, and the third compile reads the first's entry.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from sass_cache import AOT_PYTHON, aot_env, cache_dir, cached, entry_key


class Counting:
    """A stand-in for ``sass.disassemble``: a reading derived from the bytes, and a count of calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, cubin: bytes) -> tuple[str, str]:
        self.calls += 1
        return f"SASS of {cubin.hex()}", f"REG:{len(cubin)}"


def test_one_reading_per_cubin_and_a_changed_cubin_misses(tmp_path: Path) -> None:
    inner = Counting()
    read = cached(inner, tmp_path, tools="tools-1")
    assert read(b"kernel A") == ("SASS of " + b"kernel A".hex(), "REG:8")
    assert read(b"kernel A") == ("SASS of " + b"kernel A".hex(), "REG:8")
    assert inner.calls == 1
    assert read(b"kernel B!") == ("SASS of " + b"kernel B!".hex(), "REG:9")
    assert inner.calls == 2
    # another process (a new wrapper on the same folder) shares the entries
    again = Counting()
    assert cached(again, tmp_path, tools="tools-1")(b"kernel B!") == ("SASS of " + b"kernel B!".hex(), "REG:9")
    assert again.calls == 0


def test_other_tools_miss(tmp_path: Path) -> None:
    inner = Counting()
    cached(inner, tmp_path, tools="cuda 12.8")(b"kernel")
    cached(inner, tmp_path, tools="cuda 12.9")(b"kernel")
    assert inner.calls == 2
    assert entry_key(b"kernel", "cuda 12.8") != entry_key(b"kernel", "cuda 12.9")


def test_a_damaged_or_mismatched_entry_is_read_again(tmp_path: Path) -> None:
    inner = Counting()
    read = cached(inner, tmp_path, tools="t")
    read(b"kernel A")
    (entry,) = tmp_path.rglob("*.json.gz")
    entry.write_bytes(b"not gzip")
    assert read(b"kernel A") == ("SASS of " + b"kernel A".hex(), "REG:8")
    assert inner.calls == 2
    # an entry that names another cubin (a stale or swapped file under this key) is not trusted
    other = {"cubin_sha256": "0" * 64, "sass": "SASS of another kernel", "res_usage": "REG:1"}
    entry.write_bytes(gzip.compress(json.dumps(other).encode()))
    assert read(b"kernel A") == ("SASS of " + b"kernel A".hex(), "REG:8")
    assert inner.calls == 3


def test_off_and_the_folder(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLASHATTN_TEACH_SASS_CACHE", "off")
    assert cache_dir() is None
    monkeypatch.setenv("FLASHATTN_TEACH_SASS_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("FLASHATTN_TEACH_SASS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "flashattn_teach" / "sass"


KERNEL = """
import triton
from triton import language as tl


@triton.jit
def store_constant(X):
    tl.store(X + tl.arange(0, 16), tl.full([16], CONSTANT, tl.int32))
"""

# Compiles each source in turn for sm_90 and reads it through the installed cache (``python -m sass_cache``)
PROBE = """
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from flashattn_teach.tools.kernels import sass

out = []
for path in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location("store_constant", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    source = triton.compiler.ASTSource(module.store_constant, {"X": "*i32"})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    text, res = sass.disassemble(compiled.asm["cubin"])
    out.append({"sass": text.lower(), "res": res, "cached": hasattr(sass.disassemble, "uncached")})
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_an_edited_kernel_source_reads_its_own_sass(tmp_path: Path) -> None:
    first, second = tmp_path / "a" / "store_constant.py", tmp_path / "b" / "store_constant.py"
    for path, constant in ((first, "0x2B67"), (second, "0x3C81")):
        path.parent.mkdir()
        path.write_text(KERNEL.replace("CONSTANT", constant))
    sass_dir, triton_dir = tmp_path / "sass", tmp_path / "triton"
    env = aot_env(FLASHATTN_TEACH_SASS_CACHE=str(sass_dir), TRITON_CACHE_DIR=str(triton_dir))
    command = [*AOT_PYTHON, "-c", PROBE, str(first), str(second), str(first)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b, a_again = json.loads(done.stdout.splitlines()[-1])
    assert a["cached"] and b["cached"]
    assert "0x2b67" in a["sass"] and "0x3c81" not in a["sass"]
    assert "0x3c81" in b["sass"] and "0x2b67" not in b["sass"]
    assert a_again == a
    assert "REG:" in a["res"]
    assert len(list(sass_dir.rglob("*.json.gz"))) == 2  # the third compile read the first's entry
