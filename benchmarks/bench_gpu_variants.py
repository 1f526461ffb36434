"""GPU rows for the attention variants: a sliding window, logit softcapping, key lengths and packed sequences,
on this library's Triton path, against torch's SDPA given the equivalent dense mask and FlexAttention.

    python benchmarks/bench_gpu_variants.py              # bf16, the sizes below (run_gpu_suite.sh runs this)
    python benchmarks/bench_gpu_variants.py --dry-run    # tiny sizes on the CPU, FlexAttention uncompiled
    python benchmarks/bench_gpu_variants.py --out DIR    # default: $OUT/variants if OUT is set, else
                                                         # benchmarks/results/local/gpu-variants

Cases (``case``), each ``B * N = 16k`` tokens, ``D = 128``, ``H = 16``:

- ``window``: ``window=(256, 0)``; SDPA with the banded bool mask ``(N, N)``; Flex with the band's
  ``mask_mod`` (its block mask skips the tiles outside the band, as ours does);
- ``softcap``: causal, ``softcap=30`` (Gemma 2); SDPA cannot cap a score (no mask expresses ``tanh``), so its
  row says so; Flex with a ``score_mod``;
- ``seqlens_k``: keys of batch element ``b`` end at ``seqlens_k[b]``; SDPA with the key-padding mask
  ``(B, 1, 1, N)``; Flex with ``kv < seqlens_k[b]``;
- ``varlen``: packed causal sequences through ``flash_attention_varlen`` (when the library has it); SDPA on
  the packed batch with the block-diagonal mask ``(T, T)``; Flex with the document mask;
- ``fp8``: causal, ``q, k, v`` in e4m3 with descales per (batch, kv head) (FA3's FP8 forward, forward only),
  quantised with power-of-two descales so that the dequantised inputs are exact in bf16: SDPA and Flex run
  those bf16 inputs, the same numbers. Its tolerance is 8x plain PyTorch's bf16 error, not 2x: the e4m3
  weights ``P`` carry 3 mantissa bits (tests/api/test_fp8.py measures 2 to 6x);
- ``sinks``: causal with a sliding window and attention sinks (GPT-OSS's sliding layers, ``sinks=`` a logit
  per head); SDPA and FlexAttention have no sinks, so their rows say so; the cost of the sinks is this
  row against the ``window`` row's.

Every row fails soft: a provider or variant that is missing (``NotImplementedError``, an import error, a
compilation error) is recorded in ``status`` and the script goes on, so the suite finishes. Providers run
outermost (ours, then SDPA, then FlexAttention, whose compilations are the slowest), and the rows are written
after each one, so a timeout keeps what finished. Each output is first checked on batch element 0 against
an fp32 oracle (``flashattn_teach.dense_attention``); ``ref_err`` is plain PyTorch's error in the inputs'
precision, the yardstick (flash-attn's rule: within about twice of it). Times: median of
``triton.testing.do_bench``; memory: ``torch.cuda.max_memory_allocated`` after a reset, ``added_mib`` over the
inputs and the provider's mask already allocated (``mask_mib``).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if importlib.util.find_spec("flashattn_teach") is None:  # not installed: run from the checkout
    sys.path.insert(0, str(HERE.parent / "src"))

from _machine import machine_info  # noqa: E402

PROVIDERS = ("triton", "sdpa", "flex", "ours_flex")
PASSES = ("fwd", "fwd+bwd")
CSV_COLUMNS = (
    "case",
    "provider",
    "pass",
    "status",
    "shape",
    "options",
    "time_ms",
    "peak_mib",
    "added_mib",
    "mask_mib",
    "max_err",
    "ref_err",
    "gpu",
    "torch",
    "triton",
    "date",
)


@dataclass(frozen=True)
class Case:
    """One variant at one size; ``packed`` lengths make it a varlen case with inputs ``(T, H, D)``."""

    name: str
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float | None = None
    seqlens_k: tuple[int, ...] | None = None
    packed: tuple[int, ...] | None = None
    fp8: bool = False
    sinks: bool = False

    @property
    def options(self) -> str:
        named = {"causal": self.causal, "window": self.window, "softcap": self.softcap,
                 "seqlens_k": self.seqlens_k, "sequences": self.packed, "e4m3": self.fp8,
                 "sinks": self.sinks}  # fmt: skip
        return ", ".join(f"{k}={v}" for k, v in named.items() if v)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.packed is not None:
            return (sum(self.packed), self.heads, self.head_dim)
        return (self.batch, self.heads, self.seq_len, self.head_dim)


def cases(dry_run: bool) -> list[Case]:
    if dry_run:
        return [
            Case("window", 2, 2, 96, 16, window=(16, 0)),
            Case("softcap", 2, 2, 64, 16, causal=True, softcap=5.0),
            Case("seqlens_k", 2, 2, 64, 16, seqlens_k=(64, 17)),
            Case("varlen", 1, 2, 0, 16, causal=True, packed=(30, 1, 33)),
            Case("fp8", 2, 2, 64, 64, causal=True, fp8=True),
            Case("sinks", 2, 2, 64, 16, causal=True, window=(16, 0), sinks=True),
        ]
    return [
        Case("window", 4, 16, 4096, 128, window=(256, 0)),
        Case("softcap", 4, 16, 4096, 128, causal=True, softcap=30.0),
        Case("seqlens_k", 4, 16, 4096, 128, seqlens_k=(4096, 3000, 2000, 1000)),
        Case("varlen", 1, 16, 0, 128, causal=True, packed=(4096, 3000, 2000, 1000, 4096, 2192)),
        Case("fp8", 4, 16, 4096, 128, causal=True, fp8=True),
        Case("sinks", 4, 16, 4096, 128, causal=True, window=(128, 0), sinks=True),  # GPT-OSS's sliding layers
    ]


def sink_logits(case: Case, device):
    """The sinks case's ``(H,)`` logits: spread over [-1, 2], the range of GPT-OSS's learned ones."""
    import torch

    return torch.linspace(-1.0, 2.0, case.heads, device=device)


# ------------------------------------------------------------------------------------------ the masks


def _cu(case: Case, device) -> tuple[object, object, int]:
    """``cu_seqlens`` (int32, starts at 0), the sequence id of every packed token ``(T,)``, the longest length."""
    import torch

    assert case.packed is not None
    lens = torch.tensor(case.packed, device=device)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32, device=device), lens.cumsum(0).to(torch.int32)])
    return cu, torch.repeat_interleave(torch.arange(len(lens), device=device), lens), max(case.packed)


def dense_mask(case: Case, device):
    """The bool mask (True: visible) torch's SDPA needs for ``case``, or None where no mask can say it."""
    import torch

    if case.softcap is not None or case.fp8:  # fp8: causal, SDPA's is_causal
        return None
    if case.packed is not None:
        _, seq, _ = _cu(case, device)
        T = seq.numel()
        i, j = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None, :]
        return (seq[:, None] == seq[None, :]) & (j <= i)  # (T, T): block diagonal, causal in each block
    N = case.seq_len
    i, j = torch.arange(N, device=device)[:, None], torch.arange(N, device=device)[None, :]
    if case.window is not None:
        left, right = case.window
        return (j >= i - left) & (j <= i + right)  # (N, N)
    assert case.seqlens_k is not None
    lengths = torch.tensor(case.seqlens_k, device=device)
    return (j < lengths[:, None, None])[:, None]  # (B, 1, 1, N): key padding


