"""benchmarks/gpu_trace.py, the GPU suite's traced run, on a CPU: the same kernel in Triton's interpreter, float16.

It must write, per case, JSON whose every step carries the kernel's terms beside the reference's, with the
differences the kernel's arithmetic allows and no more; and refuse ``--device cuda`` where CUDA is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_trace.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600)


def test_the_traced_run_writes_the_kernels_numbers_beside_the_reference(tmp_path: Path) -> None:
    done = run("--device", "cpu", "--dtype", "float16", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    torch.manual_seed(0)
    _, _, v = (torch.randn(1, 48, 16) for _ in range(3))
    v_max = float(v.to(torch.float16).abs().max())
    for name, steps in (("forward-plain", 3), ("forward-causal", 3)):
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["replayKind"] == "forward" and len(record["cases"]) == steps, name
        for case in record["cases"]:
            terms = {t["name"]: t for t in case["kernel"]["terms"]}
            assert set(terms) == {"S_ij", "m_i", "l_i", "alpha", "acc_new"}
            l_max = max(terms["l_i"]["kernel"])
            # S_ij, m_i: an fp32 dot of the same fp16 operands, times log2(e) then ln(2): a few fp32 ulps of |S|
            for term in ("S_ij", "m_i", "alpha"):
                assert terms[term]["maxDiff"] <= 1e-5, (name, term, terms[term]["maxDiff"])
            # l_i: fp32 sums of exponentials in another order, relative error a few fp32 ulps a term
            assert terms["l_i"]["maxDiff"] <= 1e-5 * l_max, (name, terms["l_i"]["maxDiff"])
            # acc: P rounded to fp16 (relative 2^-11) before the MMA, so |acc_kernel - acc_ref| <= l_i max|v| 2^-11
            assert terms["acc_new"]["maxDiff"] <= 2**-11 * l_max * v_max * 1.01, (name, terms["acc_new"]["maxDiff"])
            # the columns are two computations, not one value written twice
            assert terms["acc_new"]["maxDiff"] > 0
        assert (tmp_path / f"{name}.txt").read_text().count("Kernel") >= steps
    summary = (tmp_path / "trace.txt").read_text()
    assert "forward-plain: S_ij" in summary and "ERROR" not in summary
    assert json.loads((tmp_path / "decode.json").read_text())["replayKind"] == "decode"
    (line,) = [x for x in summary.splitlines() if x.startswith("decode: ")]
    worst = {t: float(d) for t, d in (part.split() for part in line.removeprefix("decode: ").split(", "))}
    assert {"S_ij", "m_i", "l_i", "alpha", "acc_new", "O_partial", "O", "lse"} <= set(worst), worst
    for term, d in worst.items():
        if term.startswith("O"):  # normalised: weights summing to 1, each rounded to fp16 before the MMA
            assert d <= 2**-11 * v_max * 1.01, (term, d)
        elif term == "acc_new":  # unnormalised over one split's 16 keys: l_i <= 16
            assert d <= 2**-11 * 16 * v_max, (term, d)
        else:  # scores, statistics and lse: fp32 arithmetic on the same operands
            assert d <= 1e-5, (term, d)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_without_cuda_the_default_device_is_refused_by_name(tmp_path: Path) -> None:
    done = run("--out", str(tmp_path))
    assert done.returncode == 1
    assert "--device cpu --dtype float16" in done.stderr
    assert not list(tmp_path.iterdir())
