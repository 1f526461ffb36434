"""Default tile sizes of the CPU references.

On a CPU, larger tiles amortise Python's per-tile overhead and keep matmuls efficient while still
holding only ``BLOCK_M x BLOCK_N`` scores per (batch, head): 128 x 512 float32 scores are 256 KiB, about
one core's L2 cache. Measured with ``benchmarks/bench_cpu.py``; see ``benchmarks/README.md``.
"""

DEFAULT_BLOCK_M = 128
DEFAULT_BLOCK_N = 512