# ------------------------------------------------------------------------------------------ providers


def quantised(q, k, v):
    """``(q, k, v)`` ``(B, H, N, D)`` quantised to e4m3 per (batch, head) with power-of-two descales
    ``(B, H)`` (``2^ceil(log2(amax / 448))``): ``((q8, k8, v8), (qd, kd, vd))``, and the inputs they mean,
    ``q8 * qd`` and so on, which are exact in bf16."""
    import torch

    eights, descales, meant = [], [], []
    for t in (q, k, v):
        amax = t.float().abs().amax(dim=(-2, -1)).clamp_min(1e-30)  # (B, H)
        d = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
        t8 = (t.float() / d[..., None, None]).to(torch.float8_e4m3fn)
        eights.append(t8)
        descales.append(d)
        meant.append((t8.float() * d[..., None, None]).to(t.dtype))
    return (tuple(eights), tuple(descales)), tuple(meant)


def ours(case: Case, fp8_inputs=None) -> Callable:
    """``(q, k, v) -> O`` through this library's Triton backend, inputs in the library's layout; for the
    fp8 case the e4m3 inputs and descales of :func:`quantised` (the bf16 arguments are what they mean)."""
    import torch

    import flashattn_teach as fa

    if case.fp8:
        (q8, k8, v8), (qd, kd, vd) = fp8_inputs
        return lambda q, k, v: fa.flash_attention(
            q8, k8, v8, causal=case.causal, q_descale=qd, k_descale=kd, v_descale=vd, backend="triton"
        )

    if case.packed is not None:

        def varlen(q, k, v):
            if not hasattr(fa, "flash_attention_varlen"):
                raise NotImplementedError("flashattn_teach.flash_attention_varlen does not exist yet")
            cu, _, longest = _cu(case, q.device)
            return fa.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=case.causal, backend="triton")

        return varlen
    lengths = None if case.seqlens_k is None else torch.tensor(case.seqlens_k)

    def call(q, k, v):
        seqlens_k = None if lengths is None else lengths.to(q.device)
        sinks = sink_logits(case, q.device) if case.sinks else None
        return fa.flash_attention(
            q, k, v, causal=case.causal, window=case.window, softcap=case.softcap, seqlens_k=seqlens_k,
            sinks=sinks, backend="triton",
        )  # fmt: skip

    return call


