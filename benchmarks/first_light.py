"""First light: the first part of the GPU suite, built to answer within 5 minutes of GPU time whatever the
kernels do (hang, crash, wrong answer).

    python benchmarks/first_light.py --dry-run     # the plan (groups, cases, budgets, total), on any machine
    python benchmarks/first_light.py               # on a GPU machine; results under --out
    python benchmarks/first_light.py --parts correctness --cases-module tests/first_light_fakes.py

Three parts, each within its budget (the plan's total is their sum, plus the report's):

1. precompile: every case once, each in a process of its own, as many at a time as there are cores
   (``--jobs``), to fill Triton's on-disk cache; what runs past the budget is killed, and compiles later.
2. correctness: each case group (``first_light_cases.py``) in its own process, one group after another; per
   case PASS, FAIL (its error against float64 attention over the bound), ERROR (an exception or a dead
   process, with the last lines), HANG (no answer within its timeout: the process group is killed and the
   group's remaining cases go on in a fresh process) or SKIP (with the reason).
3. timings: the headline rows (``first_light_timings.py``) in one process, the warp-specialised forward's in
   another (FLASHATTN_TEACH_WARP_SPECIALIZE=1).

Writes ``first-light.json`` (machine, versions, date, the plan, every outcome) and ``first-light.txt`` (the
tables) under ``--out`` (default benchmarks/results/local/first-light). Exit status 1 if a correctness case
FAILed, ERRORed or HUNG, else 0. Without CUDA it prints one line and exits 0 (the dry run works anywhere).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if importlib.util.find_spec("flashattn_teach") is None:  # not installed: the checkout's, here and in the workers
    sys.path.insert(0, str(HERE.parent / "src"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent / "src"), os.environ.get("PYTHONPATH")]))

from _machine import machine_info  # noqa: E402
from first_light_runner import Group, Outcome, load_cases, run_groups  # noqa: E402

PARTS = ("precompile", "correctness", "timings")
DEFAULT_OUT = HERE / "results" / "local" / "first-light"
DEFAULT_CASES = HERE / "first_light_cases.py"
BAD = ("FAIL", "ERROR", "HANG")


def groups_of(module: ModuleType, part: str) -> list[Group]:
    """The groups a part runs: the precompile takes every group's cases."""
    return list(module.GROUPS) if part == "precompile" else [g for g in module.GROUPS if g.part == part]


def plan(module: ModuleType, parts: tuple[str, ...]) -> dict[str, object]:
    """The parts, their groups and budgets, and the planned total in seconds."""
    rows = []
    for part in parts:
        groups = groups_of(module, part)
        if part == "precompile":
            n = sum(c.precompile for g in groups for c in g.cases)
            rows.append({"part": part, "budget_s": module.PRECOMPILE_BUDGET_S, "processes": n, "groups": []})
            continue
        described = [
            {
                "group": g.name,
                "budget_s": g.budget_s,
                "env": dict(g.env),
                "covers": g.covers,
                "cases": [c.name for c in g.cases],
            }
            for g in groups
        ]
        rows.append({"part": part, "budget_s": sum(g.budget_s for g in groups), "groups": described})
    rows.append({"part": "report", "budget_s": module.REPORT_BUDGET_S, "groups": []})
    return {"parts": rows, "total_s": sum(float(r["budget_s"]) for r in rows)}


def print_plan(p: dict[str, object]) -> None:
    for row in p["parts"]:  # type: ignore[attr-defined]
        extra = f", {row['processes']} processes" if "processes" in row else ""
        print(f"{row['part']}: {row['budget_s']:.0f} s{extra}")
        for g in row["groups"]:
            env = " ".join(f"{k}={v}" for k, v in g["env"].items())
            print(f"  {g['group']}: {len(g['cases'])} cases, {g['budget_s']:.0f} s{'  [' + env + ']' if env else ''}")
            print(f"    covers: {g['covers']}")
            for name in g["cases"]:
                print(f"    - {name}")
    print(f"planned total: {p['total_s']:.0f} s of GPU time")


def run_part(part: str, module: ModuleType, ref: str, budget_s: float, jobs: int) -> list[Outcome]:
    groups = groups_of(module, part)
    if part == "precompile":
        return run_groups(ref, groups, budget_s, jobs=jobs, warm=True)
    return run_groups(ref, groups, budget_s, progress=progress)


def progress(o: Outcome) -> None:
    """One line per case as it is known (the tables follow at the end of each part)."""
    print(f"  {o.status:5} {o.seconds:6.1f} s  {o.group}/{o.case}  {first_line(o.detail)}", flush=True)


