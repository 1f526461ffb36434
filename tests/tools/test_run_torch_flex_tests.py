"""The logic of tools/run_torch_flex_tests.py, on small made-up test modules instead of torch's (no network).

The made-up modules import FlexAttention's names from ``torch.nn.attention.flex_attention`` and call
``torch.compile`` as torch's test files do; each case does one known thing (passes, fails an assertion,
raises, is refused by name, skips itself, is one of torch's expected failures), so the script's
substitution and counts are checked against what the cases did.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

ATTENTION_MODULE = """
import unittest

import torch
import flashattn_teach
from flashattn_teach.errors import BackendUnavailableError
from torch.nn.attention.flex_attention import (
    BlockMask, and_masks, create_block_mask, flex_attention, noop_mask, or_masks,
)

TORCH_COMPILE_SEEN = torch.compile


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class TestFlexAttentionCPU(unittest.TestCase):
    def test_names_are_the_librarys(self):
        self.assertIs(create_block_mask, flashattn_teach.create_block_mask)
        self.assertIs(BlockMask, flashattn_teach.BlockMask)
        self.assertIs(and_masks, flashattn_teach.and_masks)
        self.assertIs(or_masks, flashattn_teach.or_masks)
        self.assertIs(noop_mask, flashattn_teach.noop_mask)

    def test_eager_is_torch_and_compiled_is_library(self):
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 130, 8, dtype=torch.float64) for _ in range(3))
        mask = create_block_mask(causal, 1, 1, 130, 130, device="cpu", BLOCK_SIZE=64)
        eager = flex_attention(q, k, v, block_mask=mask)
        compiled = torch.compile(flex_attention)(q, k, v, block_mask=mask)
        torch.testing.assert_close(compiled, eager)
        CALLS.append("done")

    def test_fails(self):
        self.assertEqual(1, 2, "one is not two")

    def test_raises(self):
        raise KeyError("no such key")

    def test_refused(self):
        raise BackendUnavailableError("feature X is refused: use Y")

    def test_needs_cuda(self):
        self.skipTest("needs CUDA")

    def test_calls_cuda(self):
        raise RuntimeError("Torch not compiled with CUDA enabled")

    @unittest.expectedFailure
    def test_torch_expects_failure(self):
        self.assertTrue(False)


class TestBlockMaskCPU(unittest.TestCase):
    def test_block_mask_passes(self):
        mask = create_block_mask(causal, 1, 1, 128, 128, device="cpu", BLOCK_SIZE=64)
        self.assertEqual(mask.to_dense().flatten().tolist(), [1, 0, 1, 1])


CALLS = []
"""

DECODING_MODULE = """
import unittest


class TestFlexDecoding(unittest.TestCase):
    def test_one_row(self):
        pass

    def test_two_rows(self):
        pass
