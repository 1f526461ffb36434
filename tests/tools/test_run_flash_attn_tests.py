"""tools/run_flash_attn_tests.py on a made-up flash-attn checkout: a test file with the lines the script
changes (its imports, the device, the CUDA queries at import) and tests whose outcomes are known, so the counts
it prints can be checked against what the tests did. flash-attn's own file is not needed (nor fetched)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "run_flash_attn_tests.py"

TEST_FILE = """
import pytest
import torch
import torch.nn.functional as F
from flash_attn import (
    flash_attn_func,
    flash_attn_qkvpacked_func,
)
from flash_attn.bert_padding import pad_input
from flash_attn.flash_attn_interface import _get_block_size_n, USE_TRITON_ROCM

is_sm80 = torch.cuda.get_device_capability("cuda") == (8, 0)
big = torch.cuda.get_device_properties("cuda").total_memory > 16 * 2**30


@pytest.mark.parametrize("seqlen", [7, 300])
@pytest.mark.parametrize("causal", [False, True])
def test_layout(seqlen, causal):
    device = "cuda"
    q, k, v = (torch.randn(2, seqlen, 3, 8, device=device) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=causal)
    sdpa = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal)
    assert torch.allclose(out, sdpa.transpose(1, 2), atol=1e-5)
    assert is_sm80 and big and pad_input(1) == 1


def test_wrong_on_purpose():
    qkv = torch.randn(1, 5, 3, 2, 8, device="cuda")
    assert flash_attn_qkvpacked_func(qkv).shape == (1, 5, 3, 8)  # the shape is (1, 5, 2, 8): fails


def test_helper_enters_the_tensors_device():
    x = torch.ones(3)
    with torch.cuda.device(x.device.index):  # flash-attn's Triton rotary helper does this; index None on a CPU
        assert x.sum() == 3


def test_skips_itself():
    pytest.skip("flash-attn skips this one itself")


def test_private_extension():
    from flash_attn.flash_attn_interface import flash_attn_gpu

    flash_attn_gpu.fwd()
"""


@pytest.fixture
def checkout(tmp_path):
    repo = tmp_path / "flash-attention"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_flash_attn.py").write_text(TEST_FILE)
    (repo / "flash_attn").mkdir()
    (repo / "flash_attn" / "__init__.py").write_text("raise ImportError('the CUDA extension is not built')\n")
    (repo / "flash_attn" / "bert_padding.py").write_text("def pad_input(x):\n    return x\n")
    return repo


def _run(checkout, work, *args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [sys.executable, str(SCRIPT), "--flash-attn-repo", str(checkout), "--work-dir", str(work), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)


def test_the_script_counts_what_the_tests_did(checkout, tmp_path):
    done = _run(checkout, tmp_path / "work")
    assert "passed 5, failed 1, skipped 2, deselected 0" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 1  # a case failed
    assert re.search(r"1 skipped: needs flash-attn's CUDA extension internals \(.*flash_attn_gpu", done.stdout)
    assert "1 skipped: flash-attn skips this one itself" in done.stdout
    changed = (tmp_path / "work" / "test_flash_attn.py").read_text()
    assert "from flashattn_teach.flash_attn_interface import (" in changed
    assert "from flashattn_teach.flash_attn_interface import _get_block_size_n" in changed
    assert '"cuda"' not in changed
    assert not (checkout / "tests" / "counts.json").exists()  # the checkout is read, never written


def test_max_seqlen_and_selection_deselect_and_count(checkout, tmp_path):
    done = _run(checkout, tmp_path / "work", "--max-seqlen", "100", "--", "-k", "layout")
    assert "passed 2, failed 0, skipped 0, deselected 6" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0


def test_a_file_the_rewrites_do_not_fit_is_refused(checkout, tmp_path):
    path = checkout / "tests" / "test_flash_attn.py"
    path.write_text(path.read_text().replace('device = "cuda"', 'device = "cuda:0"'))
    done = _run(checkout, tmp_path / "work")
    assert done.returncode != 0 and "'device = \"cuda\"' not found in the test file" in done.stderr
