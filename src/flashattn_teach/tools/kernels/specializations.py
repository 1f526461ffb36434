"""``flashattn-teach kernels --specializations``: every kernel specialisation the GPU tests and the GPU suite
would launch (:mod:`.cases`, captured by :mod:`.capture_calls`), compiled ahead of time for each ``--arch``
with the installed triton, one row each:

    kernel, dtype, D, tile, warps, stages   what the JIT builds (D: the HEAD_DIM constant)
    constants                               the constexprs (and integers the JIT made constants, N_q = 1)
                                            whose values differ between this kernel's specialisations
    regs, spills, loop ldl/stl              registers; stack plus local bytes per thread; local loads and
                                            stores per iteration of the steady-state loop (:mod:`.loops`)
    smem                                    shared memory per program, against the per-block opt-in maximum
                                            (232,448 B on sm_90, 166,912 B on sm_80: CUDA's 227 and 163 KB)
    check                                   ok, spills, smem over the limit, or the compile failure's last line

Identical specialisations (kernel, signature, constants, attributes, launch options) compile once. Each
result is cached as a JSON file per (triton version, arch, kernel source, specialisation) under ``--cache``,
so a rerun compiles only what changed; a compile that killed the process is recorded as such on the rerun.
``--json FILE`` writes every row; ``--check FILE`` only captures and exits 1 if a captured specialisation
is missing from FILE (a committed JSON of the same triton version).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .capture_calls import Captured, capture_calls
from .cases import suite_calls
from .compile import SMEM_LIMIT as SMEM_OPT_IN

KERNEL_NAMES = {
    "attn_fwd": "forward",
    "attn_bwd_preprocess": "backward_preprocess",
    "attn_bwd_dkdv": "backward_dkdv",
    "attn_bwd_dq": "backward_dq",
}
_SHOWN = ("HEAD_DIM", "BLOCK_M", "BLOCK_N")  # columns of their own


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flashattn_teach" / "specializations"


def kernel_label(c: Captured) -> str:
    """``forward``, ``backward_dkdv``, ``backward_fused`` (the dK/dV kernel adding dQ by atomics), ..."""
    name = KERNEL_NAMES.get(c.request.name, c.request.name)
    return "backward_fused" if name == "backward_dkdv" and c.request.constants().get("DQ_ATOMIC") else name


# The trace build's switches when it is off (issue 39): not part of what names a specialisation, since with them off
# every kernel compiles to the SASS it had before they existed (tests/triton/test_triton_trace*_sass.py).
TRACE_OFF = {"TRACE": False, "trace": None, "Trace": None}  # forward: trace; decode: Trace (backward: a None field)


def specialisation_id(c: Captured) -> str:
    """What names a specialisation across kernel edits (no source hash): kernel, signature, constants (but the
    trace build's switches when off, :data:`TRACE_OFF`), divisibility attributes, warps and stages, hashed (the
    committed JSON's ``id``)."""
    r = c.request
    constants = {k: v for k, v in r.constants().items() if k not in TRACE_OFF or v != TRACE_OFF[k]}
    consts = ",".join(f"{k}={v!r}" for k, v in sorted(constants.items()))
    sig = ",".join(f"{k}:{v}" for k, v in r.flat_signature().items() if v != "constexpr")
    div = ",".join(sorted(r.divisible_by_16()))
    return short_id(f"{r.name}|{sig}|{consts}|div16:{div}|w{r.options.num_warps}s{r.options.num_stages}")


def short_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _last_line(e: BaseException) -> str:
    """The exception's last line that says something (not ptxas's repro command or its empty stderr)."""
    skip = ("Repro command", "`ptxas` stderr:")
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.strip().startswith(skip)]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]