"""


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import run_torch_flex_tests

    return run_torch_flex_tests


@pytest.fixture
def test_files(tmp_path):
    attention = tmp_path / "test_flex_attention.py"
    attention.write_text(textwrap.dedent(ATTENTION_MODULE))
    decoding = tmp_path / "test_flex_decoding.py"
    decoding.write_text(textwrap.dedent(DECODING_MODULE))
    return attention, decoding


def _run(script, test_files, out: Path, *extra: str) -> dict:
    attention, decoding = test_files
    code = script.main(["--test-file", str(attention), "--test-file", str(decoding), "--out", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


def test_counts_each_outcome_per_class(script, test_files, tmp_path):
    summary = _run(script, test_files, tmp_path / "out.json")
    counts = summary["counts"]
    assert counts["TestFlexAttention"] == {"passed": 3, "failed": 1, "refused": 1, "errors": 1, "skipped": 2}
    assert counts["TestBlockMask"] == {"passed": 1, "failed": 0, "refused": 0, "errors": 0, "skipped": 0}
    assert counts["TestFlexDecoding"] == {"passed": 2, "failed": 0, "refused": 0, "errors": 0, "skipped": 0}
    assert counts["TestLearnableBiases"] == dict.fromkeys(script.OUTCOMES, 0)
    assert summary["total"] == {"passed": 6, "failed": 1, "refused": 1, "errors": 1, "skipped": 2}
    lines = {case["id"]: (case["outcome"], case["first_line"]) for case in summary["not_passed"]}
    assert lines == {
        "TestFlexAttentionCPU.test_fails": ("failed", "AssertionError: 1 != 2 : one is not two"),
        "TestFlexAttentionCPU.test_raises": ("errors", "KeyError: 'no such key'"),
        "TestFlexAttentionCPU.test_refused": ("refused", "BackendUnavailableError: feature X is refused: use Y"),
        "TestFlexAttentionCPU.test_needs_cuda": ("skipped", "needs CUDA"),
        "TestFlexAttentionCPU.test_calls_cuda": (
            "skipped",
            "needs CUDA: RuntimeError: Torch not compiled with CUDA enabled",
        ),
    }


def test_compiled_calls_reach_the_library_and_eager_calls_torch(script, test_files, tmp_path, monkeypatch):
    """A spy on each side: the case's compiled call must reach flashattn_teach.flex_attention once, its
    eager call torch's once, and the case must still pass (the two agree in float64)."""
    import flashattn_teach

    calls: list[str] = []
    library, torchs = flashattn_teach.flex_attention, script.TORCH_FLEX_ATTENTION

    def library_spy(*args, **kwargs):
        calls.append("library")
        return library(*args, **kwargs)

    def torch_spy(*args, **kwargs):
        calls.append("torch")
        return torchs(*args, **kwargs)

    monkeypatch.setattr(flashattn_teach, "flex_attention", library_spy)
    monkeypatch.setattr(script, "TORCH_FLEX_ATTENTION", torch_spy)
    summary = _run(script, test_files, tmp_path / "out.json", "-k", "eager_is_torch")
    assert summary["total"]["passed"] == 1 and sum(summary["total"].values()) == 1
    assert calls == ["torch", "library"]


def test_torch_compile_and_torch_names_are_restored(script, test_files, tmp_path):
    import torch.nn.attention.flex_attention as torch_flex

    names = {name: getattr(torch_flex, name) for name in script.SUBSTITUTES}
    _run(script, test_files, tmp_path / "out.json", "-k", "names_are")
    assert torch.compile is script.TORCH_COMPILE
    assert {name: getattr(torch_flex, name) for name in script.SUBSTITUTES} == names


def test_keyword_and_classes_select_cases(script, test_files, tmp_path):
    summary = _run(script, test_files, tmp_path / "out.json", "--classes", "TestFlexDecoding", "-k", "two_rows")
    assert summary["counts"] == {
        "TestFlexDecoding": {"passed": 1, "failed": 0, "refused": 0, "errors": 0, "skipped": 0}
    }


def test_resume_runs_only_the_cases_not_yet_recorded(script, test_files, tmp_path):
    out = tmp_path / "out.json"
    _run(script, test_files, out, "--classes", "TestFlexDecoding", "-k", "one_row")
    first = (tmp_path / "out.cases.jsonl").read_text().splitlines()
    summary = _run(script, test_files, out, "--classes", "TestFlexDecoding", "--resume")
    lines = (tmp_path / "out.cases.jsonl").read_text().splitlines()
    assert lines[:1] == first and len(lines) == 2
    assert summary["total"]["passed"] == 2


def test_a_case_past_its_time_is_an_error(script, tmp_path):
    slow = tmp_path / "test_flex_decoding.py"
    slow.write_text(
        "import time, unittest\n\nclass TestFlexDecoding(unittest.TestCase):\n"
        "    def test_sleeps(self):\n        time.sleep(30)\n"
    )
    out = tmp_path / "out.json"
    assert (
        script.main(
            ["--test-file", str(slow), "--classes", "TestFlexDecoding", "--case-timeout", "1", "--out", str(out)]
        )
        == 0
    )
    summary = json.loads(out.read_text())
    assert summary["not_passed"] == [
        {
            "id": "TestFlexDecoding.test_sleeps",
            "outcome": "errors",
            "first_line": "CaseTimeout: ran past --case-timeout",
        }
    ]


