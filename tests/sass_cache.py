"""A disk cache of ``cuobjdump``'s readings of a cubin, shared by the ahead-of-time compile tests.

Why: with triton's own cache warm, a compile test spends most of its time not compiling but reading the
cubin back (``cuobjdump -sass`` and ``-res-usage``, two programs a kernel, about a second each on a busy
core); the suite reads several hundred cubins. Triton already shares each compiled specialisation among
processes and runs (its cache is keyed by the kernel's source, its options and the target); this shares the
disassembly in the same way.

The key is the cubin's own bytes (SHA-256) and the bytes of the two programs that read it (``cuobjdump`` and
the ``nvdisasm`` it calls): a changed kernel source, option, triton or CUDA tool gives a different key, so an
entry can be missing but never stale. tests/test_sass_cache.py checks both: a second kernel source misses,
and an end-to-end compile of two sources reads each one's own constant back.

Use: the compile tests start their subprocesses as ``[*AOT_PYTHON, "-m", "flashattn_teach.cli", ...]``
(or ``-c CODE`` or ``SCRIPT``) with ``env=aot_env()``: ``python -m sass_cache`` installs the cache in the new
process and runs the rest of the command line as ``python`` would. ``FLASHATTN_TEACH_SASS_CACHE`` names the
folder (default ``~/.cache/flashattn_teach/sass``); ``FLASHATTN_TEACH_SASS_CACHE=off`` turns it off.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib
import json
import os
import pkgutil
import runpy
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The command prefix of a compile subprocess: ``[*AOT_PYTHON, "-m", MODULE, ...]`` (with ``env=aot_env()``)
AOT_PYTHON = [sys.executable, "-m", "sass_cache"]
VERSION = 1  # of the entry format; part of the key

Disassembler = Callable[[bytes], tuple[str, str]]


def aot_env(**extra: str) -> dict[str, str]:
    """This process's environment for an ahead-of-time compile: without ``TRITON_INTERPRET`` (which decides at
    import whether triton compiles) and with tests/ first on ``PYTHONPATH`` (for ``-m sass_cache``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def cache_dir() -> Path | None:
    """The cache's folder, or None when ``FLASHATTN_TEACH_SASS_CACHE=off``."""
    chosen = os.environ.get("FLASHATTN_TEACH_SASS_CACHE", "")
    if chosen.lower() == "off":
        return None
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flashattn_teach" / "sass"


@functools.cache
def tools_digest(*tools: str) -> str:
    """SHA-256 over the bytes of the programs that read the cubin (a different CUDA build, a different key)."""
    h = hashlib.sha256()
    for tool in tools:
        path = Path(tool)
        h.update(path.name.encode() + b"\0")
        h.update(path.read_bytes() if path.exists() else b"missing")
    return h.hexdigest()


def entry_key(cubin: bytes, tools: str) -> str:
    """The key of one cubin's reading: its bytes, the tools' digest and the entry format."""
    return hashlib.sha256(b"%d\0%s\0" % (VERSION, tools.encode()) + cubin).hexdigest()


def cached(disassemble: Disassembler, folder: Path, tools: str) -> Disassembler:
    """``disassemble`` with its results kept in ``folder`` by :func:`entry_key`. A missing or unreadable
    entry is recomputed and written anew (atomically, so that concurrent compile processes may share it)."""

    @functools.wraps(disassemble)
    def read(cubin: bytes) -> tuple[str, str]:
        key = entry_key(cubin, tools)
        path = folder / key[:2] / f"{key}.json.gz"
        try:
            entry = json.loads(gzip.decompress(path.read_bytes()))
            if entry["cubin_sha256"] == hashlib.sha256(cubin).hexdigest():
                return entry["sass"], entry["res_usage"]
        except (OSError, ValueError, KeyError, EOFError):
            pass
        text, res = disassemble(cubin)
        entry = {"cubin_sha256": hashlib.sha256(cubin).hexdigest(), "sass": text, "res_usage": res}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(gzip.compress(json.dumps(entry).encode(), compresslevel=3))
        os.replace(tmp, path)
        return text, res

    read.uncached = disassemble  # type: ignore[attr-defined]
    return read


def install() -> bool:
    """Route every ``disassemble`` of ``flashattn_teach.tools.kernels`` through the cache; False when off."""
    folder = cache_dir()
    if folder is None:
        return False
    import flashattn_teach.tools.kernels as kernels
    from flashattn_teach.tools.kernels import sass

    original = getattr(sass.disassemble, "uncached", sass.disassemble)
    cuobjdump = sass.cuobjdump()
    read = cached(original, folder, tools_digest(cuobjdump, str(Path(cuobjdump).with_name("nvdisasm"))))
    # the modules that bound the name at import (``from .sass import disassemble``) are imported and rebound
    for info in pkgutil.iter_modules(kernels.__path__, kernels.__name__ + "."):
        importlib.import_module(info.name)
    for name, module in list(sys.modules.items()):
        if name.startswith("flashattn_teach.") and getattr(module, "disassemble", None) is original:
            module.disassemble = read  # type: ignore[attr-defined]
    sass.disassemble = read
    return True


def main(argv: list[str]) -> None:
    """``python -m sass_cache (-m MODULE | -c CODE | SCRIPT) ARGS...``: install the cache, then run as python."""
    if not argv:
        raise SystemExit("usage: python -m sass_cache (-m MODULE | -c CODE | SCRIPT) [ARGS...]")
    install()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
