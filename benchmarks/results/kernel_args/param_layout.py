"""Is a SASS difference the kernel parameters' layout? Swap only the ``.param`` declarations between two PTX files.

    # with main at e1a7f4b (positional) on the path, then with the records; either triton
    PYTHONPATH=BEFORE/src python param_layout.py dump before/ sm90 backward_dkdv first-light-padding-mask-hd64-causal
    PYTHONPATH=$PWD/src   python param_layout.py dump after/  sm90 backward_dkdv first-light-padding-mask-hd64-causal
    python param_layout.py swap before/ after/ sm90 8 backward_dkdv

``dump`` compiles the kernel's specialisation that the named call launches (as ``flashattn-teach kernels
--specializations`` does) and writes its PTX and the names of its runtime parameters in order. ``swap`` writes
two PTX files and runs ptxas on all four as triton does (``-lineinfo``, and ``--regAllocOptLevel=2`` where the
installed triton passes it): the records' PTX body with its parameters declared in the positional kernel's
relative order (its unused placeholders left out), and the positional PTX body with its parameters declared in
the records' order. A PTX body names each parameter, so only the parameter buffer's layout changes; if the
numbers follow the declarations, not the body, the layout is the cause. Registers, stack bytes and the steady
loop's instructions per warp and iteration (:mod:`flashattn_teach.tools.kernels.loops`) are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import subprocess
import tempfile
from pathlib import Path

# a record's field -> the positional kernel's name (the rest follow the patterns in _positional)
RENAMED = {
    "row_stats.lse2": "LSE2",
    "row_stats.delta": "DELTA",
    "row_stats.stride_h": "stride_lse_h",
    "LSE.ptr": "LSE",
    "LSE.stride_h": "stride_lse_h",
    "terms.alibi": "ALIBI_SLOPES",
    "terms.alibi_stride_b": "stride_slope_b",
    "terms.alibi_stride_h": "stride_slope_h",
    "terms.mask": "ATTN_MASK",
    "dropout.offset": "dropout_offset",
    "dropout.threshold": "dropout_threshold",
    "packed.cu_seqlens_q": "CU_SEQLENS_Q",
    "packed.cu_seqlens_k": "CU_SEQLENS_K",
}
ENTRY = re.compile(r"(\.visible \.entry \w+\()(.*?)(\n\))", re.S)


def _positional(name: str) -> str:
    """``Q.stride_h`` -> ``stride_qh``, ``Q.ptr`` -> ``Q``, ``bounds.OFFSET`` -> ``OFFSET``, ...; since round 4
    also ``records.split``'s names, ``ptr.Q`` -> ``Q`` and ``stride.Q.stride_h`` -> ``stride_qh``."""
    if name.startswith("ptr."):
        return name.removeprefix("ptr.")
    name = name.removeprefix("stride.")
    if name in RENAMED:
        return RENAMED[name]
    record, _, field = name.partition(".")
    if not field:
        return name
    if record == "terms" and field.startswith("mask_stride_"):
        return "stride_mask_" + field[-1]
    if field == "ptr":
        return record
    if field.startswith("stride_"):
        return f"stride_{record.lower()}{field[-1]}"
    return field  # bounds.OFFSET, terms.softcap_log2, dropout.seed, ...


def dump(out: Path, arch: str, kernel: str, call: str) -> None:
    from flashattn_teach.tools.kernels.capture_calls import capture_calls
    from flashattn_teach.tools.kernels.cases import suite_calls
    from flashattn_teach.tools.kernels.specializations import kernel_label

    captured, _ = capture_calls([c for c in suite_calls() if c.name == call], arch)
    (c,) = [c for c in captured if kernel_label(c) == kernel]
    r = c.request
    with contextlib.redirect_stdout(io.StringIO()):
        compiled = r.compile()
    signature = r.flat_signature() if hasattr(r, "flat_signature") else r.signature  # records / positional
    constant = {r.path_name(p) if hasattr(r, "path_name") else list(r.signature)[p[0]] for p in r.constexprs}
    names = [n for n, kind in signature.items() if kind != "constexpr" and n not in constant]
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel.ptx").write_text(compiled.asm["ptx"])
    (out / "params.json").write_text(json.dumps(names))


