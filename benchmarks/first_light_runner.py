"""The first light's machinery: every case group in its own process, with a timeout per case, so that a hang,
a crash or a wrong answer is reported and the rest still runs.

A *cases module* (``benchmarks/first_light_cases.py``, or a test's fakes) holds the case list as data:
``GROUPS``, a list of :class:`Group`, and ``NEEDS_CUDA``. Importing it must not touch CUDA. A case's ``run``
takes no argument and returns

    a list of :class:`Error`     PASS if every ``err <= bound``, else FAIL (with the worst one)
    a dict of numbers            PASS, the numbers kept (a timing row)
    None                         PASS (a check with nothing to measure, such as a CUDA-graph replay)

and may raise :class:`Skip` (SKIP, with the reason), AssertionError (FAIL, with its message) or anything else
(ERROR, with the traceback's last lines).

The parent (:func:`run_groups`) starts ``python first_light_runner.py --cases-module M --group G`` in a new
session, its stdout and stderr in files, and reads the stdout file as it grows: the worker prints a START
line before each case and a RESULT line (JSON) after it. A case still running ``timeout_s`` after its START
was seen is a HANG: the whole process group is killed (SIGKILL) and the group's remaining cases start again
in a fresh process. A process that dies during a case (an ``os.abort()``, a segfault) makes that case an
ERROR, with the last lines of its output; the rest again start afresh. So does a case that raises a CUDA
error (an illegal memory access, :data:`STICKY`): it leaves the context broken for every later call in that
process, so the worker stops after it and the parent starts the rest in a fresh one. Several groups may run at once
(``jobs``: the precompile runs each case in its own process, many at a time). Whatever has not finished when
the part's budget runs out is a SKIP that says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
STATUSES = ("PASS", "FAIL", "ERROR", "HANG", "SKIP")
START, RESULT = "FIRSTLIGHT-START ", "FIRSTLIGHT-RESULT "
TAIL_LINES = 12  # lines of a dead or hung process's output kept in its case's report
# An exception whose text has one of these leaves the CUDA context broken for every later call in its process.
STICKY = ("CUDA error", "CUDA_ERROR", "cudaError", "illegal memory access", "device-side assert", "AcceleratorError")
STOPPED_AFTER_ERROR = 3  # a worker's exit status when it stops after an ERROR for the parent to restart it
STARTUP_S = 30.0  # seconds a fresh worker may take to import torch and the library before its first case


@dataclass(frozen=True)
class Error:
    """One output's largest error against float64 attention and the bound it must stay within."""

    output: str
    err: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.err <= self.bound  # False for NaN


class Skip(Exception):
    """Raised by a case that cannot run here (no FP8 on this card, a backend torch lacks): SKIP."""


@dataclass(frozen=True)
class Case:
    """One check: ``run()`` judged as the module docstring says; ``timeout_s`` after it starts, a HANG.
    ``warm``: what the precompile runs to compile the case's kernels (None: ``run`` itself); ``precompile``:
    whether it has any (torch's own kernels have none)."""

    name: str
    run: Callable[[], object]
    timeout_s: float = 30.0
    warm: Callable[[], object] | None = None
    precompile: bool = True


@dataclass(frozen=True)
class Group:
    """Cases that share a process. ``part``: "correctness" or "timings"; ``budget_s``: what the plan allows
    the group (the part's budget is the sum of its groups'); ``env``: environment variables set for its
    process (the warp-specialised rows run with FLASHATTN_TEACH_WARP_SPECIALIZE=1)."""

    name: str
    cases: tuple[Case, ...]
    budget_s: float
    part: str = "correctness"
    env: tuple[tuple[str, str], ...] = ()
    covers: str = ""


