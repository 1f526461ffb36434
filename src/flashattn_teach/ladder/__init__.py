"""``flashattn-teach ladder``: from dense attention to the production kernel, one rung at a time.

Every rung computes the same ``O`` and ``lse`` from the same inputs, each a step nearer the GPU:

    1  dense              core/dense.py: S = Q K^T, P = softmax(S), O = P V; holds every score
    2  query-major loop   core/loops.py (FA2 Alg. 1): query blocks outside; one BLOCK_M x BLOCK_N tile of S
                          at a time, folded in by the online softmax
    3  key-major loop     core/loops.py (FA1 Alg. 1): key blocks outside; O_i, l_i, m_i go back to HBM
                          after every key block
    4  tutorial kernel    core/kernel.py: rung 2 as one Triton program per query block
    5  production kernel  flashattn_teach.triton: rung 4 with every variant, the shipped tiles, TMA

Each rung is checked against the one before it and against the float64 dense oracle (rung 1's function in
float64). Beside each one stands what it costs and saves: the scores it holds at once per (batch, head), the
HBM bytes the IO model (:mod:`flashattn_teach.tools.iomodel`) counts for its schedule, and its time where the
machine can tell: the CPU rungs on the CPU, the kernels with CUDA events on a GPU. Without CUDA the kernels
run in Triton's interpreter (``TRITON_INTERPRET=1``, which this command sets), for correctness only.
llm.c's ``dev/cuda`` ladder checks each kernel against a CPU reference the same way.

    rungs.py    the five rungs: forward, tile, the IO model's bytes, tolerance; or why one cannot run here
    command.py  the climb, the checks, the table; ``add_arguments`` and ``run``
"""

from __future__ import annotations

from .command import Step, add_arguments, climb, failures, run, table
from .rungs import RUNGS, TOLERANCE, Inputs, Rung

__all__ = ["RUNGS", "TOLERANCE", "Inputs", "Rung", "Step", "add_arguments", "climb", "failures", "run", "table"]
