"""One traced run of the kernels for readers without a GPU (issue 39, item 4): the teaching example's inputs scaled
up to the kernel's smallest tile, replayed with ``source="triton"``, written as JSON, page and table.

The teaching example (``../shared/seed``) is ``q, k, v`` of shape ``(1, 6, 4)``, ``randn`` after seed 0, two-by-two
tiles: one query block through three key tiles. ``tl.dot`` needs tiles of 16 at least, so here every size is
multiplied by 8 and the width by 4: ``(1, 48, 16)``, 16 x 16 tiles, three key blocks per query block. Cases:

    forward-plain    query block 0 through key blocks 0, 1, 2 (no mask)
    forward-causal   query block 2 (top-left causal): two full key blocks, then the diagonal's masked one
    forward-production   forward-causal's query rows in the production kernel (triton/kernels/forward.py), at its
                     own tile (the launcher's for this head dim, read by pointers): the ladder's other rung
    decode           one decode step: the last query row against the first 47 keys as a cache (room for 48) and
                     the last key and value appended, three splits of one key block each, then their merges

Each case writes ``CASE.json`` (the replay's schema: every step's ``"kernel"`` terms beside the reference's and
their largest difference) and ``CASE.txt`` (the table), with ``--html`` also ``CASE.html`` (the page, its panel
"Kernel beside reference"; about 2 MB each); ``trace.txt`` lists per case and term the largest
``|kernel - reference|`` over the steps.

    python benchmarks/gpu_trace.py --out benchmarks/results/gpu/<run>/trace              # on a GPU: bfloat16
    python benchmarks/gpu_trace.py --device cpu --dtype float16 --out /tmp/trace          # Triton's interpreter

``run_gpu_suite.sh`` runs it after the first light. On a GPU the kernel is the compiled one; on a CPU the same
kernel runs in Triton's interpreter (no bfloat16 there: it multiplies bfloat16 tiles wrongly). Exit status 0 when
every case was written, 1 otherwise (each failure printed with its case).
"""

from __future__ import annotations

import argparse
import io
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

N, D, TILE = 48, 16, 16  # the example's (6, 4) and its 2 x 2 tiles, scaled to the kernel's smallest tile


def example_inputs(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k, v (1, N, D)``: ``randn`` after seed 0, drawn in float32 on the CPU and then cast and moved, so a
    CPU and a GPU run replay the same numbers."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, N, D) for _ in range(3))
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))  # type: ignore[return-value]


def cases() -> dict[str, Callable[..., object]]:
    """The traced cases by name: each takes ``q, k, v`` and returns a replay with the kernel's numbers."""
    from flashattn_teach.replay import replay

    def plain(q, k, v):
        return replay(q, k, v, block_m=TILE, block_n=TILE, query_block=0, source="triton")

    def causal(q, k, v):
        return replay(q, k, v, block_m=TILE, block_n=TILE, query_block=2, causal=True, source="triton")

    def production(q, k, v):
        kw = {"query_block": 2, "causal": True, "source": "triton", "kernel": "production"}
        return replay(q, k, v, block_m=TILE, block_n=TILE, **kw)

    def decode(q, k, v):
        from flashattn_teach.replay import replay_decode

        q1, (k_cache, v_cache) = q[:, None, -1:], (t[:, None].clone() for t in (k, v))  # (1, 1, ., D)
        k_new, v_new = k_cache[:, :, -1:].clone(), v_cache[:, :, -1:].clone()
        return replay_decode(
            q1, k_cache, v_cache, k_new, v_new, cache_seqlens=N - 1, block_n=TILE, num_splits=3, source="triton"
        )

    return {"forward-plain": plain, "forward-causal": causal, "forward-production": production, "decode": decode}


def write_case(name: str, r: object, out: Path, html: bool) -> dict[str, float]:
    """Write ``name``'s JSON and table (and page) under ``out``; return per term the largest difference."""
    from flashattn_teach.replay import to_json
    from flashattn_teach.replay.html import render_html
    from flashattn_teach.replay.table import render_table

    (out / f"{name}.json").write_text(to_json(r))  # type: ignore[arg-type]
    if html:
        (out / f"{name}.html").write_text(render_html(r))  # type: ignore[arg-type]
    table = io.StringIO()
    render_table(r, table, width=140)  # type: ignore[arg-type]
    (out / f"{name}.txt").write_text(table.getvalue())
    worst: dict[str, float] = {}
    for step in r.all_steps():  # type: ignore[attr-defined]
        for term, d in step.kernel_diff.items():
            worst[term] = max(worst.get(term, 0.0), d)
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the files (made if absent)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="default cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--html", action="store_true", help="also write each case's page")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_trace: --device cuda, but CUDA is absent; on a CPU: --device cpu --dtype float16", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    q, k, v = example_inputs(args.device, getattr(torch, args.dtype))
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton's interpreter)"
    lines = [f"# kernel trace: q, k, v (1, {N}, {D}) randn seed 0, {args.dtype}, {TILE}x{TILE} tiles, on {where}"]
    failed = 0
    for name, run in cases().items():
        try:
            worst = write_case(name, run(q, k, v), args.out, args.html)
        except Exception:  # one case's failure is reported and the others still run
            failed += 1
            lines.append(f"{name}: ERROR\n" + traceback.format_exc(limit=4))
            continue
        lines.append(f"{name}: " + ", ".join(f"{t} {d:.3g}" for t, d in worst.items()))
    text = "\n".join(lines) + "\n"
    (args.out / "trace.txt").write_text(text)
    print(text, end="")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
