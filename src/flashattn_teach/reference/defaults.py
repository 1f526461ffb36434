"""Default tile sizes of the CPU references.

On a CPU, larger tiles amortise Python's per-tile overhead and keep the matmuls efficient, while the
references still hold only ``BLOCK_M x BLOCK_N`` scores per (batch, head). At B=1, H=8, N=4096, D=64,
float32 on the 2-core development machine, idle, the query-major forward at 128 x 512 measured 1.7-2.1x
torch's fused CPU SDPA (``benchmarks/bench_cpu.py --targets`` and ``benchmarks/cpu_under_load.py``
measure it; see ``benchmarks/README.md``).
"""

DEFAULT_BLOCK_M = 128
DEFAULT_BLOCK_N = 512

# The threaded path (``parallel.py``) runs each tile on one core, two or more tiles at once. Swept with two
# workers against torch's SDPA in the same process (B=1, H=8, N=4096, D=64, float32, medians of 5 paired
# calls, 2-core development machine): forward 1.35-1.55x SDPA at 1024 x 256 and 2048 x 256, 1.5-1.7x at
# 512 x 256, 1.9-2.3x at 256 x 256 and 128 x 512; causal 1.8x at 1024 x 256; the backward 1.05-1.25x of
# SDPA's for every shape tried. Taller query blocks mean fewer tiles for the same work, so fewer Python-level
# ops and fewer passes over K_j and V_j; the float32 score tile, 1 MiB, is one core's L2 here.
PARALLEL_BLOCK_M = 1024
PARALLEL_BLOCK_N = 256
