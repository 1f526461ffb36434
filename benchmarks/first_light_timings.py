"""The first light's headline timings: one row per (shape, provider), forward and backward, measured by
``triton.testing.do_bench`` (median, L2 flushed between calls) in the process of the ``timings`` group.

Shapes as ``bench_attention.py``'s grid (16k tokens, hidden size 2048, bf16): head dims 128 and 64 at
N = 8192 not causal and N = 2048 causal. Providers are ``bench_attention.py``'s: ``triton`` (the default
path), ``triton-nows`` (the forward's fallback, without warp specialisation), ``triton-det`` (the
deterministic backward), ``sdpa-cudnn`` and ``sdpa-flash`` (torch's SDPA pinned to one backend by
``torch.nn.attention.sdpa_kernel``). The warp-specialised forward is ``triton`` run in a process started with
FLASHATTN_TEACH_WARP_SPECIALIZE=1 (the ``timings-ws`` group), reported as ``triton-ws``. Nothing here touches
CUDA at import.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench_attention import Cell, make_providers
from flashattn_teach.tools import iomodel

WARMUP_MS, REP_MS = 10, 40  # do_bench's warm-up and measuring time per pass


@dataclass(frozen=True)
class Row:
    """One headline row: ``provider`` on a bf16 cell, the passes it times (``fwd``, ``bwd``)."""

    head_dim: int
    seq_len: int
    causal: bool
    provider: str  # a bench_attention provider name
    passes: tuple[str, ...] = ("fwd", "bwd")
    label: str = ""  # the name in the table, if not the provider's

    @property
    def cell(self) -> Cell:
        return Cell("bf16", self.head_dim, self.causal, self.seq_len)

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"hd{self.head_dim}-N{self.seq_len}-{mask}-{self.label or self.provider}"


SHAPES = ((128, 8192, False), (64, 8192, False), (128, 2048, True), (64, 2048, True))
PROVIDERS = (
    ("triton", ("fwd", "bwd")),
    ("triton-nows", ("fwd",)),
    ("triton-det", ("bwd",)),
    ("sdpa-cudnn", ("fwd", "bwd")),
    ("sdpa-flash", ("fwd", "bwd")),
)
ROWS = tuple(Row(d, n, c, p, passes) for d, n, c in SHAPES for p, passes in PROVIDERS)
WS_ROWS = tuple(Row(d, n, c, "triton", ("fwd",), label="triton-ws") for d, n, c in SHAPES)


def _inputs(row: Row):
    """q, k, v (requiring grad) and dO of the row's cell, (B, H, N, D) bf16 on the GPU."""
    import torch

    cell = row.cell
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (cell.batch, cell.heads, cell.seq_len, cell.head_dim)
    q, k, v, dO = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dO


def _provider(row: Row):
    from first_light_runner import Skip

    providers, missing = make_providers([row.provider])
    if not providers:
        raise Skip(f"{row.provider}: {missing.get(row.provider, 'not constructed here')}")
    return providers[0]


def warm(row: Row) -> None:
    """One forward and backward: what the precompile runs to compile the row's kernels."""
    provider = _provider(row)
    q, k, v, dO = _inputs(row)
    provider.fn(q, k, v, row.causal).backward(dO)


def measure(row: Row) -> dict[str, float]:
    """Milliseconds and TFLOP/s (FlashAttention's count: 4 B H N^2 D forward, halved if causal; backward
    2.5x) of each of the row's passes. SDPA's "No available kernel" is a SKIP."""
    from triton.testing import do_bench

    from first_light_runner import Skip

    provider = _provider(row)
    q, k, v, dO = _inputs(row)
    try:
        out = provider.fn(q, k, v, row.causal)
    except RuntimeError as e:  # only SDPA's refusal; a CUDA error or the library's own refusal is an ERROR
        if not (row.provider.startswith("sdpa") and "No available kernel" in str(e)):
            raise
        raise Skip(f"{row.provider} does not take this call: {str(e).splitlines()[0][:160]}") from e
    result: dict[str, float] = {}
    for pass_ in row.passes:
        if pass_ == "fwd":  # with inputs that require grad, as bench_attention.py times it
            ms = do_bench(lambda: provider.fn(q, k, v, row.causal), warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
        else:
            ms = do_bench(
                lambda: out.backward(dO, retain_graph=True),
                warmup=WARMUP_MS,
                rep=REP_MS,
                grad_to_none=[q, k, v],
                return_mode="median",
            )
        flops = iomodel.attention_flops(row.cell.problem(), "forward" if pass_ == "fwd" else "backward")
        result[f"{pass_}_ms"] = float(ms)
        result[f"{pass_}_tflops"] = flops / (float(ms) * 1e-3) / 1e12
    return result