def sdpa(case: Case, mask) -> Callable:
    import torch.nn.functional as F

    if case.fp8:  # its flash kernel on the bf16 numbers the e4m3 inputs mean
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
    if case.sinks:
        raise NotImplementedError("torch SDPA has no attention sinks (no mask adds a softmax entry of value 0)")
    if mask is None:
        raise NotImplementedError("torch SDPA cannot cap scores: no attn_mask expresses softcap * tanh(S / softcap)")
    if case.packed is not None:  # (T, H, D) -> (1, H, T, D), one batch of packed tokens
        return lambda q, k, v: F.scaled_dot_product_attention(
            *(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask
        )[0].transpose(0, 1)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)


def flex(case: Case, device, compiled: bool, library: str = "torch") -> Callable:
    """FlexAttention with the case's ``mask_mod`` (and ``score_mod`` for softcap): torch's, compiled unless
    ``compiled`` is False (the CPU dry run), or (``library="ours"``) this library's ``flex_attention`` and
    ``create_block_mask`` with the same functions, which need no torch.compile (on CUDA the functions are
    translated into the Triton kernels)."""
    import torch

    if case.sinks:
        raise NotImplementedError("FlexAttention has no attention sinks (a score_mod cannot add a softmax entry)")
    if library == "ours":
        from flashattn_teach import create_block_mask, flex_attention

        attend = flex_attention
    else:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        attend = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    score_mod = None
    if case.softcap is not None:
        cap = case.softcap

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

    if case.packed is not None:
        _, seq, _ = _cu(case, device)

        def mask_mod(b, h, q_idx, kv_idx):
            return (seq[q_idx] == seq[kv_idx]) & (kv_idx <= q_idx)

        T = seq.numel()
        block_mask = create_block_mask(mask_mod, None, None, T, T, device=device)
        return lambda q, k, v: attend(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=block_mask)[
            0
        ].transpose(0, 1)
    N = case.seq_len
    if case.window is not None:
        left, right = case.window

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)

        block_mask = create_block_mask(mask_mod, None, None, N, N, device=device)
    elif case.seqlens_k is not None:
        lengths = torch.tensor(case.seqlens_k, device=device)

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx < lengths[b]

        block_mask = create_block_mask(mask_mod, case.batch, None, N, N, device=device)
    else:  # softcap, causal

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

        block_mask = create_block_mask(mask_mod, None, None, N, N, device=device)
    return lambda q, k, v: attend(q, k, v, score_mod=score_mod, block_mask=block_mask)


# ------------------------------------------------------------------------------------------ checking


