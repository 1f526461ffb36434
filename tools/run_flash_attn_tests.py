"""Run flash-attn's own test file against ``flashattn_teach.flash_attn_interface`` on the CPU.

    python tools/run_flash_attn_tests.py --flash-attn-repo PATH [--work-dir DIR] [--sample N]
        [--max-seqlen L] [--seed S] [-- PYTEST_ARGS...]

``PATH`` is a checkout (or a copy) of flash-attn's repository (github.com/Dao-AILab/flash-attention). Its
``tests/test_flash_attn.py`` is copied to ``--work-dir`` (a new temporary folder by default; never this
repository) with these lines changed, each of which must be found:

    from flash_attn import (...)                      -> from flashattn_teach.flash_attn_interface import (...)
    from flash_attn.flash_attn_interface import ...   -> from flashattn_teach.flash_attn_interface import ...
                                                         (also those inside test functions)
    device = "cuda", device="cuda"                     -> "cpu"
    torch.cuda.get_device_capability("cuda")           -> (8, 0), so the file's sm80 checks all run
    torch.cuda.get_device_properties("cuda").total_memory   -> 80 GiB, so no case is skipped for memory

and run by pytest with this file as a plugin (``-p run_flash_attn_tests``), which serves the file's other
imports, flash-attn's test helpers ``flash_attn.bert_padding`` and ``flash_attn.layers.rotary``, from the
checkout's ``flash_attn/`` folder without its ``__init__`` (that one loads the CUDA extension), the rotary
kernel under ``TRITON_INTERPRET=1`` (with ``torch.cuda.device``, which that helper enters with a CPU tensor's
device index None, made a no-op on a machine without CUDA). A case that fails only because it reaches for
flash-attn's CUDA extension (an ``ImportError`` of a private name such as ``flash_attn_gpu``) or for CUDA
itself is counted as skipped, with that reason. ``--sample N`` keeps N cases of each test function, drawn
with ``--seed``; ``--max-seqlen L`` keeps the cases whose sequence lengths are all at most L (the full grid
holds about 509,000 cases, too many for a CPU). Needs einops and pytest. Prints the counts per test function and
exits 1 if a case failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import types
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent  # this repository: its src/ is the flashattn_teach the tests import
PLUGIN = "run_flash_attn_tests"
TEST_FILE = Path("tests") / "test_flash_attn.py"

# (what flash-attn's file says, what the run says instead); each must occur at least once.
REWRITES = (
    (r"^from flash_attn import \(", "from flashattn_teach.flash_attn_interface import ("),
    (r"^(\s*)from flash_attn\.flash_attn_interface import ", r"\1from flashattn_teach.flash_attn_interface import "),
    (r'device = "cuda"', 'device = "cpu"'),
    (r'device="cuda"', 'device="cpu"'),
    (r'torch\.cuda\.get_device_capability\("cuda"\)', "(8, 0)"),
    (r'torch\.cuda\.get_device_properties\("cuda"\)\.total_memory', "(80 * 2**30)"),
)
SEQLEN_PARAMS = ("seqlen", "seqlen_q", "seqlen_k")


def rewrite(source: str) -> tuple[str, dict[str, int]]:
    """flash-attn's test source with the imports and the device changed, and how often each rewrite applied.
    Raises ``SystemExit`` naming a rewrite that found nothing: the file changed, and the run would not be
    the one this script promises."""
    counts = {}
    for pattern, replacement in REWRITES:
        source, n = re.subn(pattern, replacement, source, flags=re.MULTILINE)
        if n == 0:
            raise SystemExit(f"run_flash_attn_tests.py: {pattern!r} not found in the test file; it has changed")
        counts[pattern] = n
    return source, counts


# ------------------------------------------------------------------------------------ the pytest plugin


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fa-repo", help="the flash-attn checkout whose flash_attn/ serves the test helpers")
    parser.addoption("--fa-sample", type=int, default=0, help="cases kept per test function (0: all)")
    parser.addoption("--fa-max-seqlen", type=int, default=0, help="largest sequence length kept (0: any)")
    parser.addoption("--fa-seed", type=int, default=0)
    parser.addoption("--fa-report", help="where to write the counts (JSON)")


def pytest_configure(config: pytest.Config) -> None:
    repo = config.getoption("--fa-repo")
    if repo:
        # flash_attn/ as a package without running its __init__, which imports the CUDA extension
        package = types.ModuleType("flash_attn")
        package.__path__ = [str(Path(repo) / "flash_attn")]
        sys.modules.setdefault("flash_attn", package)
    if not torch.cuda.is_available():
        # flash-attn's Triton rotary helper (the kvcache test's reference) enters torch.cuda.device(x.device.index);
        # a CPU tensor's index is None, which this torch cannot switch to: there is no device to switch
        torch.cuda.device = _no_device_switch
    config.stash[_COUNTS] = defaultdict(Counter)


def _no_device_switch(device: object) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


_COUNTS = pytest.StashKey[defaultdict]()


def _longest(item: pytest.Item) -> int:
    params = getattr(item, "callspec", None)
    values = [params.params[name] for name in SEQLEN_PARAMS if params and name in params.params]
    return max(values, default=0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    longest, sample = config.getoption("--fa-max-seqlen"), config.getoption("--fa-sample")
    kept = [item for item in items if not longest or _longest(item) <= longest]
    if sample:
        by_function: dict[str, list[pytest.Item]] = defaultdict(list)
        for item in kept:
            by_function[item.originalname].append(item)
        rng = random.Random(config.getoption("--fa-seed"))
        chosen = {id(i) for group in by_function.values() for i in rng.sample(group, min(sample, len(group)))}
        kept = [item for item in kept if id(item) in chosen]
    deselected = [item for item in items if item not in kept]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def pytest_deselected(items: list[pytest.Item]) -> None:
    if items:  # by -k, -m or the options above
        items[0].config.stash[_COUNTS]["(all)"]["deselected"] += len(items)


def unavailable(error: BaseException) -> str | None:
    """Why a failure is a missing feature rather than a wrong result: flash-attn's CUDA internals or CUDA."""
    text = str(error)
    if isinstance(error, ImportError) and "flashattn_teach.flash_attn_interface" in text:
        name = re.search(r"cannot import name '(\w+)'", text)
        return f"needs flash-attn's CUDA extension internals ({name.group(1) if name else text})"
    if "CUDA" in text and ("not compiled" in text or "NVIDIA driver" in text):
        return "needs CUDA"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = (yield).get_result()
    reason = unavailable(call.excinfo.value) if report.failed and call.excinfo is not None else None
    if reason is not None:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {reason}")
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        counts = item.config.stash[_COUNTS][getattr(item, "originalname", item.name)]
        counts[report.outcome] += 1
        if report.outcome == "skipped":
            skip_reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else "Skipped"
            skip_reason = skip_reason.removeprefix("Skipped: ")
            counts[
                f"skipped: {'(the test skips itself, without a reason)' if skip_reason == 'Skipped' else skip_reason}"
            ] += 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--fa-report")
    if path:
        counts = session.config.stash[_COUNTS]
        Path(path).write_text(json.dumps({name: dict(c) for name, c in counts.items()}, indent=1, sort_keys=True))


