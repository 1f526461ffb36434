#!/usr/bin/env python
"""Run torch's own FlexAttention tests, and attention-gym's masks and mods, against flashattn_teach on the CPU.

Mode ``torch`` (the default) takes a checkout of torch's repository at the installed torch's tag (torch
2.13.0: ``v2.13.0``) and runs the cases of ``test/inductor/test_flex_attention.py`` (TestFlexAttention,
TestBlockMask, TestLearnableBiases) and ``test/inductor/test_flex_decoding.py`` (TestFlexDecoding)::

    python tools/run_torch_flex_tests.py --torch-repo ~/src/pytorch --out flex_cases.json

Nothing of torch's is copied into this repository; the test files are imported from the checkout as they
are, and three things change while they run:

1. The names a test module imports from ``torch.nn.attention.flex_attention``: ``create_block_mask``,
   ``BlockMask``, ``and_masks``, ``or_masks`` and ``noop_mask`` become this library's, so TestBlockMask
   tests this library's block masks. ``flex_attention`` becomes a switch (:func:`flex_attention`): outside
   ``torch.compile`` it is torch's eager ``flex_attention`` (the tests' reference, in the input dtype and
   in float64), inside it is ``flashattn_teach.flex_attention``.
2. ``torch.compile`` called from a test module returns :class:`LibraryCall`: the function run eagerly, its
   ``flex_attention`` calls going to this library. So each case is judged by torch's own rule: the
   tests compare the "compiled" output (this library's) with torch's eager output and float64 golden one.
3. The device is the CPU: ``CUDA_VISIBLE_DEVICES`` is emptied before torch is imported, and
   ``instantiate_device_type_tests`` instantiates every class for the CPU (TestBlockMask names only the GPU).

Each case counts as passed, failed (an assertion of the test), refused (this library raised
``BackendUnavailableError``: a feature it refuses by name), errors (any other exception) or skipped (the
test skipped itself, as those that need CUDA do, or raised an error that says it needs CUDA or that torch's
eager reference cannot run it on the CPU: :data:`CANNOT_RUN_HERE`). torch's expected failures count as
passed, as torch's own runner reports them. ``-k`` selects cases by substring, ``--classes`` by class;
``--resume`` skips the cases already in the ``.cases.jsonl`` file written beside ``--out`` as the run goes.

A test that calls ``flex_attention`` outside ``torch.compile`` and compares with nothing (an error it expects,
say) tests torch's eager function, not this library; torch's tests judge this library through their
compiled calls.

Mode ``gym`` takes a checkout of attention-gym and runs each function of ``attn_gym.masks`` and
``attn_gym.mods`` that makes a ``mask_mod`` or ``score_mod`` through ``flashattn_teach.flex_attention``
and torch's eager ``flex_attention``, both in float64, at a size under and a size over the 2^19 scores at
which the CPU path changes how it calls the functions::

    python tools/run_torch_flex_tests.py --mode gym --gym-repo ~/src/attention-gym --out gym_cases.json

torch's test modules import ``torch.testing._internal``, which needs the ``expecttest`` package, and its
``largeTensorTest`` (on TestFlexAttention and TestLearnableBiases) needs ``psutil``: without it every case of
those classes skips ("Need psutil to determine if memory is sufficient").
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import hashlib
import importlib.util
import json
import os
import re
import signal
import sys
import time
import unittest
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU only, decided before torch is imported

import torch
import torch.nn.attention.flex_attention as torch_flex

import flashattn_teach as fa
from flashattn_teach._options import from_torch
from flashattn_teach.errors import BackendUnavailableError

TEST_FILES = {
    "test_flex_attention": "test/inductor/test_flex_attention.py",
    "test_flex_decoding": "test/inductor/test_flex_decoding.py",
}
CLASS_FILES = {
    "TestFlexAttention": "test_flex_attention",
    "TestBlockMask": "test_flex_attention",
    "TestLearnableBiases": "test_flex_attention",
    "TestFlexDecoding": "test_flex_decoding",
}
OUTCOMES = ("passed", "failed", "refused", "errors", "skipped")

TORCH_FLEX_ATTENTION = torch_flex.flex_attention
TORCH_COMPILE = torch.compile

# ---------------------------------------------------------------- the substitution


_LIBRARY_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("library_call", default=False)
_TEST_MODULES: set[str] = set()


def to_torch_mask(block_mask: Any) -> Any:
    """This library's BlockMask as torch's, from the same index lists and ``mask_mod``, for torch's eager call."""
    if not isinstance(block_mask, fa.BlockMask):
        return block_mask
    return torch_flex.BlockMask.from_kv_blocks(
        block_mask.kv_num_blocks,
        block_mask.kv_indices,
        block_mask.full_kv_num_blocks,
        block_mask.full_kv_indices,
        BLOCK_SIZE=block_mask.BLOCK_SIZE,
        mask_mod=block_mask.mask_mod,
        seq_lengths=block_mask.seq_lengths,
    )


