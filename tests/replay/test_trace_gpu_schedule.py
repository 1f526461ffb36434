"""The GPU schedule view's data (:mod:`flashattn_teach.replay.gpu_schedule`) and the plain-Python block scheduler
and grid it reads (:mod:`flashattn_teach.tools.scheduler`, :mod:`flashattn_teach.masks.grid`): a launch
computed by hand, the scheduler against a unit-time simulation written here, longest first never worse under
causal in the cases tried, the replay's tiles against the tile geometry, and the moved code against the
figures ``flashattn-teach kernels --schedule`` gave before it moved."""

from __future__ import annotations

import importlib.util
import itertools
import random
import subprocess
import sys

import pytest
import torch

from flashattn_teach.errors import AttentionValueError
from flashattn_teach.masks.grid import INDEX, LONGEST, PER_HEAD, LaunchShape, block_work, launch_work
from flashattn_teach.replay import replay
from flashattn_teach.replay.gpu_schedule import (
    FigureShape,
    GpuOptions,
    ProgramState,
    build,
    event_times,
    gpu_launches,
    launch,
    query_block_work,
    same_timeline,
)
from flashattn_teach.replay.html import render_html
from flashattn_teach.tools.scheduler import place, simulate


def teaching(causal: bool, n_q: int = 6, n_k: int = 6, block_m: int = 2, block_n: int = 2, **kw):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n_q, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(n_k, 4, generator=g, dtype=torch.float64) for _ in range(2))
    return replay(q, k, v, block_m=block_m, block_n=block_n, causal=causal, **kw)


def test_teaching_example_by_hand():
    """Causal, 3 query blocks of 1, 2, 3 tiles, 4 heads, 2 slots. Index order: works 1 2 3 1 2 3 1 2 3 1 2 3;
    slot 0 runs (0,0) 0-1, (2,0) 1-4, (2,1) 4-7, (2,2) 7-10, (2,3) 10-13; slot 1 the rest, ending at 11.
    Longest first: 3 3 3 3 2 2 2 2 1 1 1 1 in pairs, ending at 6, 10, 12. Ideal 24 / 2 = 12."""
    index, longest = gpu_launches(teaching(True))
    assert [(p.i, p.head) for p in index.programs] == [(i, h) for h in range(4) for i in range(3)]
    on_slot0 = [(p.i, p.head, p.run.start, p.run.end) for p in index.programs if p.run.slot == 0]
    assert on_slot0 == [(0, 0, 0, 1), (2, 0, 1, 4), (2, 1, 4, 7), (2, 2, 7, 10), (2, 3, 10, 13)]
    assert max(p.run.end for p in index.programs if p.run.slot == 1) == 11
    assert index.schedule.makespan == 13 and index.schedule.ideal == 12
    assert index.schedule.idle_fraction == pytest.approx(1 / 13)
    assert [p.i for p in longest.programs] == [2] * 4 + [1] * 4 + [0] * 4
    assert [p.run.end for p in longest.programs] == [3, 3, 6, 6, 8, 8, 10, 10, 11, 11, 12, 12]
    assert [p.run.wave for p in longest.programs] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert longest.schedule.makespan == 12 and longest.schedule.idle_fraction == 0
    # without a mask every program computes 3 tiles: both orders take 12 x 3 / 2 = 18
    assert [la.schedule.makespan for la in gpu_launches(teaching(False))] == [18, 18]


def test_the_page_is_told_when_the_two_orders_draw_the_same_bars():
    """Without a mask each program computes 3 tiles: both orders put 2 x 6 bars of length 3 end to end on the 2
    slots, only the programs differ; under causal, by hand above, the makespans (13, 12) differ."""
    dense = gpu_launches(teaching(False))
    bars = [(s, 3 * w, 3 * w + 3) for s in range(2) for w in range(6)]
    assert [sorted((p.run.slot, p.run.start, p.run.end) for p in la.programs) for la in dense] == [bars, bars]
    assert [(p.i, p.head) for p in dense[0].programs] != [(p.i, p.head) for p in dense[1].programs]
    assert same_timeline(dense) and build(teaching(False), {})["sameTimeline"] is True
    assert not same_timeline(gpu_launches(teaching(True))) and build(teaching(True), {})["sameTimeline"] is False