@dataclass
class Outcome:
    """What became of one case."""

    group: str
    case: str
    status: str
    seconds: float = 0.0
    detail: str = ""
    errors: list[dict[str, float | str]] = field(default_factory=list)
    data: dict[str, float | str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- the worker


def load_cases(ref: str) -> ModuleType:
    """A cases module by file path (``.../x.py``) or by dotted name."""
    if ref.endswith(".py"):
        path = Path(ref).resolve()
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise SystemExit(f"--cases-module {ref!r}: not a Python file that can be loaded")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(ref)


def judge(case: Case, run: Callable[[], object]) -> dict[str, object]:
    """Run one case and say what became of it, as the RESULT line's JSON."""
    t0 = time.perf_counter()
    out: dict[str, object] = {"case": case.name}
    try:
        result = run()
    except Skip as e:
        out.update(status="SKIP", detail=str(e))
    except AssertionError as e:
        out.update(status="FAIL", detail=str(e) or "assertion failed")
    except Exception as e:  # the exception first, then where it came from
        lines = traceback.format_exc().strip().splitlines()
        out.update(status="ERROR", detail="\n".join([f"{type(e).__name__}: {e}"[:400], *lines[-TAIL_LINES:]]))
    else:
        out["status"] = "PASS"
        if isinstance(result, dict):
            out["data"] = result
        elif result is not None:
            errors = [dataclasses.asdict(e) for e in result]
            out["errors"] = errors
            bad = [e for e in result if not e.ok]
            if bad:
                worst = max(bad, key=lambda e: e.err / e.bound if e.bound > 0 else float("inf"))
                out.update(status="FAIL", detail=f"{worst.output}: error {worst.err:.3g} > bound {worst.bound:.3g}")
    out["seconds"] = time.perf_counter() - t0
    return out


def worker(cases_module: str, group_name: str, only: Sequence[str], warm: bool) -> int:
    """Run the named cases of one group (all if ``only`` is empty), printing START and RESULT lines."""
    module = load_cases(cases_module)
    group = next(g for g in module.GROUPS if g.name == group_name)
    for case in group.cases:
        if only and case.name not in only:
            continue
        print("\n" + START + case.name, flush=True)  # on a line of its own, whatever the last case printed
        run = case.warm if warm and case.warm is not None else case.run
        result = judge(case, run)
        print("\n" + RESULT + json.dumps(result), flush=True)
        if result["status"] == "ERROR" and any(m in str(result["detail"]) for m in STICKY):
            return STOPPED_AFTER_ERROR  # a CUDA error is sticky: the rest of the group gets a fresh process
    return 0


# ---------------------------------------------------------------------------------------------- the parent


@dataclass
class _Job:
    """One worker process running ``cases`` (in order) of ``group``."""

    group: Group
    cases: list[Case]
    proc: subprocess.Popen
    stdout: Path
    stderr: Path
    started: float
    case_started: float | None = None  # when the parent first saw the current case's START
    idle_since: float = 0.0  # the process's start, or the last RESULT: when it should next print a START
    seen: int = 0  # RESULT lines read so far

    def lines(self) -> list[str]:
        return self.stdout.read_text(errors="replace").splitlines() if self.stdout.exists() else []

    def tail(self) -> str:
        text = [f"[stderr] {s}" for s in self.stderr.read_text(errors="replace").splitlines()[-TAIL_LINES:]]
        rest = [s for s in self.lines() if not s.startswith((START, RESULT))][-TAIL_LINES // 2 :]
        return "\n".join(rest + text)[-4000:]


class Runner:
    """Runs groups of one cases module, ``jobs`` processes at a time, until a deadline."""

    def __init__(
        self,
        cases_module: str,
        *,
        jobs: int = 1,
        warm: bool = False,
        python: str = sys.executable,
        progress: Callable[[Outcome], None] | None = None,
    ):
        self.cases_module = cases_module
        self.progress = progress
        self.jobs = jobs
        self.warm = warm
        self.python = python
        self.tmp = Path(tempfile.mkdtemp(prefix="first-light-"))
        self.count = 0
        self.warm_timeout_s = float("inf")  # set by run() to its budget

    def _start(self, group: Group, cases: list[Case]) -> _Job:
        self.count += 1
        stdout, stderr = self.tmp / f"{self.count}.out", self.tmp / f"{self.count}.err"
        cmd = [self.python, str(Path(__file__).resolve()), "--cases-module", self.cases_module, "--group", group.name]
        cmd += ["--only", *[c.name for c in cases]] + ["--warm"] * self.warm
        env = {**os.environ, **dict(group.env)}
        with open(stdout, "w") as out, open(stderr, "w") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        now = time.monotonic()
        return _Job(group, cases, proc, stdout, stderr, now, idle_since=now)

    def run(self, batches: Sequence[tuple[Group, list[Case]]], budget_s: float) -> list[Outcome]:
        """Every batch's cases, each batch in its own process (restarted after a fault), within ``budget_s``."""
        deadline = time.monotonic() + budget_s
        self.warm_timeout_s = budget_s
        queue = [(g, list(cs)) for g, cs in batches if cs]
        running: list[_Job] = []
        outcomes: dict[tuple[str, str], Outcome] = {}
        while queue or running:
            while queue and len(running) < self.jobs and time.monotonic() < deadline:
                running.append(self._start(*queue.pop(0)))
            if not running:
                break
            time.sleep(0.05)
            for job in list(running):
                rest = self._poll(job, outcomes, deadline)
                if rest is None:
                    continue
                running.remove(job)
                if rest:
                    queue.insert(0, (job.group, rest))
        for group, cases in queue:  # never started: the part's budget ran out first
            for c in cases:
                why = f"not run: the part's {budget_s:.0f} s budget was spent before it started"
                outcomes[(group.name, c.name)] = Outcome(group.name, c.name, "SKIP", detail=why)
        order = [(g.name, c.name) for g, cs in batches for c in cs]
        return [outcomes[k] for k in order if k in outcomes]

    def _poll(self, job: _Job, outcomes: dict[tuple[str, str], Outcome], deadline: float) -> list[Case] | None:
        """Read the job's new lines; None while it runs, else the cases it left to run (after a fault)."""
        now = time.monotonic()
        code = job.proc.poll()  # before reading: a process found ended has written all it will
        lines = job.lines()
        results = [json.loads(s[len(RESULT) :]) for s in lines if s.startswith(RESULT)]
        for r in results[job.seen :]:
            outcome = Outcome(
                job.group.name,
                r["case"],
                r["status"],
                r.get("seconds", 0.0),
                r.get("detail", ""),
                r.get("errors", []),
                r.get("data", {}),
            )
            outcomes[(job.group.name, r["case"])] = outcome
            if self.progress:
                self.progress(outcome)
            job.case_started, job.idle_since = None, now
        job.seen = len(results)
        started = sum(s.startswith(START) for s in lines)
        if started > job.seen and job.case_started is None:
            job.case_started = now
        current = job.cases[job.seen] if job.seen < len(job.cases) else None
        if code is not None and current is None:
            return []
        if code is None:
            if current is None:
                return None
            timeout = self._timeout(current)
            if job.case_started is not None and now - job.case_started > timeout:
                self._kill(job)
                detail = f"no answer within its {timeout:g} s timeout: the process group was killed"
                self._record(job, outcomes, "HANG", now, detail)
                return job.cases[job.seen :]
            wait = STARTUP_S if job.seen == 0 else timeout
            if job.case_started is None and now - job.idle_since > wait:
                self._kill(job)
                self._record(job, outcomes, "HANG", now, f"the worker did not start this case within {wait:g} s")
                return job.cases[job.seen :]
            if now > deadline:
                self._kill(job)
                self._record(job, outcomes, "SKIP", now, "cut: the part's budget ran out while it ran")
                return job.cases[job.seen :]  # left in the queue, and reported as not run
            return None
        # the process ended before answering its current case: it stopped after an ERROR, or it died
        if code == STOPPED_AFTER_ERROR and started == job.seen > 0:
            return job.cases[job.seen :]
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        if started == 0 and job.seen == 0:  # before its first case (an import that fails): no use restarting
            while job.seen < len(job.cases):
                self._record(job, outcomes, "ERROR", now, f"the worker died ({how}) before its first case")
            return []
        self._record(job, outcomes, "ERROR", now, f"the process died ({how}) during this case")
        return job.cases[job.seen :]

    def _record(self, job: _Job, outcomes: dict, status: str, now: float, detail: str) -> None:
        """The current case's outcome, decided by the parent; the job moves past it."""
        case = job.cases[job.seen]
        took = now - (job.case_started or job.idle_since)
        tail = job.tail()
        outcome = Outcome(job.group.name, case.name, status, took, detail + ("\n" + tail if tail else ""), [], {})
        outcomes[(job.group.name, case.name)] = outcome
        if self.progress:
            self.progress(outcome)
        job.seen += 1

    def _timeout(self, case: Case) -> float:
        """A case's hang detector. The precompile's cases, which only compile, are each alone in their process
        with many others compiling at once: they have the part's whole budget (a hang holds one slot)."""
        return self.warm_timeout_s if self.warm else case.timeout_s

    @staticmethod
    def _kill(job: _Job) -> None:
        try:
            os.killpg(job.proc.pid, signal.SIGKILL)  # the worker and anything it started (ptxas, ...)
        except ProcessLookupError:
            pass
        job.proc.wait()


def run_groups(
    cases_module: str,
    groups: Sequence[Group],
    budget_s: float,
    *,
    jobs: int = 1,
    warm: bool = False,
    progress: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Each group's cases in one process (restarted after a fault), ``jobs`` at a time, within ``budget_s``.
    With ``warm``, each case runs in a process of its own and its ``warm`` is run instead of ``run``.
    ``progress`` is called with each outcome as it is known."""
    runner = Runner(cases_module, jobs=jobs, warm=warm, progress=progress)
    if warm:
        batches = [(g, [c]) for g in groups for c in g.cases if c.precompile]
    else:
        batches = [(g, list(g.cases)) for g in groups]
    try:
        return runner.run(batches, budget_s)
    finally:
        shutil.rmtree(runner.tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A first-light worker: runs one group's cases (see the module doc).")
    p.add_argument("--cases-module", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--only", nargs="*", default=[])
    p.add_argument("--warm", action="store_true")
    args = p.parse_args(argv)
    return worker(args.cases_module, args.group, args.only, args.warm)


if __name__ == "__main__":
    # run as the module the cases import (first_light_runner), not as __main__: one Skip class, not two
    sys.path.insert(0, str(HERE))
    import first_light_runner

    raise SystemExit(first_light_runner.main())