def _declarations(ptx: str) -> tuple[re.Match[str], list[str]]:
    m = ENTRY.search(ptx)
    assert m is not None, "no .entry in the PTX"
    # a TMA descriptor is a .b8 array followed by parameters of its own that no name above stands for
    assert ".b8" not in m.group(2), "a tensor descriptor (TMA) kernel: its parameters do not match the names"
    return m, [d.strip() for d in m.group(2).strip().split(",\n")]


def _redeclare(ptx: str, order: list[int], n_named: int) -> str:
    """``ptx`` with its first ``n_named`` parameters declared in ``order`` (the scratch pointers triton
    appends stay last)."""
    m, decls = _declarations(ptx)
    new = [decls[i] for i in order] + decls[n_named:]
    return ptx[: m.start(2)] + "\n\t" + ",\n\t".join(new) + ptx[m.end(2) :]


def profile(ptx_path: Path, arch: str, warps: int, kernel: str) -> str:
    import triton.backends.nvidia.compiler as nvidia

    from flashattn_teach.tools.kernels.compile import _resource
    from flashattn_teach.tools.kernels.loops import profile_sass
    from flashattn_teach.tools.kernels.sass import disassemble

    extra = ["--regAllocOptLevel=2"] if "regAllocOptLevel" in Path(nvidia.__file__).read_text() else []
    gpu = "sm_90a" if arch == "sm90" else "sm_80"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        ptxas = nvidia.get_ptxas(int(arch[2:])).path
        subprocess.run(
            [ptxas, "-lineinfo", "-v", *extra, f"--gpu-name={gpu}", str(ptx_path), "-o", str(cubin)],
            check=True,
            capture_output=True,
        )
        text, res = disassemble(cubin.read_bytes())
    loop = profile_sass(text, warps, arch, kernel=kernel)
    stack = _resource(res, "STACK") + _resource(res, "LOCAL")
    return f"{_resource(res, 'REG')} registers, {stack} B stack, loop {loop.instructions if loop else None}"


def swap(before: Path, after: Path, arch: str, warps: int, kernel: str) -> None:
    b_names = json.loads((before / "params.json").read_text())
    a_names = [_positional(n) for n in json.loads((after / "params.json").read_text())]
    missing = sorted(set(a_names) - set(b_names))
    assert not missing, f"no positional parameter for {missing}: add them to RENAMED"
    b_ptx, a_ptx = (before / "kernel.ptx").read_text(), (after / "kernel.ptx").read_text()
    a_index = {n: i for i, n in enumerate(a_names)}
    b_index = {n: i for i, n in enumerate(b_names)}
    (after / "in-before-order.ptx").write_text(
        _redeclare(a_ptx, [a_index[n] for n in b_names if n in a_index], len(a_names))
    )
    (before / "in-after-order.ptx").write_text(_redeclare(b_ptx, [b_index[n] for n in a_names], len(b_names)))
    for label, path in [
        ("before (positional)", before / "kernel.ptx"),
        ("after (records)", after / "kernel.ptx"),
        ("after's body, before's parameter order", after / "in-before-order.ptx"),
        ("before's body, after's parameter order", before / "in-after-order.ptx"),
    ]:
        print(f"{label:<40} {profile(path, arch, warps, kernel)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("arch", choices=["sm90", "sm80"])
    d.add_argument("kernel")
    d.add_argument("call")
    s = sub.add_parser("swap")
    s.add_argument("before", type=Path)
    s.add_argument("after", type=Path)
    s.add_argument("arch", choices=["sm90", "sm80"])
    s.add_argument("warps", type=int)
    s.add_argument("kernel")
    a = p.parse_args()
    if a.cmd == "dump":
        dump(a.out, a.arch, a.kernel, a.call)
    else:
        swap(a.before, a.after, a.arch, a.warps, a.kernel)


if __name__ == "__main__":
    main()
