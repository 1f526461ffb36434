"""Times backward and forward tile configurations on a GPU and checks the gradients.

Run from the repository root: python3 benchmarks/results/gpu/2026-11-30-h200-issue9/probe.py
"""

import sys
import time

import torch
import triton

sys.path.insert(0, "src")
from flashattn_teach.triton import AttentionConfig, KernelConfig, triton_attention

K = KernelConfig
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)


def bench(fn, n=10):
    fn()
    torch.cuda.synchronize()
    t = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        t.append(s.elapsed_time(e))
    t.sort()
    return t[len(t) // 2]


def case(D, dtype, N, B, H, fwd, dkdvs, dqs, causal=False):
    torch.manual_seed(0)
    q, k, v, dO = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    flops = 10 * B * H * N * N * D * (0.5 if causal else 1)
    ref = None
    for dkdv in dkdvs:
        for dq in dqs:
            cfg = AttentionConfig(forward=fwd, backward_dkdv=dkdv, backward_dq=dq)
            try:
                O = triton_attention(q, k, v, causal=causal, config=cfg)
                g = torch.autograd.grad(O, (q, k, v), dO, retain_graph=True)
                if ref is None:
                    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
                        O32 = torch.nn.functional.scaled_dot_product_attention(
                            q32[:, :2], k32[:, :2], v32[:, :2], is_causal=causal
                        )
                        ref = torch.autograd.grad(O32, (q32, k32, v32), dO[:, :2].float())
                err = max((a[:, :2].float() - b[:, :2]).abs().max().item() for a, b in zip(g, ref, strict=True))
                ms = bench(lambda O=O: torch.autograd.grad(O, (q, k, v), dO, retain_graph=True))
                print(
                    f"D={D} {str(dtype)[6:]} N={N} causal={causal} dkdv {dkdv} dq {dq}: {ms:.3f} ms "
                    f"{flops / ms / 1e9:.0f} TFLOP/s err {err:.3g}",
                    flush=True,
                )
            except Exception as e:
                print(f"D={D} dkdv {dkdv} dq {dq}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    for be in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
        try:
            with torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend, be)):
                O = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                ms = bench(lambda O=O: torch.autograd.grad(O, (q, k, v), dO, retain_graph=True))
            print(
                f"D={D} {str(dtype)[6:]} N={N} causal={causal} SDPA {be}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s",
                flush=True,
            )
        except Exception as e:
            print(f"SDPA {be}: {type(e).__name__} {str(e)[:100]}", flush=True)


t0 = time.time()
bf = torch.bfloat16
case(
    128,
    bf,
    8192,
    2,
    16,
    K(128, 128, 8, 2),
    [K(16, 128, 8, 2), K(32, 128, 8, 2), K(64, 128, 8, 2), K(64, 128, 8, 3)],
    [K(128, 64, 8, 2)],
)
case(128, bf, 8192, 2, 16, K(128, 128, 8, 2), [K(64, 128, 8, 2)], [K(64, 128, 8, 2), K(128, 64, 8, 3)])
case(64, bf, 8192, 2, 16, K(128, 128, 8, 3), [K(32, 128, 8, 3), K(64, 128, 8, 2), K(64, 128, 8, 3)], [K(128, 64, 8, 3)])
case(128, bf, 8192, 2, 16, K(128, 128, 8, 2), [K(32, 128, 8, 2), K(64, 128, 8, 2)], [K(128, 64, 8, 2)], causal=True)
for extra in sys.argv[1:]:
    exec(extra)
print(f"total {time.time() - t0:.0f} s")


def fwd_case(D, dtype, N, B, H, fwds, causal=False):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
    flops = 4 * B * H * N * N * D * (0.5 if causal else 1)
    for f in fwds:
        cfg = AttentionConfig(forward=f, backward_dkdv=None, backward_dq=None)
        try:
            with torch.no_grad():
                ms = bench(lambda cfg=cfg: triton_attention(q, k, v, causal=causal, config=cfg), n=20)
            print(f"FWD D={D} N={N} causal={causal} {f}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as e:
            print(f"FWD D={D} {f}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)


fwd_case(
    128,
    bf,
    8192,
    2,
    16,
    [K(128, 128, 8, 3, True), K(128, 128, 8, 2, True), K(128, 64, 8, 3, True), K(128, 128, 8, 3), K(128, 128, 8, 2)],
)
fwd_case(
    64, bf, 8192, 2, 32, [K(128, 128, 8, 3, True), K(128, 128, 4, 3, True), K(128, 64, 4, 3, True), K(128, 128, 8, 3)]
)
fwd_case(128, bf, 8192, 2, 16, [K(128, 128, 8, 3, True), K(128, 64, 8, 3, True)], causal=True)
fwd_case(256, bf, 4096, 2, 8, [K(128, 64, 8, 2, True), K(128, 32, 8, 2, True), K(128, 64, 8, 2)])
print(f"total with forward {time.time() - t0:.0f} s")
