"""Default tile sizes of the CPU references.

On a CPU, larger tiles amortise Python's per-tile overhead and keep the matmuls efficient, while the
references still hold only ``BLOCK_M x BLOCK_N`` scores per (batch, head). A sweep of the forward at
B=1, H=8, N=4096, D=64, float32 on the 2-core development machine put 128 x 512 and 256 x 256 within
1.3-1.6x of torch's fused CPU SDPA and 64 x 256 at 1.8-2.3x; ``benchmarks/bench_cpu.py --targets``
measures the default against SDPA (see ``benchmarks/README.md``).
"""

DEFAULT_BLOCK_M = 128
DEFAULT_BLOCK_N = 512