def _unit_time_schedule(work: list[int], slots: int) -> list[tuple[int, int, int]]:
    """An independent simulation: advance time one unit at a time; at each time the free slots, lowest
    first, take the next programs in order. ``(slot, start, end)`` per program."""
    busy_until, out, t, nxt = [0] * slots, [], 0, 0
    while nxt < len(work):
        for s in range(slots):
            if busy_until[s] <= t and nxt < len(work):
                out.append((s, t, t + work[nxt]))
                busy_until[s] = t + work[nxt]
                nxt += 1
        t += 1
    return out


@pytest.mark.parametrize("seed", range(40))
def test_scheduler_matches_a_unit_time_simulation(seed):
    rng = random.Random(seed)
    work = [rng.randint(1, 6) for _ in range(rng.randint(0, 14))]
    slots = rng.randint(1, 4)
    runs = place(work, slots)
    assert [(r.slot, r.start, r.end) for r in runs] == _unit_time_schedule(work, slots)
    for k, r in enumerate(runs):  # a program's wave counts the programs before it on its slot
        assert r.wave == sum(q.slot == r.slot for q in runs[:k])
    assert simulate(work, slots).makespan == max((r.end for r in runs), default=0)


@pytest.mark.parametrize(
    ("t_r", "heads", "slots"), list(itertools.product((2, 3, 4, 6, 8), (1, 2, 3, 4, 8), (1, 2, 3, 5, 8)))
)
def test_longest_first_is_never_worse_under_causal(t_r, heads, slots):
    shape = LaunchShape(1, heads, 4 * t_r, 4 * t_r, 16, causal=True)
    work = block_work("forward", shape, 4, 4, with_prologue=False)
    assert work == [float(i + 1) for i in range(t_r)]
    index, longest = (launch(work, heads, order, slots, 4 * t_r, 64).schedule for order in (INDEX, LONGEST))
    assert longest.makespan <= index.makespan
    assert longest.ideal == index.ideal


@pytest.mark.parametrize(
    ("n_q", "n_k", "bm", "bn", "align"),
    [(6, 6, 2, 2, "top_left"), (7, 7, 3, 2, "top_left"), (4, 9, 2, 3, "bottom_right"), (9, 5, 2, 2, "top_left")],
)
@pytest.mark.parametrize("causal", [True, False])
def test_the_replays_tiles_are_the_tile_geometry(n_q, n_k, bm, bn, align, causal):
    r = teaching(causal, n_q, n_k, bm, bn, causal_align=align)
    shape = LaunchShape(1, 1, n_q, n_k, 4, causal, offset=r.diagonal_offset)
    assert query_block_work(r) == block_work("forward", shape, bm, bn, with_prologue=False)
    index, longest = gpu_launches(r, GpuOptions(heads=3, sms=2))
    if causal:
        assert longest.schedule.makespan <= index.schedule.makespan


# Recorded by `flashattn-teach kernels --schedule`'s functions (simulate(launch_work(...), 132)) before the simulation
# moved to flashattn_teach.masks: (D, N, kernel, (BLOCK_M, BLOCK_N)) -> the makespans of index, per-head and
# longest, and the ideal, at the benchmark's causal shapes (B = 16k / N, H = 2048 / D).
BEFORE = {
    (64, 1024, "forward", (128, 128)): ((176.0, 176.0, 171.0), 170.66666666666666),
    (64, 1024, "backward_dkdv", (64, 128)): ((416.0, 416.0, 406.0), 403.3939393939394),
    (64, 1024, "backward_dq", (128, 128)): ((192.0, 192.0, 187.0), 186.1818181818182),
    (64, 4096, "forward", (128, 128)): ((564.0, 561.0, 546.0), 543.030303030303),
    (64, 4096, "backward_dkdv", (64, 128)): ((1186.0, 1186.0, 1156.0), 1148.121212121212),
    (64, 4096, "backward_dq", (128, 128)): ((580.0, 576.5, 562.0), 558.5454545454545),
    (128, 1024, "forward", (128, 128)): ((91.0, 91.0, 87.0), 85.33333333333333),
    (128, 1024, "backward_dkdv", (64, 128)): ((214.0, 214.0, 204.0), 201.6969696969697),
    (128, 1024, "backward_dq", (128, 64)): ((198.0, 198.0, 189.0), 186.1818181818182),
    (128, 4096, "forward", (128, 128)): ((293.0, 290.0, 272.0), 271.5151515151515),
    (128, 4096, "backward_dkdv", (64, 128)): ((612.0, 612.0, 576.0), 574.060606060606),
    (128, 4096, "backward_dq", (128, 64)): ((601.0, 595.0, 560.0), 558.5454545454545),
}


