"""``create_block_mask`` for document masking at N = 16384 on the CPU: this library's (tile by tile) against
torch's (``torch.nn.attention.flex_attention``, which evaluates ``mask_mod`` over the dense ``B x H x N x N``
grid first), in one run.

    python benchmarks/block_mask.py                  # N = 16384, B = 2, H = None; a few minutes on 2 cores
    python benchmarks/block_mask.py --n 4096         # quicker
    python benchmarks/block_mask.py --out DIR        # block_mask.json (default benchmarks/results/local/block_mask)

Time: the median of ``--repeats`` calls after a warm-up call at N = 256, with torch's default threading, once
with the machine as it is ("idle": other processes are not stopped; the load average is recorded) and once
"loaded", while a child process spins (``while True: pass``). Memory, idle only, each implementation in its
own subprocess: "added peak" is the process's peak resident memory during one call (``VmHWM`` of
/proc/self/status, reset just before the call) minus its resident memory before it; "largest tensor" is
the largest tensor any torch op of a second call allocates (the ``TorchDispatchMode`` probe of
``tests/allocation_probe.py``; dispatch modes are per thread, so this call runs our chunks inline, in the
calling thread), against ``B x N x N``.
A one-off measurement, not a CI gate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.attention import flex_attention as torch_flex

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the allocation probe

from _machine import REPO, machine_info
from flashattn_teach import create_block_mask
from flashattn_teach.flex import classify

from allocation_probe import LargestAllocation

B = 2  # batch elements, each with its own documents; H = None: one mask for every head
DOC_LENGTHS = (256, 4096)  # document lengths drawn uniformly from this range
IMPLS: dict[str, Callable[..., object]] = {"flashattn_teach": create_block_mask, "torch": torch_flex.create_block_mask}


def document_mask(N: int):
    """``mask_mod`` of document masking over a captured ``(B, N)`` document-id tensor."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(B):
        lengths = torch.randint(*DOC_LENGTHS, (N // DOC_LENGTHS[0] + 1,), generator=g)
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:N])
    doc = torch.stack(rows)  # (B, N)

    def same_document(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    return same_document


def build(impl: str, N: int, mask_mod) -> object:
    return IMPLS[impl](mask_mod, B, None, N, N, device="cpu")


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _status_kib(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child_memory(impl: str, N: int) -> None:
    """In a subprocess: print the added peak RSS of one call and the largest tensor of a second, as JSON."""
    mask_mod = document_mask(N)
    build(impl, 256, document_mask(256))  # code paths loaded before the baseline
    before = _status_kib("VmRSS")
    # reset the peak (VmHWM) to the current RSS: ru_maxrss would carry the parent's peak across fork and exec
    Path("/proc/self/clear_refs").write_text("5")
    build(impl, N, mask_mod)
    added = _status_kib("VmHWM") - before
    classify.MIN_PARALLEL_ELEMENTS = 2**62  # the chunks in this thread, where the probe sees them
    with LargestAllocation() as probe:
        build(impl, N, mask_mod)
    print(json.dumps({"added_peak_mib": added / 1024, "largest_tensor": probe.largest}))


def memory(impl: str, N: int) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", impl, "--n", str(N)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        return {"added_peak_mib": None, "largest_tensor": None, "error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16384, help="Q_LEN = KV_LEN")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "local" / "block_mask")
    parser.add_argument("--child", choices=list(IMPLS), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        child_memory(opts.child, opts.n)
        return 0

    N = opts.n
    mask_mod = document_mask(N)
    ours, theirs = build("flashattn_teach", N, mask_mod), build("torch", N, mask_mod)
    same = all(torch.equal(getattr(ours, a), getattr(theirs, a)) for a in ("kv_indices", "full_kv_indices"))
    rows = []
    for condition in ("idle", "loaded"):
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if condition == "loaded" else None
        try:
            time.sleep(0.5)
            for impl in IMPLS:
                build(impl, 256, document_mask(256))  # warm-up
                row = {"impl": impl, "condition": condition, "N": N, "B": B, "threads": torch.get_num_threads()}
                row["load_avg_1min"] = os.getloadavg()[0]
                row["median_s"] = median_s(lambda impl=impl: build(impl, N, mask_mod), opts.repeats)
                if condition == "idle":
                    row.update(memory(impl, N))
                rows.append(row)
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()

    print(
        f"document masking, B={B}, H=None, N={N}, BLOCK_SIZE=128, {torch.get_num_threads()} threads; same lists: {same}"
    )
    print(f"{'impl':<16}{'condition':<10}{'median s':>10}{'added peak MiB':>16}{'largest tensor':>16}{'load':>6}")
    for row in rows:
        peak = row.get("added_peak_mib")
        largest = row.get("largest_tensor")
        print(
            f"{row['impl']:<16}{row['condition']:<10}{row['median_s']:>10.2f}"
            f"{'' if peak is None else f'{peak:.0f}':>16}{'' if largest is None else f'{largest:,}':>16}"
            f"{row['load_avg_1min']:>6.1f}"
        )
    print(f"(B x N x N = {B * N * N:,})")
    opts.out.mkdir(parents=True, exist_ok=True)
    path = opts.out / "block_mask.json"
    record = {"machine": machine_info(), "same_lists_as_torch": same, "rows": rows}
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
