"""core/kernel.py compiles for a GPU (sm_90), which the interpreter cannot show: ``tl.dot`` shapes, the constexpr
stages and the scalar arithmetic of the loop bounds all pass through Triton's compiler here. Ahead of time, no GPU
needed: a subprocess without ``TRITON_INTERPRET`` (which this process has set) records what the JIT would build
for sample launches (``flashattn_teach.tools.kernels.specialize.capture``) and compiles it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from flashattn_teach.core import kernel
    from flashattn_teach.tools.kernels.specialize import capture

    for causal in (False, True):
        q = torch.randn(1, 2, 200, 64, dtype=torch.float16)
        k, v = torch.randn(1, 2, 130, 64, dtype=torch.float16), torch.randn(1, 2, 130, 64, dtype=torch.float16)
        with capture("sm90") as requests:
            O, lse = kernel.triton_forward(q, k, v, causal)
            kernel.triton_backward(q, k, v, O, torch.randn_like(O), lse, causal)
        for r in requests:
            compiled = r.compile()
            print(causal, r.name, len(compiled.asm["ptx"]) > 0)
    """
)


def test_the_tutorial_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = ["_forward_kernel", "_delta_kernel", "_dkdv_kernel", "_dq_kernel"]
    assert done.stdout.splitlines() == [f"{causal} {name} True" for causal in (False, True) for name in kernels]
