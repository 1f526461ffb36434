"""FlexAttention on the CPU: a tanh softcap written as ``score_mod`` with a ``mask_mod`` (causal, document),
this library against torch's eager FlexAttention and against the same attention by its built-in variants.

    python benchmarks/flex_cpu.py                # B=1, H=4, N=1024, D=64, float32, idle and loaded (a minute)
    python benchmarks/flex_cpu.py --quick        # N=256, seconds (the smoke test)
    python benchmarks/flex_cpu.py --out DIR      # flex_cpu.json (default benchmarks/results/local/flex_cpu)

Rows (``impl`` x ``mask`` x ``mode``):

- ``ours_flex``: ``flashattn_teach.flex_attention(q, k, v, score_mod=softcap, block_mask=...)``, the auto
  backend, with this library's ``create_block_mask`` (built once, outside the timing, as a model does);
- ``torch_flex``: ``torch.nn.attention.flex_attention.flex_attention`` called eagerly (no torch.compile),
  with torch's ``create_block_mask``; forward only, torch has no CPU backward;
- ``ours_builtin``: the same attention by the built-in variants: ``flash_attention(q, k, v, softcap=30,
  causal=True)`` for the causal mask, and for the document mask ``flash_attention_varlen`` on the documents
  packed as sequences (``cu_seqlens`` at the document starts, ``causal=True``, ``softcap=30``).

Before timing, each ``ours_flex`` forward is compared with its ``ours_builtin`` one and torch's (the
largest absolute difference is printed and stored as ``max_abs_diff``), so the rows time the same numbers.

``mode`` is ``fwd`` (no autograd) or ``fwd+bwd`` (forward, then ``O.backward(dO)``). Times are the median
of ``--repeats`` calls after one warm-up call, all in this process with torch's default threading; every
condition runs every row: ``idle``, then ``loaded`` while a child process spins on one core (``while True:
pass``; on a 2-core machine, the second core). A one-off measurement, never a CI gate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flashattn_teach as fa
from _machine import machine_info

HERE = Path(__file__).resolve().parent
SOFTCAP = 30.0
DOCUMENTS = 4  # documents of random lengths in the batch element
CONDITIONS = ("idle", "loaded")


def tanh_softcap(score, b, h, q_idx, kv_idx):
    return SOFTCAP * torch.tanh(score / SOFTCAP)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document_mask(N: int) -> tuple[Callable, torch.Tensor]:
    """Causal attention inside each of ``DOCUMENTS`` documents packed into one sequence of length ``N``, and
    the documents' ``cu_seqlens`` (int32 ``(DOCUMENTS + 1,)``) for the packed built-in form."""
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(N - 1, generator=g)[: DOCUMENTS - 1] + 1).values
    starts = torch.zeros(N, dtype=torch.int64)
    starts[cuts] = 1
    doc = starts.cumsum(0)  # (N,): document of each position

    def causal_document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    cu_seqlens = torch.cat([torch.tensor([0]), cuts, torch.tensor([N])]).to(torch.int32)
    return causal_document, cu_seqlens


@dataclass(frozen=True)
class Row:
    impl: str
    mask: str
    mode: str
    condition: str
    time_ms: float
    time_min_ms: float
    repeats: int