def first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:140]


def correctness_table(outcomes: list[Outcome]) -> list[str]:
    lines = [f"{'status':6}  {'seconds':>7}  case"]
    for o in outcomes:
        lines.append(f"{o.status:6}  {o.seconds:7.2f}  {o.group}/{o.case}")
        if o.status in BAD or o.status == "SKIP":
            lines.extend("          " + s for s in o.detail.strip().splitlines()[-8:])
        elif o.errors:
            worst = max(o.errors, key=lambda e: float(e["err"]) / float(e["bound"]) if float(e["bound"]) else 0.0)
            lines[-1] += f"  (worst: {worst['output']} {float(worst['err']):.3g} <= {float(worst['bound']):.3g})"
    counts = {s: sum(o.status == s for o in outcomes) for s in ("PASS", "FAIL", "ERROR", "HANG", "SKIP")}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return lines


def timings_table(outcomes: list[Outcome]) -> list[str]:
    lines = [f"{'row':36}  {'fwd ms':>8}  {'fwd TFLOP/s':>11}  {'bwd ms':>8}  {'bwd TFLOP/s':>11}  status"]
    for o in outcomes:
        cells = []
        for key, width in (("fwd_ms", 8), ("fwd_tflops", 11), ("bwd_ms", 8), ("bwd_tflops", 11)):
            value = o.data.get(key)
            cells.append(f"{float(value):{width}.2f}" if value is not None else f"{'-':>{width}}")
        status = o.status if o.status == "PASS" else f"{o.status}: {first_line(o.detail)}"
        lines.append(f"{o.case:36}  " + "  ".join(cells) + f"  {status}")
    return lines


def summary(part: str, outcomes: list[Outcome], seconds: float, budget_s: float) -> list[str]:
    head = f"== {part}: {seconds:.0f} s of {budget_s:.0f} s"
    if part == "precompile":
        counts = {s: sum(o.status == s for o in outcomes) for s in ("PASS", "FAIL", "ERROR", "HANG", "SKIP")}
        return [head, "cases warmed: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
    return [head] + (timings_table(outcomes) if part == "timings" else correctness_table(outcomes))


def write(out: Path, machine: dict, the_plan: dict, seconds: float, results: dict, text: list[str]) -> None:
    """``first-light.json`` (everything) and ``first-light.txt`` (the machine and the tables)."""
    out.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine, "plan": the_plan, "seconds": seconds, "results": results}
    (out / "first-light.json").write_text(json.dumps(record, indent=1) + "\n")
    header = [f"{k}: {v}" for k, v in machine.items()]
    (out / "first-light.txt").write_text("\n".join([*header, "", *text]) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit; touches no GPU")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    p.add_argument("--cases-module", default=str(DEFAULT_CASES), help="the case list: a .py path or a module")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="precompile processes at once")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    module = load_cases(args.cases_module)
    parts = tuple(p for p in PARTS if p in args.parts)
    the_plan = plan(module, parts)
    if args.dry_run:
        print_plan(the_plan)
        return 0
    import torch

    if module.NEEDS_CUDA and not torch.cuda.is_available():
        print("no CUDA: dry run only (python benchmarks/first_light.py --dry-run prints the plan)")
        return 0
    machine = machine_info(gpu=module.NEEDS_CUDA)
    print(f"first light: {machine.get('gpu', 'no GPU')}, torch {machine['torch']}, triton {machine['triton']}")
    budgets = {str(r["part"]): float(r["budget_s"]) for r in the_plan["parts"]}  # type: ignore[attr-defined]
    results: dict[str, list[dict[str, object]]] = {}
    text: list[str] = []
    start = time.monotonic()
    for part in parts:
        t0 = time.monotonic()
        print(f"== {part} ({budgets[part]:.0f} s)", flush=True)
        outcomes = run_part(part, module, args.cases_module, budgets[part], args.jobs)
        lines = summary(part, outcomes, time.monotonic() - t0, budgets[part])
        print("\n".join(lines), flush=True)
        text += lines
        results[part] = [vars(o) for o in outcomes]
        write(args.out, machine, the_plan, time.monotonic() - start, results, text)  # a cut run keeps its parts
    total = time.monotonic() - start
    text.append(f"first light: {total:.0f} s (planned {the_plan['total_s']:.0f} s)")
    print(text[-1])
    write(args.out, machine, the_plan, total, results, text)
    print(f"wrote {args.out / 'first-light.json'} and {args.out / 'first-light.txt'}")
    bad = [o for o in results.get("correctness", []) if o["status"] in BAD]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
