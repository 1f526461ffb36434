"""Which kernel paths have run on a GPU, and when; a path that replaced one that ran stays off by default.

The last GPU run was on 2026-11-30: an H200 with torch 2.11 and triton 3.6 ran the code of commit 9b23f1a
(``benchmarks/results/gpu/2026-11-30-h200-final``: 69 GPU tests passed, the benchmark timed). It ran the
forward through pointers and with its key/value blocks by TMA (descriptors made on the host), and the
two-kernel backward (dK/dV, then dQ) through pointers: plain calls (no variant, mask, dropout or packed
sequences) in float16, bfloat16 and float32 at head dims 40 to 256, causal and not, with grouped-query heads,
each head's query blocks started longest first under causal. Everything else in ``triton/`` landed after
that run, checked in the interpreter and compiled ahead of time, never run on a GPU (:data:`RUNS`).

Four of those paths took the place of one that ran, so they are off by default until a GPU run passes
them (issue 37) and a plain call runs what ran; each is chosen by an environment switch, read at every
call, or for one call through ``config=`` (an :class:`AttentionConfig` whose forward has ``ws=True``, with
a ``backward_fused`` tile, ``longest_first=True``, or backward tiles with ``tma=True``:
:func:`flashattn_teach.triton.configs.shipped_config` returns the table with all four, :func:`as_tried`
with those the switches allow)::

    path                          switch                               off by default, what runs instead
    warp-specialised forward      FLASHATTN_TEACH_WARP_SPECIALIZE=1    the forward by TMA (or pointers)
    one-kernel backward           FLASHATTN_TEACH_FUSED_BACKWARD=1     the two-kernel backward
    longest-first causal grid     FLASHATTN_TEACH_LONGEST_FIRST=1      each head's blocks, the longest first
    backward tiles by TMA         FLASHATTN_TEACH_BACKWARD_TMA=1       the same kernels through pointers

The one-kernel backward is off too although ``deterministic=True`` already reaches the two-kernel one: it
is the default a user would otherwise get, and triton 3.6's ptxas crashes compiling its hd64 build for a
one-query GQA step (issue 37). The other new paths (variants, masks, dropout, packed sequences, sinks, user
functions, the split head dim, FP8, the decode kernel) replaced no path that ran: they run, and ``explain``
says they have not run on a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..errors import AttentionValueError
from .configs import AttentionConfig


@dataclass(frozen=True)
class GpuRun:
    """One run of the GPU tests on a card, with the triton it compiled with and where its results are."""

    card: str
    date: str
    triton: str
    results: str

    def __str__(self) -> str:
        return f"ran on an {self.card} on {self.date} (triton {self.triton}, {self.results})"


H200_2026_11_30 = GpuRun("H200", "2026-11-30", "3.6", "benchmarks/results/gpu/2026-11-30-h200-final")

# path -> the last GPU run that ran it, or None: never
RUNS: dict[str, GpuRun | None] = {
    "forward through pointers": H200_2026_11_30,
    "forward by TMA": H200_2026_11_30,
    "warp-specialised forward": None,
    "two-kernel backward through pointers": H200_2026_11_30,
    "two-kernel backward by TMA": None,  # dQ's K_j, V_j or dK/dV's Q_i, dO_i by host-made descriptors
    "one-kernel backward": None,
    "per-head causal grid": H200_2026_11_30,
    "longest-first causal grid": None,
    "variants, masks, dropout, packed sequences, sinks or user functions": None,
    "split head dim": None,  # D = 129 to 192 as two lane groups
    "FP8 forward": None,
    "decode kernel": None,
}

# switch -> its environment variable
SWITCHES = {
    "warp_specialize": "FLASHATTN_TEACH_WARP_SPECIALIZE",
    "fused_backward": "FLASHATTN_TEACH_FUSED_BACKWARD",
    "longest_first": "FLASHATTN_TEACH_LONGEST_FIRST",
    "backward_tma": "FLASHATTN_TEACH_BACKWARD_TMA",
}
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def switched_on(name: str, asked: bool | None = None) -> bool:
    """Whether the path ``name`` (one of :data:`SWITCHES`) is on: ``asked`` where given, else its environment
    variable (off when unset)."""
    if asked is not None:
        return asked
    variable = SWITCHES[name]
    value = os.environ.get(variable, "").strip().lower()
    if value not in _ON + _OFF:
        raise AttentionValueError(
            f"{variable} must be 1 (on) or 0 (off), got {os.environ[variable]!r}: set {variable}=1 to try the "
            "path, or unset it"
        )
    return value in _ON


def as_tried(
    config: AttentionConfig,
    *,
    warp_specialize: bool | None = None,
    fused_backward: bool | None = None,
    longest_first: bool | None = None,
    backward_tma: bool | None = None,
) -> AttentionConfig:
    """``config`` without the paths no GPU has run, except those switched on (each keyword as
    :func:`switched_on`'s ``asked``): the forward unspecialised, no one-kernel backward tile, each head's
    blocks in the order that ran, the backward tiles through pointers."""
    if not switched_on("warp_specialize", warp_specialize):
        config = replace(config, forward=config.forward.unspecialised())
    if not switched_on("fused_backward", fused_backward):
        config = replace(config, backward_fused=None)
    if not switched_on("longest_first", longest_first):
        config = replace(config, longest_first=False)
    if not switched_on("backward_tma", backward_tma):
        dkdv, dq, fused = config.backward_dkdv, config.backward_dq, config.backward_fused
        config = replace(
            config,
            backward_dkdv=dkdv and dkdv.by_pointers(),
            backward_dq=dq and dq.by_pointers(),
            backward_fused=fused and fused.by_pointers(),
        )
    return config


def off_note(name: str) -> str:
    """For ``explain``: a path that is off because no GPU has run it, and how to try it."""
    what = {
        "warp_specialize": "warp-specialised forward",
        "fused_backward": "one-kernel backward",
        "longest_first": "longest-first causal grid",
        "backward_tma": "backward tiles by TMA",
    }[name]
    return (
        f"{what}: off by default until a GPU run passes the first light; set {SWITCHES[name]}=1 to try it "
        "(or pass config= for one call)"
    )


def ran_note(path: str) -> str:
    """For ``explain``: whether a path of :data:`RUNS` has run on a GPU, and when."""
    run = RUNS[path]
    return f"{path}: {run}" if run is not None else f"{path}: never run on a GPU"


def grid_note(config: AttentionConfig) -> str:
    """For ``explain`` of a causal call: the order its programs start in, and whether a GPU has run it."""
    if config.longest_first:
        return f"causal grid all heads' longest blocks first ({ran_note('longest-first causal grid')})"
    return (
        f"causal grid each head's blocks longest first ({ran_note('per-head causal grid')}); "
        f"{off_note('longest_first')}"
    )


def untried_note(names: list[str]) -> str:
    """For ``explain``: the options of a call whose kernel code no GPU has run (empty without them)."""
    return f"; never run on a GPU: {', '.join(names)}" if names else ""
