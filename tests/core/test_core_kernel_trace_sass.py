"""The trace build costs nothing when it is off: core/kernel.py's ``_forward_kernel`` with ``TRACE=False`` (and
``Trace=None``, which Triton's JIT makes a constant, not an argument) compiles for sm_90 to the same SASS as the
forward before the trace build, kept verbatim in ``fixtures/kernel_untraced.py``.

Why SASS and not the cubin: the cubin and the PTX carry the source's line numbers and file name (``.loc``, the
line table), which any edit to the file moves; the SASS is the instructions the GPU runs. Why a copy of the old
source and not ``git show main:...``: the test must mean the same thing on a clean clone and after later merges.
Compiled ahead of time, no GPU needed, in a subprocess without ``TRITON_INTERPRET`` (as test_core_kernel_compile).
The negative control: with ``TRACE=True`` the SASS differs and has more global stores (``STG``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    import kernel_untraced
    from flashattn_teach.core import kernel
    from flashattn_teach.tools.kernels.specialize import capture

    def sass(launch):
        with capture("sm90") as requests:
            launch()
        (request,) = requests
        return request.compile().asm["sass"]

    q = torch.randn(1, 2, 200, 64, dtype=torch.float16)
    k, v = torch.randn(1, 2, 130, 64, dtype=torch.float16), torch.randn(1, 2, 130, 64, dtype=torch.float16)
    trace = torch.empty(kernel.trace_shape(200, 130, 64, 64, 64), dtype=torch.float32)
    for causal in (False, True):
        old = sass(lambda: kernel_untraced.triton_forward(q, k, v, causal))
        off = sass(lambda: kernel.triton_forward(q, k, v, causal))
        on = sass(lambda: kernel.triton_forward(q, k, v, causal, trace=trace))
        print(causal, off == old, on != old, old.count("STG"), on.count("STG"))
    """
)


def test_the_forward_without_trace_compiles_to_the_same_sass_as_before() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent / "fixtures"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split()[:3] for line in lines] == [[str(c), "True", "True"] for c in (False, True)], lines
    for line in lines:
        stores_before, stores_traced = map(int, line.split()[3:])
        assert 0 < stores_before < stores_traced, line
