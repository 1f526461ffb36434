"""Default tile sizes of the CPU references.

On a CPU, larger tiles amortise Python's per-tile overhead and keep the matmuls efficient, while the
references still hold only ``BLOCK_M x BLOCK_N`` scores per (batch, head). The measurements behind each
size are in ``benchmarks/README.md`` ("Why the CPU paths use the tiles and thresholds they do").
"""

DEFAULT_BLOCK_M = 128
DEFAULT_BLOCK_N = 512

# The threaded path (``parallel.py``) runs each tile on one core, two or more tiles at once: taller query
# blocks mean fewer tiles for the same work, so fewer Python-level ops and fewer passes over K_j and V_j.
PARALLEL_BLOCK_M = 1024
PARALLEL_BLOCK_N = 256