def to_library_mask(block_mask: Any) -> Any:
    """torch's BlockMask (from a torch helper the tests call, such as ``_create_empty_block_mask``) as this
    library's, for the library's call: the library's own conversion, which its public functions apply too."""
    return from_torch(block_mask)


def flex_attention(
    query: Any, key: Any, value: Any, score_mod: Any = None, block_mask: Any = None, *args: Any, **kwargs: Any
) -> Any:
    """The test modules' ``flex_attention``: this library's inside a "compiled" call, torch's eager outside.

    The remaining arguments go through as the test gave them, since the point is to pass torch's tests'
    calls unchanged to both functions."""
    if _LIBRARY_CALL.get():
        return fa.flex_attention(query, key, value, score_mod, to_library_mask(block_mask), *args, **kwargs)
    return TORCH_FLEX_ATTENTION(query, key, value, score_mod, to_torch_mask(block_mask), *args, **kwargs)


SUBSTITUTES: dict[str, Any] = {
    "flex_attention": flex_attention,
    "create_block_mask": fa.create_block_mask,
    "BlockMask": fa.BlockMask,
    "and_masks": fa.and_masks,
    "or_masks": fa.or_masks,
    "noop_mask": fa.noop_mask,
}


class LibraryCall:
    """What ``torch.compile(fn)`` returns in a test module: ``fn`` run eagerly, its ``flex_attention`` calls
    going to this library (no graph is traced, so tests that count compilations fail, as they should)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        token = _LIBRARY_CALL.set(True)
        try:
            return self.fn(*args, **kwargs)
        finally:
            _LIBRARY_CALL.reset(token)

    def __getattr__(self, name: str) -> Any:  # a compiled nn.Module keeps its attributes
        return getattr(self.fn, name)


def _compile(model: Any = None, **options: Any) -> Any:
    """``torch.compile`` for everyone: a :class:`LibraryCall` when a test module calls it, torch's otherwise
    (torch's eager ``flex_attention`` compiles its own helper with the eager backend)."""
    if sys._getframe(1).f_globals.get("__name__") not in _TEST_MODULES:
        return TORCH_COMPILE(model, **options) if model is not None else TORCH_COMPILE(**options)
    return LibraryCall if model is None else LibraryCall(model)


@contextlib.contextmanager
def substitution() -> Iterator[None]:
    """``torch.compile`` replaced while test modules are imported and run."""
    torch.compile = _compile  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = TORCH_COMPILE


@contextlib.contextmanager
def _replaced(module: ModuleType, values: dict[str, Any]) -> Iterator[None]:
    """``module``'s attributes ``values`` in place while a test module is executed, so its ``from ... import``
    binds them (module-level tables such as ``{_identity: noop_mask}`` included)."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(module, name, original)


def _on_cpu() -> contextlib.AbstractContextManager[None]:
    """torch's ``instantiate_device_type_tests`` made to instantiate every class for the CPU, whatever devices
    the test file names (it names only the GPU for TestBlockMask on a machine without one)."""
    try:
        import torch.testing._internal.common_device_type as device_type
    except ImportError:  # without expecttest; a test file that needs it fails to import, and says so
        return contextlib.nullcontext()
    instantiate = device_type.instantiate_device_type_tests

    def on_cpu(
        generic_test_class: type, scope: dict[str, Any], except_for: Any = None, only_for: Any = None, **options: Any
    ) -> Any:
        return instantiate(generic_test_class, scope, only_for=("cpu",), **options)

    return _replaced(device_type, {"instantiate_device_type_tests": on_cpu})


def load_test_module(path: Path, name: str) -> ModuleType:
    """Import torch's test file ``path`` as module ``name`` with the substitutes in place."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    _TEST_MODULES.add(name)
    sys.path.insert(0, str(path.parent))
    with _replaced(torch_flex, SUBSTITUTES), _on_cpu(), substitution():
        spec.loader.exec_module(module)
    for name_, substitute in SUBSTITUTES.items():
        if hasattr(module, name_):
            setattr(module, name_, substitute)
    if hasattr(module, "LONG_COMPILATION_ON_CPU"):
        module.LONG_COMPILATION_ON_CPU = False  # a skip for slow compilers; nothing is compiled here
    return module


# ---------------------------------------------------------------- running and counting


@dataclass
class CaseResult:
    """One case: ``id`` as ``Class.method``, ``cls`` its class before the device suffix."""

    id: str
    cls: str
    outcome: str
    first_line: str
    seconds: float


class CaseTimeout(Exception):
    """A case ran past ``--case-timeout``."""


def _raise_timeout(signum: int, frame: Any) -> None:
    raise CaseTimeout("ran past --case-timeout")


# Errors that say the case cannot run on this machine at all, whatever library answers: it calls CUDA's
# own API, or torch's eager reference (which the case compares against) refuses the CPU. Counted as skipped.
CANNOT_RUN_HERE = {
    "needs CUDA": ("Torch not compiled with CUDA enabled", "dummy base class CUDAGraph", "Found no NVIDIA driver"),
    "torch's eager reference cannot run on the CPU": ("FlexAttention does not support backward on CPU",),
}


def cannot_run_here(error: BaseException) -> str | None:
    """Why a case that raised ``error`` cannot run on this machine, or None."""
    text = str(error)
    for reason, phrases in CANNOT_RUN_HERE.items():
        if any(phrase in text for phrase in phrases):
            return reason
    return None


def _refused(error: BaseException | None) -> bool:
    """Whether this library refused the call by name (anywhere in the exception's chain)."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, BackendUnavailableError):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


ExcInfo = tuple[type[BaseException], BaseException, TracebackType]


class _OneCase(unittest.TestResult):
    """Keeps the outcome of one case and its exception (unittest keeps only the formatted traceback)."""

    def __init__(self) -> None:
        super().__init__()
        self.outcome = "passed"
        self.line = ""

    def _bad(self, err: ExcInfo, outcome: str) -> None:
        if self.outcome != "passed":
            return
        reason = cannot_run_here(err[1])
        if reason is not None:
            self.outcome, self.line = "skipped", f"{reason}: {first_line(err[1])}"[:300]
            return
        self.outcome = "refused" if _refused(err[1]) else outcome
        self.line = first_line(err[1])

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:  # unittest names these hooks
        self._bad(err, "failed")

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        self._bad(err, "errors")

    def addSubTest(self, test: unittest.TestCase, subtest: unittest.TestCase, err: Any) -> None:
        if err is not None:
            self._bad(err, "failed" if issubclass(err[0], test.failureException) else "errors")

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        self.outcome, self.line = "skipped", reason[:300]

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        self.outcome, self.line = "failed", "unexpected success of a test torch marks as an expected failure"


def run_case(test: unittest.TestCase, cls: str, timeout_s: int) -> CaseResult:
    result = _OneCase()
    start = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    signal.alarm(timeout_s)
    try:
        test(result)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return CaseResult(test.id().split(".", 1)[-1], cls, result.outcome, result.line, time.perf_counter() - start)


def device_class(module: ModuleType, cls: str) -> type[unittest.TestCase] | None:
    """The CPU instance of test class ``cls`` (``TestFlexAttentionCPU``) or the class itself."""
    for name in (f"{cls}CPU", cls):
        found = getattr(module, name, None)
        if isinstance(found, type) and issubclass(found, unittest.TestCase):
            return found
    return None


def selected(case_id: str, keywords: list[str]) -> bool:
    return not keywords or any(k.lower() in case_id.lower() for k in keywords)


def collect(module: ModuleType, classes: list[str], keywords: list[str]) -> list[tuple[str, unittest.TestCase]]:
    """The chosen cases of ``module``, as (base class name, test)."""
    loader = unittest.TestLoader()
    cases = []
    for cls in classes:
        test_class = device_class(module, cls)
        if test_class is None:
            continue
        for method in loader.getTestCaseNames(test_class):
            if selected(f"{test_class.__name__}.{method}", keywords):
                cases.append((cls, test_class(method)))
    return cases


def category(line: str) -> str:
    """A failure's first line with its numbers and quoted names blanked, to group like failures."""
    line = re.sub(r"0x[0-9a-f]+", "N", line)
    line = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", line)
    return line[:120]


def summarise(results: list[CaseResult], classes: list[str]) -> dict[str, Any]:
    counts = {cls: dict.fromkeys(OUTCOMES, 0) for cls in classes}
    for r in results:
        counts.setdefault(r.cls, dict.fromkeys(OUTCOMES, 0))[r.outcome] += 1
    total = {o: sum(c[o] for c in counts.values()) for o in OUTCOMES}
    categories: dict[str, dict[str, Any]] = {}
    for r in results:
        if r.outcome in ("failed", "errors", "refused"):
            entry = categories.setdefault(category(r.first_line), {"count": 0, "outcome": r.outcome, "example": r.id})
            entry["count"] += 1
    return {
        "counts": counts,
        "total": total,
        "categories": sorted(
            ({"category": k, **v} for k, v in categories.items()), key=lambda c: (-c["count"], c["category"])
        ),
        "not_passed": [
            {"id": r.id, "outcome": r.outcome, "first_line": r.first_line}
            for r in results
            if r.outcome not in ("passed",)
        ],
    }


def table(summary: dict[str, Any]) -> str:
    rows = [("class", *OUTCOMES, "total")]
    for cls, c in [*summary["counts"].items(), ("total", summary["total"])]:
        rows.append((cls, *(str(c[o]) for o in OUTCOMES), str(sum(c.values()))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    for c in summary["categories"][:15]:
        lines.append(f"{c['count']:5d}  {c['outcome']:8s} {c['category']}")
    return "\n".join(lines)


def _read_done(path: Path) -> list[CaseResult]:
    if not path.exists():
        return []
    return [CaseResult(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_torch_tests(
    files: dict[str, Path], classes: list[str], keywords: list[str], jsonl: Path, resume: bool, timeout_s: int
) -> list[CaseResult]:
    """Run the chosen cases, appending each result to ``jsonl`` as it is known."""
    done = _read_done(jsonl) if resume else []
    if not resume and jsonl.exists():
        jsonl.unlink()
    skip = {r.id for r in done}
    results = list(done)
    for stem in sorted({CLASS_FILES.get(cls, "") for cls in classes} & set(files)):
        module = load_test_module(files[stem], f"torchflex_{stem}")
        with substitution():
            for cls, test in collect(module, [c for c in classes if CLASS_FILES.get(c) == stem], keywords):
                case_id = test.id().split(".", 1)[-1]
                if case_id in skip:
                    continue
                result = run_case(test, cls, timeout_s)
                results.append(result)
                with jsonl.open("a") as f:
                    f.write(json.dumps(asdict(result)) + "\n")
                print(f"{result.outcome:8s} {result.seconds:6.1f}s {case_id}  {result.first_line[:100]}", flush=True)
    return results


# ---------------------------------------------------------------- attention-gym

# Each recipe builds (mask_mod, score_mod, N_q, N_k, H_q, H_kv) for a size N from one attn_gym function.
# Sizes: B=2, H=4 with N=64 is 2^15 scores (one call over every (b, h)); N=384 is 2^20.5 (one per (b, h)).
GYM_SIZES = (64, 384)
Recipe = Callable[[ModuleType, ModuleType, int], tuple[Any, Any, int, int, int, int]]


def _gym_recipes() -> dict[str, Recipe]:
    g = torch.Generator().manual_seed(0)

    def offsets(n: int) -> torch.Tensor:
        cuts = sorted({0, n // 5, n // 2, (3 * n) // 4, n})
        return torch.tensor(cuts, dtype=torch.int32)

    def grid(n: int) -> tuple[int, int]:
        return (8, n // 8)

    return {
        "masks.causal_mask": lambda m, d, n: (m.causal_mask, None, n, n, 4, 4),
        "masks.batchify_mask_mod": lambda m, d, n: (m.batchify_mask_mod(m.causal_mask, n // 4), None, n, n, 4, 4),
        "masks.generate_block_diffusion_mask": lambda m, d, n: (
            m.generate_block_diffusion_mask(n // 2, 8),
            None,
            n,
            n,
            4,
            4,
        ),
        "masks.generate_dilated_sliding_window": lambda m, d, n: (
            m.generate_dilated_sliding_window(16, 2),
            None,
            n,
            n,
            4,
            4,
        ),
        "masks.generate_doc_mask_mod": lambda m, d, n: (
            m.generate_doc_mask_mod(m.causal_mask, offsets(n)),
            None,
            n,
            n,
            4,
            4,
        ),
        "masks.generate_packed_causal_doc_mask_mod": lambda m, d, n: (
            m.generate_packed_causal_doc_mask_mod(offsets(n)),
            None,
            n,
            n,
            4,
            4,
        ),
        "masks.generate_vision_cross_attention_mask_mod": lambda m, d, n: (
            m.generate_vision_cross_attention_mask_mod(
                torch.tensor([[0, n // 2], [n // 4, n], [n // 2, n]], dtype=torch.int32), n // 6
            ),
            None,
            n,
            (n // 6) * 3,
            4,
            4,
        ),
        "masks.generate_global_sliding_window": lambda m, d, n: (
            m.generate_global_sliding_window(16, torch.arange(n) % 17 == 0),
            None,
            n,
            n,
            4,
            4,
        ),
        "masks.generate_jetspec_training_mask_mod": lambda m, d, n: (
            m.generate_jetspec_training_mask_mod(n // 2, 8),
            None,
            n,
            n,
            4,
            4,
        ),
        "masks.generate_jetspec_tree_causal_mask_mod": lambda m, d, n: (
            m.generate_jetspec_tree_causal_mask_mod(
                n - 8, m.build_tree_ancestor_matrix([-1, 0, 0, 1, 1, 2, 3, 3], device="cpu")
            ),
            None,
            8,
            n,
            4,
            4,
        ),
        "masks.generate_natten": lambda m, d, n: (m.generate_natten(*grid(n), 3, 5), None, n, n, 4, 4),
        "masks.generate_tiled_natten": lambda m, d, n: (
            m.generate_tiled_natten(*grid(n), 3, 5, 4, 4),
            None,
            n,
            n,
            4,
            4,
        ),
        "masks.generate_morton_natten": lambda m, d, n: (m.generate_morton_natten(*grid(n), 3, 5), None, n, n, 4, 4),
        "masks.generate_prefix_lm_mask": lambda m, d, n: (m.generate_prefix_lm_mask(n // 3), None, n, n, 4, 4),
        "masks.generate_shared_prefix_mask_mod": lambda m, d, n: (
            m.generate_shared_prefix_mask_mod(offsets(n), torch.tensor([0, 0, 0, 3][: len(offsets(n)) - 1])),
            None,
            n,
            n,
            4,
            4,
        ),
        "masks.generate_sliding_window": lambda m, d, n: (m.generate_sliding_window(16), None, n, n, 4, 4),
        "masks.generate_sta_mask_mod_2d": lambda m, d, n: (
            m.generate_sta_mask_mod_2d(canvas_hw=grid(n), kernel_hw=(4, 4), tile_hw=(4, 4)),
            None,
            n,
            n,
            4,
            4,
        ),
        "masks.generate_sta_mask_mod_3d": lambda m, d, n: (
            m.generate_sta_mask_mod_3d(canvas_twh=(4, 4, n // 16), kernel_twh=(4, 4, 4), tile_twh=(2, 2, 2)),
            None,
            n,
            n,
            4,
            4,
        ),
        "masks.generate_spatial_head_mask_mod": lambda m, d, n: (
            m.generate_spatial_head_mask_mod(4, 6, (n - 4) // 6, 2, True, 4),
            None,
            n,
            n,
            4,
            4,
        ),
        "masks.generate_temporal_head_mask_mod": lambda m, d, n: (
            m.generate_temporal_head_mask_mod(4, 6, (n - 4) // 6, 2),
            None,
            n,
            n,
            4,
            4,
        ),
        "mods.generate_activation_score_mod": lambda m, d, n: (None, d.generate_activation_score_mod(), n, n, 4, 4),
        "mods.generate_alibi_bias": lambda m, d, n: (None, d.generate_alibi_bias(4), n, n, 4, 4),
        "mods.generate_graphormer_spatial_bias": lambda m, d, n: (
            None,
            d.generate_graphormer_spatial_bias(
                torch.randn(4, 6, generator=g, dtype=torch.float64),
                torch.randint(0, 6, (2, n, n), generator=g),
            ),
            n,
            n,
            4,
            4,
        ),
        "mods.generate_graphormer_edge_bias": lambda m, d, n: (
            None,
            d.generate_graphormer_edge_bias(
                torch.randn(4, 3, 5, generator=g, dtype=torch.float64),
                torch.randint(0, 5, (2, n, n, 3), generator=g),
                torch.randint(0, 4, (2, n, n), generator=g),
            ),
            n,
            n,
            4,
            4,
        ),
        "mods.generate_mla_rope_score_mod": lambda m, d, n: (
            None,
            d.generate_mla_rope_score_mod(
                torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64),
                torch.randn(2, 1, n, 8, generator=g, dtype=torch.float64),
                4,
                0.5,
            ),
            n,
            n,
            4,
            1,
        ),
        "mods.generate_sandwich_bias": lambda m, d, n: (None, d.generate_sandwich_bias(4, n, 16), n, n, 4, 4),
        "mods.generate_tanh_softcap": lambda m, d, n: (None, d.generate_tanh_softcap(20), n, n, 4, 4),
        "mods.generate_tanh_softcap_approx": lambda m, d, n: (
            None,
            d.generate_tanh_softcap(20, approx=True),
            n,
            n,
            4,
            4,
        ),
    }


def gym_case(recipe: Recipe, masks: ModuleType, mods: ModuleType, n: int) -> tuple[str, str]:
    """(outcome, first line) of one attn_gym function at size ``n``: this library against torch's eager
    ``flex_attention``, both in float64, judged by ``torch.testing.assert_close``'s float64 tolerances."""
    B, D = 2, 16
    try:
        mask_mod, score_mod, n_q, n_k, h_q, h_kv = recipe(masks, mods, n)
    except AttributeError as error:  # an older or newer attention-gym without this function
        return "skipped", "not in this attention-gym: " + first_line(error)
    try:
        g = torch.Generator().manual_seed(n)
        q = torch.randn(B, h_q, n_q, D, generator=g, dtype=torch.float64)
        k, v = (torch.randn(B, h_kv, n_k, D, generator=g, dtype=torch.float64) for _ in range(2))
        torch_mask = (
            None if mask_mod is None else torch_flex.create_block_mask(mask_mod, B, h_q, n_q, n_k, device="cpu")
        )
        expected = TORCH_FLEX_ATTENTION(q, k, v, score_mod, torch_mask, enable_gqa=h_q != h_kv)
    except Exception as error:  # torch's own call failing is no verdict on this library
        return "skipped", "torch's eager flex_attention: " + first_line(error)
    try:
        ours_mask = None if mask_mod is None else fa.create_block_mask(mask_mod, B, h_q, n_q, n_k, device="cpu")
        got = fa.flex_attention(q, k, v, score_mod, ours_mask, enable_gqa=h_q != h_kv)
        torch.testing.assert_close(got, expected)
    except AssertionError as error:
        return "failed", first_line(error)
    except Exception as error:
        return ("refused" if _refused(error) else "errors"), first_line(error)
    return "passed", ""


def run_gym(gym_repo: Path, keywords: list[str], jsonl: Path) -> list[CaseResult]:
    sys.path.insert(0, str(gym_repo))
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    import attn_gym.masks as masks
    import attn_gym.mods as mods

    if jsonl.exists():
        jsonl.unlink()
    results = []
    for name, recipe in _gym_recipes().items():
        for n in GYM_SIZES:
            case_id = f"{name}[N={n}]"
            if not selected(case_id, keywords):
                continue
            start = time.perf_counter()
            outcome, line = gym_case(recipe, masks, mods, n)
            result = CaseResult(case_id, f"attn_gym.{name.split('.')[0]}", outcome, line, time.perf_counter() - start)
            results.append(result)
            with jsonl.open("a") as f:
                f.write(json.dumps(asdict(result)) + "\n")
            print(f"{outcome:8s} {result.seconds:6.1f}s {case_id}  {line[:100]}", flush=True)
    return results


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("torch", "gym"), default="torch")
    parser.add_argument("--torch-repo", type=Path, help="checkout of torch's repository at the installed torch's tag")
    parser.add_argument(
        "--test-file",
        type=Path,
        action="append",
        default=[],
        help="a test file to use instead of the checkout's file of the same name (repeatable)",
    )
    parser.add_argument("--gym-repo", type=Path, help="checkout of attention-gym (mode gym)")
    parser.add_argument("--classes", default=",".join(CLASS_FILES), help="comma-separated test classes")
    parser.add_argument(
        "-k", dest="keywords", action="append", default=[], help="run cases whose id holds this (repeatable, any)"
    )
    parser.add_argument("--resume", action="store_true", help="skip the cases already in OUT's .cases.jsonl")
    parser.add_argument("--case-timeout", type=int, default=600, help="seconds one case may run (an error past it)")
    parser.add_argument(
        "--out", type=Path, default=Path("torch_flex_cases.json"), help="JSON with the counts and the failures"
    )
    args = parser.parse_args(argv)
    jsonl = args.out.with_suffix(".cases.jsonl")
    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    start = time.perf_counter()
    meta: dict[str, Any] = {"mode": args.mode, "torch": torch.__version__, "keywords": args.keywords}
    if args.mode == "gym":
        if args.gym_repo is None:
            parser.error("--mode gym needs --gym-repo")
        results = run_gym(args.gym_repo, args.keywords, jsonl)
        classes = ["attn_gym.masks", "attn_gym.mods"]
    else:
        unknown = [c for c in classes if c not in CLASS_FILES]
        if unknown:
            parser.error(f"unknown classes {unknown}: choose from {sorted(CLASS_FILES)}")
        files = {stem: args.torch_repo / rel for stem, rel in TEST_FILES.items()} if args.torch_repo else {}
        files.update({p.stem: p for p in args.test_file})
        missing = sorted({CLASS_FILES[c] for c in classes} - {s for s, p in files.items() if p.exists()})
        if missing:
            parser.error(f"no test file for {missing}: give --torch-repo or --test-file")
        needs_psutil = {"TestFlexAttention", "TestLearnableBiases"} & set(classes)
        if needs_psutil and importlib.util.find_spec("psutil") is None:
            print(
                f"warning: {sorted(needs_psutil)} need psutil: torch's largeTensorTest skips every case without it",
                file=sys.stderr,
            )
        meta["test_files"] = {s: {"path": str(p), "sha256": _sha256(p)} for s, p in files.items() if p.exists()}
        results = run_torch_tests(files, classes, args.keywords, jsonl, args.resume, args.case_timeout)
    summary = {**meta, **summarise(results, classes), "seconds": round(time.perf_counter() - start, 1)}
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(table(summary))
    print(f"{len(results)} cases in {summary['seconds']} s; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