def test_mask_conversions_keep_the_lists(script):
    import flashattn_teach

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 70

    ours = flashattn_teach.create_block_mask(window, 2, 1, 200, 260, device="cpu", BLOCK_SIZE=64)
    theirs = script.to_torch_mask(ours)
    back = script.to_library_mask(theirs)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(theirs, name), getattr(ours, name)), name
        assert torch.equal(getattr(back, name), getattr(ours, name)), name
    assert tuple(theirs.seq_lengths) == (200, 260) and tuple(back.seq_lengths) == (200, 260)
    assert torch.equal(theirs.to_dense(), ours.to_dense())


def test_device_classes_are_instantiated_for_the_cpu(script, tmp_path, monkeypatch):
    """torch's test file instantiates TestBlockMask for the GPU only on a machine without one; the script
    makes every instantiation the CPU's (a stand-in for torch's helper records what it was asked)."""
    import sys
    import types

    import torch.testing._internal

    asked: list[object] = []

    def instantiate(generic_test_class, scope, except_for=None, only_for=None, **options):
        asked.append(only_for)
        del scope[generic_test_class.__name__]
        if "cpu" in only_for:
            scope[generic_test_class.__name__ + "CPU"] = generic_test_class

    stand_in = types.ModuleType("torch.testing._internal.common_device_type")
    stand_in.instantiate_device_type_tests = instantiate
    monkeypatch.setitem(sys.modules, stand_in.__name__, stand_in)
    monkeypatch.setattr(torch.testing._internal, "common_device_type", stand_in, raising=False)
    module = tmp_path / "test_flex_attention.py"
    module.write_text(
        "import unittest\n"
        "from torch.testing._internal.common_device_type import instantiate_device_type_tests\n\n"
        "class TestBlockMask(unittest.TestCase):\n    def test_runs(self):\n        pass\n\n"
        'instantiate_device_type_tests(TestBlockMask, globals(), only_for=("cuda",))\n'
    )
    out = tmp_path / "out.json"
    assert script.main(["--test-file", str(module), "--classes", "TestBlockMask", "--out", str(out)]) == 0
    assert asked == [("cpu",)]
    assert json.loads(out.read_text())["counts"]["TestBlockMask"]["passed"] == 1
    assert stand_in.instantiate_device_type_tests is instantiate


def test_gym_mode_runs_each_function_at_both_sizes(script, tmp_path):
    """A stand-in attention-gym with two of its functions, written here from their definitions: each runs at
    both sizes against torch's eager flex_attention; the functions it lacks are skipped, not failed."""
    package = tmp_path / "gym" / "attn_gym"
    (package / "masks").mkdir(parents=True)
    (package / "mods").mkdir()
    (package / "__init__.py").write_text("")
    (package / "masks" / "__init__.py").write_text(
        "def causal_mask(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n"
    )
    (package / "mods" / "__init__.py").write_text(
        "def generate_alibi_bias(H):\n"
        "    def alibi(score, b, h, q_idx, kv_idx):\n"
        "        return score + (kv_idx - q_idx) * 2.0 ** (-8.0 * (h + 1) / H)\n"
        "    return alibi\n"
    )
    out = tmp_path / "gym.json"
    assert script.main(["--mode", "gym", "--gym-repo", str(tmp_path / "gym"), "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    ran = {case["id"] for case in summary["not_passed"] if case["outcome"] != "skipped"}
    assert ran == set()
    assert summary["total"]["passed"] == 2 * len(script.GYM_SIZES)
    assert summary["total"]["skipped"] == 2 * (len(script._gym_recipes()) - 2)
    assert all(c["first_line"].startswith("not in this attention-gym") for c in summary["not_passed"])
