"""The backward's trace build costs nothing when it is off: ``attn_bwd_dkdv`` and ``attn_bwd_dq`` with ``TRACE=False``
(and ``row_stats.trace`` None, which Triton's JIT makes a constant, not an argument) compile for sm_90 to the same
SASS as the kernels before the trace build, kept verbatim in ``fixtures/backward_untraced/``.

Each kernel is compiled ahead of time from what ``launch.backward`` asks the JIT for (:func:`capture`, no GPU), the
old kernels put in the new ones' place for the same launch (they take no ``TRACE``). Why SASS and why a copy of the
old source: see tests/core/test_core_kernel_trace_sass.py. Cases: the two-kernel backward plain (the dK/dV and dQ
kernels), the one-kernel backward causal (dK/dV with atomic dQ partials), at the shipped sm_90 hd64 dK/dV tile
(64 x 128, 8 warps, 3 stages; the dQ kernel and the one-kernel backward given the same tile, so that one trace
buffer lays out both). The negative control: with ``TRACE=True`` the SASS differs and has more global stores
(``STG``). Eight compiles, about 60 s on a busy two-core machine."""

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
    import dataclasses
    import torch
    from backward_untraced import backward_dkdv as old_dkdv, backward_dq as old_dq
    from flashattn_teach._validate.inputs import AttentionShapes
    from flashattn_teach.tools.kernels.specialize import capture
    from flashattn_teach.triton import launch
    from flashattn_teach.triton.kernels import backward_dkdv, backward_dq
    from flashattn_teach.triton.trace_backward import BackwardTrace

    class Untraced:
        # the old kernel in the new one's place: the same launch, the flags record F spelt out as the old
        # kernel's keywords, less the TRACE it does not take
        def __init__(self, kernel):
            self.kernel = kernel
        def __getitem__(self, grid):
            def call(*args, F, **kwargs):
                assert F.TRACE is False
                flags = {name: value for name, value in F._asdict().items() if name != "TRACE"}
                return self.kernel[grid](*args, **flags, **kwargs)
            return call

    B, H, N, D = 1, 2, 256, 64
    s = AttentionShapes(batch=(B,), H_q=H, H_kv=H, N_q=N, N_k=N, D=D, D_v=D, rank=4, scale=D**-0.5)
    q, k, v, o, do = (torch.empty(B, H, N, D, dtype=torch.float16) for _ in range(5))
    lse = torch.empty(B, H, N)
    row = launch.arch_config("sm90", torch.float16, s)
    tile = row.backward_dkdv
    config = dataclasses.replace(row, backward_dq=tile, backward_fused=tile)

    def sass(causal, deterministic, old=False, trace=None):
        saved = backward_dkdv.attn_bwd_dkdv, backward_dq.attn_bwd_dq
        if old:
            backward_dkdv.attn_bwd_dkdv = Untraced(old_dkdv.attn_bwd_dkdv)
            backward_dq.attn_bwd_dq = Untraced(old_dq.attn_bwd_dq)
        try:
            with capture("sm90") as requests:
                launch.backward(q, k, v, o, lse, do, None, s, causal=causal, causal_align="top_left",
                                config=config, deterministic=deterministic, trace=trace)
        finally:
            backward_dkdv.attn_bwd_dkdv, backward_dq.attn_bwd_dq = saved
        return {r.name: r.compile().asm["sass"] for r in requests[1:]}  # after the preprocess

    before = {}
    for causal, deterministic in ((False, True), (True, False)):
        old, off = sass(causal, deterministic, old=True), sass(causal, deterministic)
        before[causal] = old
        for name in old:
            print("same", causal, deterministic, name, old[name] == off[name])
    on = sass(False, True, trace=BackwardTrace.allocate(s, tile.BLOCK_M, tile.BLOCK_N))
    old = before[False]
    for name in old:
        print("traced", name, on[name] != old[name], old[name].count("STG"), on[name].count("STG"))
    """
)


def test_the_backward_without_trace_compiles_to_the_same_sass_as_before() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent / "fixtures"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    same = [line[1:] for line in lines if line[0] == "same"]
    assert same == [
        ["False", "True", "attn_bwd_dkdv", "True"],
        ["False", "True", "attn_bwd_dq", "True"],
        ["True", "False", "attn_bwd_dkdv", "True"],  # the one-kernel backward: dQ by atomics, no dQ kernel
    ], lines
    traced = [line[1:] for line in lines if line[0] == "traced"]
    assert [t[:2] for t in traced] == [["attn_bwd_dkdv", "True"], ["attn_bwd_dq", "True"]], lines
    for _, _, stores_before, stores_traced in traced:
        assert 0 < int(stores_before) < int(stores_traced), lines
