"""The 192 / 128 rows (a query/key head dim of two lane groups, 128 + 64) compile ahead of time for sm_90
and sm_80 without spills, and the split build does less tensor-core work per key-block iteration than the
same tile built with the head dim padded to 256 (the saving the split is for): 320 / 384 of it in the
forward (192 + 128 lanes against 256 + 128), 512 / 640 in the dQ pass, 640 / 768 in dK/dV. Counting MMA
instructions would not show it everywhere: dQ's split build issues as many, each narrower.

Compiling needs TRITON_INTERPRET unset, which this process has set: the compiles run in one subprocess
(thirteen kernels, under a minute on two cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest

from sass_cache import AOT_PYTHON, aot_env

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

KERNELS = ("forward", "backward_dkdv", "backward_dq")


def probe() -> dict:
    """Run without TRITON_INTERPRET: each shipped 192 / 128 kernel's resources, and the tensor-core FMAs an
    iteration of the split and the padded build of the sm_90 tiles."""
    import torch

    from flashattn_teach.tools.kernels.compile import compile_kernel
    from flashattn_teach.tools.kernels.specialize import sample_variants
    from flashattn_teach.triton.configs import shipped_config

    out: dict = {"rows": {}, "fmas": {}}
    for arch in ("sm90", "sm80"):
        config = shipped_config(192, torch.bfloat16, arch, head_dim_v=128)
        for name in KERNELS:
            c = config.kernel(name)
            for padded in (False, True) if arch == "sm90" else (False,):
                r = compile_kernel(name, arch, torch.bfloat16, 192, c, head_dim_v=128, padded=padded)
                if not padded:
                    out["rows"][f"{arch} {name} {c}"] = r.problems()
                if arch == "sm90":
                    profile = r.loop_profile()
                    assert profile is not None
                    out["fmas"].setdefault(name, {})["padded" if padded else "split"] = profile.mma_fmas
    # where warp specialisation cannot run, and the sm_80 row of calls with a window, softcap and ALiBi
    fallback = shipped_config(192, torch.bfloat16, "sm90", head_dim_v=128).forward.unspecialised()
    r = compile_kernel("forward", "sm90", torch.bfloat16, 192, fallback, head_dim_v=128)
    out["rows"][f"sm90 forward {fallback}"] = r.problems()
    config = shipped_config(192, torch.bfloat16, "sm80", head_dim_v=128, variants=True)
    for name in KERNELS:
        c = config.kernel(name)
        r = compile_kernel(name, "sm80", torch.bfloat16, 192, c, head_dim_v=128, variants=sample_variants())
        out["rows"][f"sm80 variants {name} {c}"] = r.problems()
    return out


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = aot_env()
    code = "import json, test_triton_split_head_dim_compile as t; print(json.dumps(t.probe()))"
    run = subprocess.run(
        [*AOT_PYTHON, "-c", code],
        env={**env, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_split_rows_compile_without_spills(compiled: dict) -> None:
    assert len(compiled["rows"]) == 3 * len(KERNELS) + 1
    assert {row: problems for row, problems in compiled["rows"].items() if problems} == {}


# the lanes each kernel's products run over, split / padded: forward S and PV; dQ S, dP and dQ; dK/dV S, dV,
# dP and dK
SAVING = {"forward": (192 + 128) / (256 + 128), "backward_dq": 512 / 640, "backward_dkdv": 640 / 768}


def test_split_build_does_less_tensor_core_work_per_iteration_than_padding_to_256(compiled: dict) -> None:
    for name in KERNELS:
        fmas = compiled["fmas"][name]
        assert fmas["split"] > 0 and fmas["split"] / fmas["padded"] == pytest.approx(SAVING[name]), (name, fmas)
