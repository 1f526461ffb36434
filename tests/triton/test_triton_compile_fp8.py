"""The FP8 forward compiles for sm_90 at every shipped head dim, without and with a window, softcap and ALiBi:
both products on the warpgroup MMA with e4m3 operands (``QGMMA...F32.E4M3.E4M3`` in the SASS), no spills,
registers and shared memory within the limits.

Compiled ahead of time (no GPU needed) in a subprocess without ``TRITON_INTERPRET``, which this test
process has set; the checks are :mod:`flashattn_teach.tools.kernels.fp8`'s (six compiles, about 10 s).
"""

from __future__ import annotations

import importlib.util
import subprocess

import pytest

from flashattn_teach.triton.fp8 import fp8_head_dims
from sass_cache import AOT_PYTHON, aot_env

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_fp8_forward_compiles_to_e4m3_warpgroup_mmas_without_spills() -> None:
    env = aot_env()
    command = [*AOT_PYTHON, "-m", "flashattn_teach.cli", "kernels-fp8", "--variants"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-3000:]}"
    rows = [line.split() for line in done.stdout.splitlines()[2:]]
    assert {int(row[0]) for row in rows} == set(fp8_head_dims())
    assert len(rows) == 2 * len(fp8_head_dims()) and all(row[-1] == "ok" for row in rows), done.stdout
    for row in rows:
        assert any(cell.startswith("QGMMA.64x") for cell in row), done.stdout
