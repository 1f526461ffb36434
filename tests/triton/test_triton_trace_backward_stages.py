"""The backward's trace build runs its dQ kernel in one pipeline stage: triton 3.6 (the GPU machine's) fails to
pipeline the traced dQ loop (``make_ttgir``: the TritonGPUPipeline pass), and a stage count changes the schedule,
not the arithmetic the trace records. The untraced launch keeps its configuration's stages. Captured, not compiled
(no GPU, no compiler), in a subprocess without ``TRITON_INTERPRET``, which the capture needs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import dataclasses
    import torch
    from flashattn_teach._validate.inputs import AttentionShapes
    from flashattn_teach.tools.kernels.specialize import capture
    from flashattn_teach.triton import launch
    from flashattn_teach.triton.trace_backward import BackwardTrace

    B, H, N, D = 1, 2, 256, 64
    s = AttentionShapes(batch=(B,), H_q=H, H_kv=H, N_q=N, N_k=N, D=D, D_v=D, rank=4, scale=D**-0.5)
    q, k, v, o, do = (torch.empty(B, H, N, D, dtype=torch.float16) for _ in range(5))
    row = launch.arch_config("sm90", torch.float16, s)
    tile = row.backward_dkdv
    config = dataclasses.replace(row, backward_dq=tile, backward_fused=tile)
    print(tile.num_stages)
    for trace in (BackwardTrace.allocate(s, tile.BLOCK_M, tile.BLOCK_N), None):
        with capture("sm90") as requests:
            launch.backward(q, k, v, o, torch.empty(B, H, N), do, None, s, causal=False, causal_align="top_left",
                            config=config, deterministic=True, trace=trace)
        (dq,) = [r for r in requests if r.name == "attn_bwd_dq"]
        print(dq.options.num_stages)
    """
)


def test_the_traced_dq_kernel_runs_one_stage_and_the_untraced_keeps_its_own() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shipped, traced, untraced = map(int, done.stdout.split())
    assert shipped > 1, "the shipped tile pipelines: otherwise this test checks nothing"
    assert (traced, untraced) == (1, shipped)