def reference(case: Case, q, k, v, *, exact: bool):
    """Batch element 0 (the first packed sequence) by the definition: the fp32 oracle with ``exact``, else
    plain PyTorch in the inputs' precision (scores, cap and mask in that dtype, softmax in fp32)."""
    import torch

    import flashattn_teach as fa

    if case.packed is not None:
        n = case.packed[0]
        q0, k0, v0 = (t[:n].transpose(0, 1) for t in (q, k, v))  # (H, n, D)
        window, seqlens_k = None, None
    else:
        q0, k0, v0 = (t[0] for t in (q, k, v))  # (H, N, D)
        window = case.window
        seqlens_k = None if case.seqlens_k is None else case.seqlens_k[0]
    sinks = sink_logits(case, q.device) if case.sinks else None
    if exact:
        return fa.dense_attention(
            q0.float(), k0.float(), v0.float(), causal=case.causal, window=window, softcap=case.softcap,
            seqlens_k=None if seqlens_k is None else torch.tensor(seqlens_k, device=q.device), sinks=sinks,
        )  # fmt: skip
    N_q, N_k = q0.shape[-2], k0.shape[-2]
    S = (q0 * q0.shape[-1] ** -0.5) @ k0.transpose(-2, -1)  # (H, N_q, D) @ (H, D, N_k) -> (H, N_q, N_k)
    if case.softcap is not None:
        S = case.softcap * torch.tanh(S / case.softcap)
    i, j = torch.arange(N_q, device=q.device)[:, None], torch.arange(N_k, device=q.device)[None, :]
    visible = torch.ones(N_q, N_k, dtype=torch.bool, device=q.device)
    if case.causal:
        visible &= j <= i
    if window is not None:
        visible &= (j >= i - window[0]) & (j <= i + window[1])
    if seqlens_k is not None:
        visible &= j < seqlens_k
    S = S.float().masked_fill(~visible, float("-inf"))
    if sinks is not None:  # one more softmax entry per row, the head's sink, of value 0: (H, N_q, N_k + 1)
        S = torch.cat([S, sinks[:, None, None].expand(-1, N_q, 1)], dim=-1)
    P = torch.softmax(S, dim=-1)[..., :N_k].to(v0.dtype)
    return P @ v0  # (H, N_q, N_k) @ (H, N_k, D) -> (H, N_q, D)


def first_element(case: Case, out):
    """``out``'s batch element 0 (the first packed sequence) as ``(H, N, D)``."""
    return out[: case.packed[0]].transpose(0, 1) if case.packed is not None else out[0]


# ------------------------------------------------------------------------------------------ measuring


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