@pytest.mark.parametrize(("key", "before"), BEFORE.items(), ids=str)
def test_the_moved_simulation_gives_the_figures_of_before(key, before):
    d, n, kernel, (bm, bn) = key
    shape = LaunchShape(16384 // n, 2048 // d, n, n, d, causal=True)
    got = [simulate(launch_work(kernel, shape, bm, bn, order), 132) for order in (INDEX, PER_HEAD, LONGEST)]
    makespans, ideal = before
    assert tuple(s.makespan for s in got) == makespans
    assert all(s.ideal == ideal for s in got)


def test_states_and_times():
    index, longest = gpu_launches(teaching(True))
    first = index.programs[2]  # (2, 0): slot 0 from 1 to 4
    assert [first.state(t) for t in (0, 1, 3.5, 4, 13)] == [
        ProgramState.WAITING,
        ProgramState.RUNNING,
        ProgramState.RUNNING,
        ProgramState.DONE,
        ProgramState.DONE,
    ]
    assert event_times((index, longest)) == [float(t) for t in range(14)]
    payload = build(teaching(True), {})
    assert payload["times"] == [float(t) for t in range(14)]
    assert payload["states"] == {s.name: s.value for s in ProgramState}
    assert payload["shapes"] == {s.name: s.value for s in FigureShape}  # page_gpu.js spells no shape itself
    assert {r["shape"] for r in payload["h100"]["rows"]} == {s.value for s in FigureShape}
    assert [la["order"] for la in payload["launches"]] == ["index", "longest"]
    h100 = {(r["shape"], r["causal"], r["order"]): r for r in payload["h100"]["rows"]}
    # 12 programs on 132 SMs: one partial wave, every program starts at 0, makespan = the longest program
    assert h100["replay", True, "index"]["makespan"] == h100["replay", True, "longest"]["makespan"] == 3
    assert h100["replay", False, "index"]["makespan"] == 3
    assert (h100["benchmark", True, "index"]["makespan"], h100["benchmark", True, "longest"]["makespan"]) == (564, 546)


def test_options_reach_the_builder_and_are_checked():
    payload = build(teaching(True), {"gpu_heads": 2, "gpu_sms": 3, "gpu_programs_per_sm": 2})
    assert payload["gpu"] == {"sms": 3, "programsPerSm": 2, "slots": 6}
    assert len(payload["launches"][0]["programs"]) == 3 * 2
    assert max(p["slot"] for p in payload["launches"][0]["programs"]) == 5  # 6 programs on 6 slots
    assert GpuOptions.of({"gpu_sms": 3, "other": 1}) == GpuOptions(heads=4, sms=3, programs_per_sm=1)
    for bad in ({"gpu_sms": 0}, {"gpu_heads": 17}, {"gpu_heads": True}, {"gpu_programs_per_sm": 1.5}):
        with pytest.raises(AttentionValueError, match="gpu_"):
            render_html(teaching(True), **bad)
    with pytest.raises(AttentionValueError, match="no option 'gpu_slots'"):
        render_html(teaching(True), gpu_slots=2)
    assert '"gpu"' in render_html(teaching(False), open_view="gpu")


def test_the_trace_package_does_not_import_triton():
    """Neither the triton library nor the kernels or triton.inspect (flashattn_teach.triton, the launchers, comes
    with the package's api, and with it the kernels' argument records, ``triton/kernels/records.py``: plain
    NamedTuples, no triton); the control runs the same probe after importing them."""
    probe = (
        "bad = sorted(m for m in sys.modules if m == 'triton' or m.startswith(('triton.', "
        "'flashattn_teach.tools.kernels', 'flashattn_teach.triton.kernels.')) "
        "and m != 'flashattn_teach.triton.kernels.records')\n"
    )
    code = (
        "import sys, torch\n"
        "from flashattn_teach.replay import replay\n"
        "from flashattn_teach.replay.html import render_html\n"
        "r = replay(torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 4), block_m=2, block_n=2, causal=True)\n"
        "render_html(r, open_view='gpu')\n" + probe + "assert not bad, bad\n"
        "import flashattn_teach.tools.kernels.waves\n" + probe + "assert bad, 'the probe saw nothing'\n"
    )
    if importlib.util.find_spec("triton") is not None:
        code += "import flashattn_teach.triton.kernels.grid\n" + probe + "assert 'triton' in bad, bad\n"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
