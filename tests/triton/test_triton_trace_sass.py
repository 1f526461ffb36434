"""The production forward's trace build costs nothing when it is off: ``attn_fwd`` (triton/kernels/forward.py and
forward_inner.py) launched by ``launch.forward`` without a trace (``trace=None``, which Triton's JIT makes a
constant, and ``TRACE=False``) compiles for sm_90 to the same SASS as the kernel before the trace build, kept
verbatim in ``fixtures/forward_untraced.py`` and ``fixtures/forward_inner_untraced.py``.

The old kernel is launched by the same launcher, with the same arguments: the test puts it in the place of
``kernels.forward.attn_fwd`` (which ``launch.forward`` imports at each call) behind a stand-in that drops the two
trace arguments after checking they are off and spells the flags record ``F`` (:mod:`flashattn_teach.triton.flags`)
out as the old kernel's keywords. Cases: the pointer path (the one a trace build runs) plain, causal and with a
sliding window (a masked variant, its third stage), and the shipped sm_90 tile (TMA and warp
specialisation) plain. The negative control: the trace build (``TRACE=True``) of each pointer case differs and
has more global stores (``STG``). Why SASS, and why a copy rather than ``git show``: see
``tests/core/test_core_kernel_trace_sass.py``. Compiled ahead of time in one subprocess without
``TRITON_INTERPRET``, no GPU needed (about 10 compiles of a few seconds each)."""

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
    import forward_untraced
    from flashattn_teach._options import make_options
    from flashattn_teach.triton import launch
    from flashattn_teach.triton.configs import shipped_config
    from flashattn_teach.triton.forward_trace import forward_trace, trace_shape, traced_tile
    from flashattn_teach.triton.kernels import forward as kernel
    from flashattn_teach.triton.variants import KernelVariants
    from flashattn_teach.tools.kernels.specialize import capture

    class Untraced:
        def __getitem__(self, grid):
            run = forward_untraced.attn_fwd[grid]

            def launch_old(*args, trace, F, **kwargs):
                # the flags record spelt out as the old kernel's keywords, less the TRACE it does not take
                assert trace is None and F.TRACE is False
                flags = {name: value for name, value in F._asdict().items() if name != "TRACE"}
                return run(*args, **flags, **kwargs)

            return launch_old

    def sass(launch_it, old=False):
        saved = kernel.attn_fwd
        kernel.attn_fwd = Untraced() if old else saved
        try:
            with capture("sm90") as requests:
                launch_it()
        finally:
            kernel.attn_fwd = saved
        (request,) = requests
        return request.compile().asm["sass"]

    q = torch.zeros(1, 2, 200, 64, dtype=torch.float16)
    k = v = torch.zeros(1, 2, 130, 64, dtype=torch.float16)
    shipped = shipped_config(64, torch.float16, "sm90")  # the tried and untried paths: TMA, warp specialisation
    pointers = dataclasses.replace(shipped, forward=shipped.forward.by_pointers())
    cases = [("plain", {}, pointers), ("causal", {"causal": True}, pointers), ("window", {"window": (32, 0)}, pointers)]
    cases.append(("shipped", {}, shipped))
    for name, kw, config in cases:
        opts = make_options(q, k, v, **kw)
        var = KernelVariants.from_spec(opts.mask, opts.dropout)

        def run(trace=None):
            launch.forward(
                q, k, v, opts.shapes, causal=opts.causal, causal_align="top_left", config=config, variants=var,
                trace=trace,
            )

        old, off = sass(run, old=True), sass(run)
        if config is shipped:
            print(name, off == old, "-", old.count("STG"), "-")
            continue
        shape = trace_shape(200, 130, 64, traced_tile(config, var, False))
        on = sass(lambda: run(forward_trace(torch.empty(shape), shape, h=1)))
        print(name, off == old, on != old, old.count("STG"), on.count("STG"))
    """
)


def test_the_production_forward_without_trace_compiles_to_the_same_sass_as_before() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent / "fixtures"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert [line[:3] for line in lines] == [
        ["plain", "True", "True"],
        ["causal", "True", "True"],
        ["window", "True", "True"],
        ["shipped", "True", "-"],
    ], lines
    for line in lines[:3]:
        stores_before, stores_traced = map(int, line[3:])
        assert 0 < stores_before < stores_traced, line