def compile_one(c: Captured, arch: str) -> dict[str, Any]:
    """Compile one specialisation; its resources, or the failure's last line."""
    from .compile import _resource
    from .loops import profile_sass
    from .sass import disassemble

    t0 = time.perf_counter()
    out: dict[str, Any] = {"registers": None, "spill_bytes": None, "smem_bytes": None, "loop_local": None}
    out["loop_instructions"] = None  # per warp and iteration of the steady-state loop
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # triton prints a failed build's whole PTX
            compiled = c.request.compile()
        text, res = disassemble(compiled.asm["cubin"])
    except Exception as e:  # a ptxas crash, an MLIR pass failure: the row says which
        return {**out, "error": _last_line(e), "seconds": round(time.perf_counter() - t0, 1)}
    local = _resource(res, "LOCAL") + _resource(res, "STACK")
    if local == 0 and re.search(r"\b(STL|LDL)\b", text):
        local = -1  # local-memory traffic of unknown size
    try:
        profile = profile_sass(text, c.request.options.num_warps, arch, kernel=kernel_label(c))
        if profile is not None:
            out["loop_local"], out["loop_instructions"] = profile.counts["local"], profile.instructions
    except Exception as e:  # the loop reader's failure is not the compiler's
        out["loop_error"] = _last_line(e)
    return {
        **out,
        "registers": _resource(res, "REG"),
        "spill_bytes": local,
        "smem_bytes": max(_resource(res, "SHARED"), compiled.metadata.shared),
        "launched_warps": compiled.metadata.num_warps,
        "error": None,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def cached_compile(c: Captured, arch: str, cache: Path) -> dict[str, Any]:
    """:func:`compile_one` through the cache; a compile that never finished (the process died in it) is
    recorded as a failure rather than retried."""
    path = cache / _triton_version() / arch / f"{c.key}.json"
    if path.exists():
        found = json.loads(path.read_text())
        if found.get("pending"):
            empty = {"registers": None, "spill_bytes": None, "smem_bytes": None, "loop_local": None}
            found = {**empty, **found, "pending": False, "error": "the compiling process died (no exception)"}
            path.write_text(json.dumps(found))
        return dict(found)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pending": True}))
    result = compile_one(c, arch)
    path.write_text(json.dumps(result))
    return result


def row(c: Captured, arch: str, result: dict[str, Any]) -> dict[str, Any]:
    r = c.request
    consts = r.constants()
    pointer = next((v for v in r.flat_signature().values() if v.startswith("*")), "?")
    problems = []
    if result.get("error"):
        problems.append(str(result["error"]))
    spills = result.get("spill_bytes")
    if spills:
        where = "in the loop" if result.get("loop_local") else "outside the loop"
        problems.append(f"spills {spills} B {where}")
    smem = result.get("smem_bytes")
    if smem is not None and smem > SMEM_OPT_IN[arch]:
        problems.append(f"smem {smem} > {SMEM_OPT_IN[arch]}")
    return {
        "id": specialisation_id(c),
        "kernel": kernel_label(c),
        "arch": arch,
        "dtype": pointer.removeprefix("*"),
        "head_dim": consts.get("HEAD_DIM", consts.get("HEAD_DIM_V")),
        "BLOCK_M": consts.get("BLOCK_M"),
        "BLOCK_N": consts.get("BLOCK_N"),
        "num_warps": r.options.num_warps,
        "num_stages": r.options.num_stages,
        "constants": {k: repr(v) for k, v in sorted(consts.items())},
        **{k: v for k, v in result.items() if k != "pending"},
        "check": "; ".join(problems) or "ok",
        "calls": c.calls,
    }


def _differing(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Per kernel, the constants whose values differ between its rows (the specialising ones)."""
    values: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    names: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        names[r["kernel"]] |= set(r["constants"])
    for r in rows:
        for n in names[r["kernel"]]:
            values[r["kernel"]][n].add(r["constants"].get(n, "-"))
    return {k: sorted(n for n, vs in v.items() if len(vs) > 1 and n not in _SHOWN) for k, v in values.items()}


def format_table(rows: list[dict[str, Any]], header: str) -> str:
    differing = _differing(rows)
    lines = [header, ""]
    cols = f"{'kernel':<19} {'arch':<4} {'dtype':<4} {'D':>3} {'tile':>7} {'w':>2} {'s':>1} {'regs':>4} "
    cols += f"{'spill':>5} {'ldl/stl':>7} {'smem':>6}  {'check':<28} constants; calls"
    lines.append(cols)
    for r in rows:
        consts = " ".join(f"{n}={r['constants'].get(n, '-')}" for n in differing[r["kernel"]])
        calls = r["calls"][0] + (f" (+{len(r['calls']) - 1})" if len(r["calls"]) > 1 else "")
        lines.append(
            f"{r['kernel']:<19} {r['arch']:<4} {r['dtype']:<4} {r['head_dim']!s:>3} "
            f"{r['BLOCK_M']!s:>3}x{r['BLOCK_N']!s:<3} {r['num_warps']:>2} {r['num_stages']:>1} "
            f"{r['registers']!s:>4} {r['spill_bytes']!s:>5} {r['loop_local']!s:>7} {r['smem_bytes']!s:>6}  "
            f"{r['check']:<28} {consts}; {calls}"
        )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]], refused: dict[str, dict[str, str]]) -> list[str]:
    out = []
    for arch in dict.fromkeys(r["arch"] for r in rows):
        mine = [r for r in rows if r["arch"] == arch]
        failed = sum(bool(r.get("error")) for r in mine)
        spills = [r for r in mine if r.get("spill_bytes")]
        in_loop = sum(bool(r.get("loop_local")) for r in spills)
        out.append(
            f"# {arch}: {len(mine)} specialisations, {failed} compile failures, {len(spills)} spill "
            f"({in_loop} in the steady-state loop), {len(refused.get(arch, {}))} calls refused by the library"
        )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--specializations",
        action="store_true",
        help="capture every kernel specialisation the GPU tests and suite launch and compile each (see --json)",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="--specializations: write rows here")
    parser.add_argument(
        "--check", type=Path, default=None, metavar="FILE", help="--specializations: capture only; all in FILE?"
    )
    parser.add_argument(
        "--calls", nargs="+", default=None, metavar="NAME", help="--specializations: only calls naming one of these"
    )
    parser.add_argument("--cache", type=Path, default=None, metavar="DIR", help="--specializations: result cache")


def run(args: argparse.Namespace) -> int:
    """Capture, compile (or ``--check``), print; exit 1 on a compile failure or a spill in a loop."""
    calls = [c for c in suite_calls() if not args.calls or any(s in c.name for s in args.calls)]
    os.environ.pop("TRITON_INTERPRET", None)
    captured = {arch: capture_calls(calls, arch) for arch in args.arch}
    if args.check is not None:
        return check(args.check, captured)
    cache = args.cache or default_cache()
    rows = []
    for arch, (found, _) in captured.items():
        for c in found:
            if args.kernel and kernel_label(c) not in args.kernel:
                continue
            rows.append(row(c, arch, cached_compile(c, arch, cache)))
            print(f"  compiled {len(rows)}: {rows[-1]['kernel']} {arch} {rows[-1]['check']}", file=sys.stderr)
    refused = {arch: r for arch, (_, r) in captured.items()}
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (
        f"# flashattn-teach kernels --specializations: triton {_triton_version()}, {when}, arch "
        f"{' '.join(args.arch)}; {len(calls)} calls of the GPU tests and suite (tools/kernels/cases.py)\n"
        + "\n".join(summary(rows, refused))
    )
    print(format_table(rows, header))
    for arch, r in refused.items():
        for name, why in r.items():
            print(f"# refused on {arch}: {name}: {why[:200]}")
    if args.json is not None:
        doc = {"triton": _triton_version(), "date": when, "arch": args.arch, "calls": len(calls)}
        args.json.write_text(to_json({**doc, "refused": refused}, rows))
    return 1 if any(r.get("error") or r.get("loop_local") for r in rows) else 0


def to_json(doc: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """``doc`` with its ``rows``, one row a line (a rerun's diff shows the specialisations that changed)."""
    head = json.dumps({**doc, "rows": []})[: -len("[]}")]
    return head + "[\n" + ",\n".join(json.dumps(r, sort_keys=True) for r in rows) + "\n]}\n"


def check(path: Path, captured: dict[str, tuple[list[Captured], dict[str, str]]]) -> int:
    """Exit 1 (naming them) if a captured specialisation is missing from the committed JSON at ``path``."""
    known = {(r["arch"], r["id"]) for r in json.loads(path.read_text())["rows"]}
    missing = [(a, c) for a, (found, _) in captured.items() for c in found if (a, specialisation_id(c)) not in known]
    for arch, c in missing:
        print(f"not in {path}: {arch} {kernel_label(c)} of {', '.join(c.calls)}")
    total = sum(len(f) for f, _ in captured.values())
    print(f"{total - len(missing)} of {total} captured specialisations are in {path}")
    return 1 if missing else 0