# ----------------------------------------------------------------------------------------------- the run


def totals(report: dict[str, dict[str, int]]) -> Counter:
    """passed, failed, skipped and deselected over every test function."""
    total: Counter = Counter()
    for counts in report.values():
        for outcome in ("passed", "failed", "skipped", "deselected"):
            total[outcome] += counts.get(outcome, 0)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flash-attn-repo", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, help="where the changed test file goes (default: a temp dir)")
    parser.add_argument("--sample", type=int, default=0, help="cases per test function (0: all)")
    parser.add_argument("--max-seqlen", type=int, default=0, help="largest sequence length kept (0: any)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (-x, -k EXPR, ...)")
    args = parser.parse_args(argv)

    source_file = args.flash_attn_repo / TEST_FILE
    if not source_file.is_file() or not (args.flash_attn_repo / "flash_attn" / "bert_padding.py").is_file():
        raise SystemExit(f"run_flash_attn_tests.py: {args.flash_attn_repo} is not a checkout of flash-attn")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="flash_attn_tests_"))
    work.mkdir(parents=True, exist_ok=True)
    source, counts = rewrite(source_file.read_text())
    (work / "test_flash_attn.py").write_text(source)
    (work / "pytest.ini").write_text("[pytest]\n")  # the run's root: no configuration of this repository
    report_path = work / "counts.json"
    for pattern, n in counts.items():
        print(f"rewrote {n:3d} x {pattern}")

    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), str(TOOLS), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "pytest", str(work / "test_flash_attn.py"), "-p", PLUGIN, "-p", "no:cacheprovider"]
    command += ["--rootdir", str(work), "--fa-repo", str(args.flash_attn_repo.resolve())]
    command += ["--fa-sample", str(args.sample), "--fa-max-seqlen", str(args.max_seqlen), "--fa-seed", str(args.seed)]
    command += ["--fa-report", str(report_path), *args.pytest_args]
    code = subprocess.run(command, cwd=work, env=env, check=False).returncode
    if not report_path.is_file():
        print(f"pytest exited {code} before any count was written")
        return 1
    report = json.loads(report_path.read_text())
    print(f"\n{'test function':48s} {'passed':>7s} {'failed':>7s} {'skipped':>8s}")
    for name, c in sorted(report.items()):
        if name != "(all)":
            print(f"{name:48s} {c.get('passed', 0):7d} {c.get('failed', 0):7d} {c.get('skipped', 0):8d}")
    reasons: Counter = Counter()
    for c in report.values():
        reasons.update({k: v for k, v in c.items() if k.startswith("skipped: ")})
    for reason, n in sorted(reasons.items()):
        print(f"  {n:6d} {reason}")
    t = totals(report)
    print(f"\npassed {t['passed']}, failed {t['failed']}, skipped {t['skipped']}, deselected {t['deselected']}")
    return 1 if t["failed"] or code not in (0, 5) else 0


if __name__ == "__main__":
    sys.exit(main())
