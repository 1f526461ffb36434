"""Before/after of two ``flashattn-teach kernels --specializations --json`` tables, row by row.

    python benchmarks/results/kernel_args/compare.py BEFORE.json AFTER.json [--arch sm90]

A specialisation is matched by its kernel, arch and the calls that launch it (the calls are the same
before and after when the records change no specialisation; the ids differ, since they hash the source and
the field names). Prints a Markdown summary: matched and unmatched rows, compile failures, loops that got
longer or shorter (instructions per warp and iteration of the steady-state loop), new spills (bytes of
local memory, and local accesses in the loop), register changes, and a table of every row that differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

Row = dict[str, Any]
FIELDS = ("registers", "loop_instructions", "spill_bytes", "loop_local")


def load(path: Path, arch: str | None) -> dict[tuple[Any, ...], Row]:
    """The rows by (arch, kernel, calls, tile, flags): the constants by name (a record's field by its own
    name: ``bounds.OFFSET`` after is ``OFFSET`` before), less those that name a stride
    (``stride_qd`` before, ``Q.stride_d`` after) and those that are None (an unused variant is a None
    constant after, a placeholder pointer before), and ``TRACE=False`` (the trace build off, which main had not)."""
    out: dict[tuple[Any, ...], Row] = {}
    for r in json.loads(path.read_text())["rows"]:
        if arch is None or r["arch"] == arch:
            consts = r["constants"].items()
            # TRACE (issue 39) is off in every row and main had no such flag
            flags = tuple(
                sorted(
                    (k.rsplit(".")[-1], v)
                    for k, v in consts
                    if "stride" not in k and v != "None" and (k, v) != ("TRACE", "False")
                )
            )
            tile = (r["BLOCK_M"], r["BLOCK_N"], r["num_warps"], r["num_stages"])
            key = (r["arch"], r["kernel"], tuple(sorted(r["calls"])), tile, flags)
            assert key not in out, f"two rows of {path} share {key}"
            out[key] = r
    return out


def _int(v: Any) -> int:
    return 0 if v is None else int(v)


def compare(before: dict, after: dict) -> tuple[list[str], bool]:
    """The report's lines, and whether the done-when holds (no failure, no longer loop, no new spill)."""
    # a row whose flags differ only by an unused variant's placeholder (the decode kernel's PAGE_SIZE=1 before,
    # its Pages None after) is matched by kernel, arch, calls and tile where that names one row on each side
    only_b = [k for k in before if k not in after]
    only_a = [k for k in after if k not in before]
    for k in only_b:
        same = [x for x in only_a if x[:4] == k[:4]]
        if len(same) == 1 and [y for y in only_b if y[:4] == k[:4]] == [k]:
            after = {**after, k: after[same[0]]}
            del after[same[0]]
    common = [k for k in before if k in after]
    lines = [
        f"- matched rows: {len(common)}; only before: {len(set(before) - set(after))}, only after: "
        f"{len(set(after) - set(before))}"
    ]
    fails = [k for k in common if after[k].get("error")]
    longer = [k for k in common if _int(after[k]["loop_instructions"]) > _int(before[k]["loop_instructions"])]
    shorter = [k for k in common if _int(after[k]["loop_instructions"]) < _int(before[k]["loop_instructions"])]
    spill = [k for k in common if _int(after[k]["spill_bytes"]) > _int(before[k]["spill_bytes"])]
    less_spill = [k for k in common if _int(after[k]["spill_bytes"]) < _int(before[k]["spill_bytes"])]
    loop_spill = [k for k in common if _int(after[k]["loop_local"]) > _int(before[k]["loop_local"])]
    more_regs = [k for k in common if _int(after[k]["registers"]) > _int(before[k]["registers"])]
    fewer_regs = [k for k in common if _int(after[k]["registers"]) < _int(before[k]["registers"])]
    same = [k for k in common if all(before[k][f] == after[k][f] for f in FIELDS)]
    lines += [
        f"- compile failures after: {len(fails)} (before: {sum(1 for k in common if before[k].get('error'))})",
        f"- identical in registers, loop instructions, spill bytes and loop local accesses: {len(same)}",
        f"- loops longer: {len(longer)}, shorter: {len(shorter)}",
        f"- more spill: {len(spill)} (in a loop: {len(loop_spill)}), less spill: {len(less_spill)}",
        f"- more registers: {len(more_regs)}, fewer: {len(fewer_regs)}",
        "",
        "| arch | kernel | dtype | D | tile | regs | loop instr | spill B | loop ldl/stl | calls |",
        "| --- | --- | --- | --: | --- | --: | --: | --: | --: | --- |",
    ]
    for k in sorted(set(common) - set(same)):
        b, a = before[k], after[k]
        tile = f"{a['BLOCK_M']}x{a['BLOCK_N']} w{a['num_warps']} s{a['num_stages']}"
        cells = " | ".join(f"{b[f]} / {a[f]}" for f in FIELDS)
        calls = ", ".join(k[2][:2]) + (f" (+{len(k[2]) - 2})" if len(k[2]) > 2 else "")
        lines.append(f"| {k[0]} | {k[1]} | {a['dtype']} | {a['head_dim']} | {tile} | {cells} | {calls} |")
    ok = not fails and not longer and not spill and not loop_spill
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--arch", choices=("sm90", "sm80"))
    args = p.parse_args(argv)
    lines, ok = compare(load(args.before, args.arch), load(args.after, args.arch))
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
