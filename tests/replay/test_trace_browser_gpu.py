"""The GPU schedule view in a real headless Chromium: at every step, each program's drawn state (grid cell and
timeline bar) is the one the payload's start and end give at the step's time (Python's rule,
``gpu_schedule.Program.state``), stepping by button and by key, for the teaching example causal and not."""

from __future__ import annotations

import json

import pytest
import torch

from flashattn_teach.replay import replay
from flashattn_teach.replay.gpu_schedule import GpuOptions, ProgramState, build, gpu_launches
from flashattn_teach.replay.html import render_html

READ = """(() => ({
  counter: document.getElementById("gpu-counter").textContent,
  time: Number(document.getElementById("view-gpu").dataset.time),
  visible: !document.getElementById("view-gpu").hidden,
  launches: Object.fromEntries([...document.querySelectorAll("#view-gpu .gpu-launch")].map(box => [
    box.dataset.order, {
      cells: Object.fromEntries([...box.querySelectorAll(".gpu-program")].map(c => [c.dataset.pid, c.dataset.state])),
      bars: Object.fromEntries([...box.querySelectorAll("svg.gpu-timeline g")].map(
        g => [g.dataset.pid, g.getAttribute("class")])),
      status: box.querySelector(".gpu-status").textContent,
      slots: box.querySelectorAll("svg.gpu-timeline > text:not(.tick)").length,
    }])),
  payload: JSON.parse(document.getElementById("view-data").textContent).gpu,
}))()"""


def teaching(causal: bool):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    return replay(q, k, v, block_m=2, block_n=2, causal=causal)


@pytest.mark.parametrize(("causal", "options"), [(True, {}), (False, {}), (True, {"gpu_sms": 3, "gpu_heads": 2})])
def test_gpu_view_states_follow_the_payload_at_every_step(causal, options, browser, tmp_path, artifacts):
    r = teaching(causal)
    page_path = tmp_path / "gpu.html"
    page_path.write_text(render_html(r, open_view="gpu", **options), encoding="utf-8")
    browser.open(page_path)
    page = browser.evaluate(READ)
    payload = page["payload"]
    assert page["visible"]
    launches = {la["order"]: la for la in payload["launches"]}
    # Python's own launches, from the objects the payload was built from
    programs = {
        name: la.programs
        for name, la in zip(("index", "longest"), gpu_launches(r, GpuOptions.of(options)), strict=True)
    }
    times = payload["times"]
    assert len(times) >= 2 and times[0] == 0 and times[-1] == max(la["makespan"] for la in launches.values())
    for n, t in enumerate(times, start=1):
        if n > 1:
            if n % 2:
                browser.press("ArrowRight")
            else:
                browser.click("#gpu-next")
            page = browser.evaluate(READ)
        assert page["counter"] == f"Time {n} of {len(times)}"
        assert page["time"] == t
        assert set(page["launches"]) == set(launches)
        for name, la in launches.items():
            shown = page["launches"][name]
            want = {}
            for p, prog in zip(la["programs"], programs[name], strict=True):
                assert (p["start"], p["end"], p["slot"]) == (prog.run.start, prog.run.end, prog.run.slot)
                # from the payload alone: waiting before start, running while start <= t < end, then done
                state = "done" if p["end"] <= t else "running" if p["start"] <= t else "waiting"
                assert state == prog.state(t).value
                want[str(p["pid"])] = state
            assert shown["cells"] == want
            assert shown["bars"] == {pid: f"gpu-{s}" for pid, s in want.items()}
            running = sum(s == ProgramState.RUNNING.value for s in want.values())
            done = sum(s == ProgramState.DONE.value for s in want.values())
            assert shown["status"] == f"{running} running, {done} of {len(want)} done"
            assert shown["slots"] == payload["gpu"]["slots"]
    assert all(s == "done" for la in page["launches"].values() for s in la["cells"].values())
    tag = ("causal" if causal else "dense") + ("-" + "-".join(f"{k}{v}" for k, v in options.items()) if options else "")
    browser.screenshot(artifacts / f"replay-gpu-{tag}.png")
    browser.press("ArrowRight")  # past the end: stays
    assert browser.evaluate(READ)["counter"] == f"Time {len(times)} of {len(times)}"
    browser.click("#gpu-prev")
    assert browser.evaluate(READ)["time"] == times[-2]


def test_gpu_view_payload_is_the_builders(browser, tmp_path):
    """The page embeds exactly what the builder returns (no rounding on the way)."""
    r = teaching(True)
    page_path = tmp_path / "gpu.html"
    page_path.write_text(render_html(r, gpu_heads=3), encoding="utf-8")
    browser.open(page_path)
    assert browser.evaluate(READ)["payload"] == json.loads(json.dumps(build(r, {"gpu_heads": 3})))
    browser.click("#tab-gpu")
    assert browser.evaluate(READ)["visible"]
