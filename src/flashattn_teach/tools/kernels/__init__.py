"""``flashattn-teach kernels``: compile the shipped kernels ahead of time for a named GPU and report their
registers, spills, shared memory and hot loops (``report.py``), the decode kernels alike (``decode.py``),
from the specialisations the JIT would build (``specialize.py``), read from SASS (``sass.py``,
``loops.py``).
"""

from .report import add_arguments, run

__all__ = ["add_arguments", "run"]