def median_ms(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    fn()  # warm-up: first-call costs (allocations, caches) are not the steady state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, min(times) * 1e3


def calls(B: int, H: int, N: int, D: int) -> dict[tuple[str, str, str], Callable[[], object]]:
    """Every (impl, mask, mode) as a closure over the same inputs and block masks."""
    from torch.nn.attention import flex_attention as flex

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))  # (B, H, N, D) float32
    dO = torch.randn(B, H, N, D, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    document, cu_seqlens = document_mask(N)
    masks = {"causal": causal, "document": document}
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    ours_masks = {m: fa.create_block_mask(fn, None, None, N, N, device="cpu") for m, fn in masks.items()}
    torch_masks = {m: flex.create_block_mask(fn, None, None, N, N, device="cpu") for m, fn in masks.items()}

    def backward(O: torch.Tensor) -> None:
        O.backward(dO)
        for t in leaves:
            t.grad = None

    def torch_flex(mask: str) -> Callable[[], object]:
        def run() -> object:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # eager flex_attention warns that it is not compiled
                return flex.flex_attention(q, k, v, score_mod=tanh_softcap, block_mask=torch_masks[mask])

        return run

    table: dict[tuple[str, str, str], Callable[[], object]] = {}
    for mask in masks:
        table["ours_flex", mask, "fwd"] = lambda m=mask: fa.flex_attention(
            q, k, v, score_mod=tanh_softcap, block_mask=ours_masks[m]
        )
        table["ours_flex", mask, "fwd+bwd"] = lambda m=mask: backward(
            fa.flex_attention(*leaves, score_mod=tanh_softcap, block_mask=ours_masks[m])
        )
        table["torch_flex", mask, "fwd"] = torch_flex(mask)
    table["ours_builtin", "causal", "fwd"] = lambda: fa.flash_attention(q, k, v, softcap=SOFTCAP, causal=True)
    table["ours_builtin", "causal", "fwd+bwd"] = lambda: backward(
        fa.flash_attention(*leaves, softcap=SOFTCAP, causal=True)
    )

    def packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The documents as packed sequences: ``(1, H, N, D)`` -> ``(N, H, D)`` and back."""
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # (H, N, D) -> (N, H, D)
        O = fa.flash_attention_varlen(q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal=True, softcap=SOFTCAP)
        return O.transpose(0, 1)[None]  # (N, H, D) -> (1, H, N, D)

    table["ours_builtin", "document", "fwd"] = lambda: packed(q, k, v)
    table["ours_builtin", "document", "fwd+bwd"] = lambda: backward(packed(*leaves))
    return table


def max_abs_diff(table: dict[tuple[str, str, str], Callable[[], object]]) -> dict[str, float]:
    """For each mask, the largest ``|ours_flex - other|`` of the forwards, other = ours_builtin, torch_flex."""
    diffs = {}
    with torch.no_grad():
        for mask in ("causal", "document"):
            ours = table["ours_flex", mask, "fwd"]()
            for other in ("ours_builtin", "torch_flex"):
                diffs[f"{mask}:{other}"] = float((ours - table[other, mask, "fwd"]()).abs().max())
    return diffs


def measure(B: int, H: int, N: int, D: int, repeats: int) -> tuple[list[Row], dict[str, float]]:
    table = calls(B, H, N, D)
    diffs = max_abs_diff(table)
    rows = []
    for condition in CONDITIONS:
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if condition == "loaded" else None
        try:
            if spinner is not None:
                time.sleep(0.5)  # let the spinner reach its core
            with torch.no_grad():
                for (impl, mask, mode), fn in table.items():
                    if mode == "fwd":
                        rows.append(Row(impl, mask, mode, condition, *median_ms(fn, repeats), repeats))
            for (impl, mask, mode), fn in table.items():
                if mode == "fwd+bwd":
                    rows.append(Row(impl, mask, mode, condition, *median_ms(fn, repeats), repeats))
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
    return rows, diffs


def print_table(rows: list[Row], shape: str) -> None:
    """One line per (mask, mode): each impl's median and its ratio to torch's eager forward or ours."""
    print(f"flex_attention on the CPU, {shape}, score_mod = {SOFTCAP:g} * tanh(s / {SOFTCAP:g}), median ms")
    by_key = {(r.impl, r.mask, r.mode, r.condition): r.time_ms for r in rows}
    header = f"{'condition':<9} {'mask':<9} {'mode':<8} {'ours_flex':>10} {'torch_flex':>11} {'ours_builtin':>13}"
    print(header)
    print("-" * len(header))
    for condition in CONDITIONS:
        for mask in ("causal", "document"):
            for mode in ("fwd", "fwd+bwd"):
                cells = []
                for impl, width in (("ours_flex", 10), ("torch_flex", 11), ("ours_builtin", 13)):
                    t = by_key.get((impl, mask, mode, condition))
                    cells.append(f"{t:>{width}.1f}" if t is not None else f"{'-':>{width}}")
                print(f"{condition:<9} {mask:<9} {mode:<8} {' '.join(cells)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N=256, two repeats: seconds")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "local" / "flex_cpu")
    args = parser.parse_args(argv)
    B, H, N, D = (1, 4, 256, 64) if args.quick else (1, 4, 1024, 64)
    repeats = 2 if args.quick else args.repeats
    rows, diffs = measure(B, H, N, D, repeats)
    shape = f"B={B} H={H} N={N} D={D} float32, {torch.get_num_threads()} threads"
    print_table(rows, shape)
    print("max |ours_flex - other| of the forwards: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": machine_info(),
        "threads": torch.get_num_threads(),
        "shape": dict(B=B, H=H, N=N, D=D, dtype="float32"),
        "softcap": SOFTCAP,
        "documents": DOCUMENTS,
        "max_abs_diff": diffs,
        "rows": [asdict(r) for r in rows],
    }
    path = args.out / "flex_cpu.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
