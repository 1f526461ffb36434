"""The decode kernel's trace build costs nothing when it is off: ``decode_split_fwd`` with ``TRACE=False`` (and
``Trace=None``, which Triton's JIT makes a constant, not an argument) compiles for sm_90 to the same SASS as the
kernel before the trace build, kept verbatim in ``fixtures/decode_untraced.py``.

Two specialisations, launched through the real launcher (:func:`flashattn_teach.serving.launch.launch_decode`)
and captured ahead of time (:func:`flashattn_teach.tools.kernels.specialize.capture`, no GPU): a plain one-split
step (float16, grouped heads), and a causal step of four splits (bfloat16, two new queries). SASS, not the cubin:
the cubin carries the source's line table, which any edit moves. A copy of the old source, not ``git show``: the
test must mean the same on a clean clone and after later merges. The negative control: with ``TRACE=True`` the
SASS differs and has more global stores (``STG``)."""

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
    import decode_untraced
    from flashattn_teach.serving.launch import DecodeConfig, launch_decode
    from flashattn_teach.tools.kernels.specialize import capture
    from flashattn_teach.triton.kernels import decode
    from flashattn_teach.triton.kernels.trace_decode import DecodeTraceRecord

    traced = decode.decode_split_fwd

    class Untraced:  # the old kernel behind the launcher, which passes it Trace and TRACE
        def __getitem__(self, grid):
            def launch(*args, Trace=None, TRACE=False, **kwargs):
                return decode_untraced.decode_split_fwd[grid](*args, **kwargs)
            return launch

    def sass(launch, old=False):
        decode.decode_split_fwd = Untraced() if old else traced
        try:
            with capture("sm90") as requests:
                launch()
        finally:
            decode.decode_split_fwd = traced
        return requests[0].compile().asm["sass"]  # the split kernel (a combine follows with several splits)

    config = DecodeConfig(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3)
    cases = [
        (torch.float16, 1, False, 1),  # dtype, N_new, causal, num_splits
        (torch.bfloat16, 2, True, 4),
    ]
    for dtype, N_new, causal, splits in cases:
        q = torch.empty(2, 8, N_new, 128, dtype=dtype)
        k_cache, v_cache = (torch.empty(2, 2, 512, 128, dtype=dtype) for _ in range(2))
        seqlens = torch.full((2,), 300, dtype=torch.int32)
        trace = DecodeTraceRecord(torch.empty(splits, 8, N_new, 64 + 3 + 128), 0, 0, 8)

        def run(trace=None):
            kwargs = dict(causal=causal, scale=0.088, window=(-1, -1), softcap=None, alibi_slopes=None)
            launch_decode(q, k_cache, v_cache, seqlens, 0, num_splits=splits, config=config, trace=trace, **kwargs)

        old, off = sass(run, old=True), sass(run)
        on = sass(lambda: run(trace)) if splits == 1 else old  # the negative control once
        print(splits, off == old, on != old or splits > 1, old.count("STG"), on.count("STG"))
    """
)


def test_the_decode_kernel_without_trace_compiles_to_the_same_sass_as_before() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent / "fixtures"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split()[:3] for line in lines] == [["1", "True", "True"], ["4", "True", "True"]], lines
    stores_before, stores_traced = map(int, lines[0].split()[3:])
    assert 0 < stores_before < stores_traced, lines[0]