def timer(device: str, warmup: int, rep: int) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of a call: ``triton.testing.do_bench`` on CUDA, best of 3 on the CPU dry run."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))

    def best_of_3(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * min(times)

    return best_of_3


def run_row(case: Case, provider: str, args: argparse.Namespace, device: str) -> list[dict[str, object]]:
    """Build, check and time one provider on one case; every failure becomes a status, never an exception."""
    import torch

    base = {"case": case.name, "provider": provider, "shape": "x".join(map(str, case.shape)), "options": case.options}

    def rows_with(status: str, **extra) -> list[dict[str, object]]:
        return [{**base, "pass": p, "status": status, **extra} for p in args.passes]

    cuda = device == "cuda"
    try:
        g = torch.Generator(device=device).manual_seed(0)
        dtype = torch.bfloat16 if cuda else torch.float32
        q, k, v, dO = (torch.randn(case.shape, device=device, dtype=dtype, generator=g) for _ in range(4))
        fp8_inputs = None
        if case.fp8:  # every provider gets the numbers the e4m3 inputs mean
            fp8_inputs, (q, k, v) = quantised(q, k, v)
        mask = dense_mask(case, device) if provider == "sdpa" else None
        if provider == "triton":
            fn = ours(case, fp8_inputs)
        elif provider == "sdpa":
            fn = sdpa(case, mask)
        elif provider == "flex":
            fn = flex(case, device, compiled=not args.dry_run)
        else:
            fn = flex(case, device, compiled=False, library="ours")
        out = fn(q, k, v)
        err = (first_element(case, out).float() - reference(case, q, k, v, exact=True)).abs().max().item()
        ref_err = (reference(case, q, k, v, exact=False).float() - reference(case, q, k, v, exact=True)).abs()
        ref_err = ref_err.max().item()
        del out
    except (NotImplementedError, ImportError) as e:
        return rows_with(f"not available: {_first_line(e)}")
    except Exception as e:  # a compilation error, an unsupported shape, out of memory: record it and go on
        if cuda:
            torch.cuda.empty_cache()
        return rows_with(f"error: {type(e).__name__}: {_first_line(e)}")
    mask_mib = 0.0 if mask is None else mask.numel() * mask.element_size() / 2**20
    tolerance = (8 if case.fp8 and provider == "triton" else 2) * ref_err + 1e-3  # fp8: see the module docs
    status = "ok" if err <= tolerance else f"wrong output: max error {err:.3g} > {tolerance:.3g}"
    measure = timer(device, args.warmup, args.rep)
    rows = []
    for pass_ in args.passes:
        row: dict[str, object] = {**base, "pass": pass_, "max_err": err, "ref_err": ref_err, "mask_mib": mask_mib}
        if case.fp8 and provider == "triton" and pass_ == "fwd+bwd":
            rows.append({**row, "status": "not available: the FP8 forward has no backward (FA3's neither)"})
            continue
        try:
            for t in (q, k, v):
                t.requires_grad_(pass_ == "fwd+bwd")

            def call(pass_: str = pass_) -> None:
                out = fn(q, k, v)
                if pass_ == "fwd+bwd":
                    out.backward(dO)

            with torch.no_grad() if pass_ == "fwd" else torch.enable_grad():
                call()  # warm-up (and compilation) outside the memory measurement
                if cuda:
                    torch.cuda.synchronize()
                    before = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    call()
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated()
                    row.update(peak_mib=peak / 2**20, added_mib=(peak - before) / 2**20)
                row["time_ms"] = measure(call)
            row["status"] = status
        except Exception as e:  # this pass only (a missing backward, say): record it and go on
            row["status"] = f"error: {type(e).__name__}: {_first_line(e)}"
        for t in (q, k, v):
            t.grad = None
        if cuda:
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ output


def write_rows(rows: list[dict], machine: dict[str, object], selected: list[Case], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "variants.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(CSV_COLUMNS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in {**machine, **r}.items()})
    record = {"machine": machine, "cases": [asdict(c) for c in selected], "rows": rows}
    (out / "variants.json").write_text(json.dumps(record, indent=1) + "\n")


def print_rows(rows: list[dict]) -> None:
    columns = ("case", "provider", "pass", "time_ms", "added_mib", "mask_mib", "max_err", "ref_err", "status")

    def fmt(x: object) -> str:
        return f"{x:.3g}" if isinstance(x, float) else str(x)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[n]) for row in cells)) for n, c in enumerate(columns)]
    for line in (list(columns), *cells):
        print("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    default_out = Path(os.environ["OUT"]) / "variants" if os.environ.get("OUT") else HERE / "results" / "local"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, FlexAttention not compiled")
    p.add_argument("--cases", nargs="+", choices=("window", "softcap", "seqlens_k", "varlen", "fp8"))
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms (default 10)")
    p.add_argument("--rep", type=int, default=30, help="do_bench measuring time, ms (default 30)")
    p.add_argument("--out", type=Path, default=None, help="output directory (see the module docstring)")
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("CUDA is absent (torch.cuda.is_available() is False): no variant rows (--dry-run runs them on the CPU)")
        return 0
    device = "cpu" if args.dry_run else "cuda"
    out = args.out or (default_out if os.environ.get("OUT") else default_out / "gpu-variants")
    machine = machine_info(gpu=device == "cuda")
    where = machine.get("gpu", machine["cpu"])
    print(f"{where}, torch {machine['torch']}, triton {machine['triton']}, {machine['date']}")
    selected = [c for c in cases(args.dry_run) if not args.cases or c.name in args.cases]
    rows: list[dict[str, object]] = []
    start = time.perf_counter()
    for provider in args.providers:  # FlexAttention last: its compilations are the slowest
        for case in selected:
            new = run_row(case, provider, args, device)
            rows.extend(new)
            print(f"[{time.perf_counter() - start:5.0f} s] {case.name} {provider}: {new[0]['status']}", flush=True)
            write_rows(rows, machine, selected, out)  # after every row: a timeout keeps them
    print_rows(rows)
    print(f"wrote {out / 'variants.csv'} and {out / 'variants.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
