"""Default tile sizes of the CPU references.

On a CPU, larger tiles amortise Python's per-tile overhead and keep the matmuls efficient, while the
references still hold only ``BLOCK_M x BLOCK_N`` scores per (batch, head). A sweep of the forward at
B=1, H=8, N=4096, D=64, float32 on the 2-core development machine put 128 x 512 and 256 x 256 within
1.3-1.6x of torch's fused CPU SDPA and 64 x 256 at 1.8-2.3x; ``benchmarks/bench_cpu.py --targets``
measures the default against SDPA (see ``benchmarks/README.md``).
"""

DEFAULT_BLOCK_M = 128
DEFAULT_BLOCK_N = 512

# The threaded path (``parallel.py``) runs each tile on one core, so its tile is sized for one core's L2
# (1 MiB on the development machine): the 512 KiB float32 score tile, Q_i and acc (128 KiB each at D = 64)
# and K_j, V_j (64 KiB each) fit together. Per thread at B=1, H=8, N=4096, D=64, float32, a sweep of
# 128-1024 rows by 128-1024 columns put 512 x 256 and 256 x 512 best, the forward at 1.2-1.35x and the
# backward at 0.9-1.1x of torch's SDPA on one thread; 128 x 512 (the default above) was 1.8x forward.
PARALLEL_BLOCK_M = 512
PARALLEL_BLOCK_N = 256
