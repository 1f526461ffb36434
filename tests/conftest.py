"""Test-wide setup: hypothesis profiles, and the Triton interpreter on machines without CUDA.

``TRITON_INTERPRET=1`` must be in the environment before any ``@triton.jit`` kernel is defined, so it is
set here, at collection time, and only when no CUDA GPU is present. Nothing here initialises CUDA:
``torch.cuda.is_available()`` only asks the driver.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # a bare GPU machine may lack hypothesis; its GPU tests still run
    from hypothesis import HealthCheck, settings
except ImportError:
    settings = None

if settings is not None:
    settings.register_profile(
        "ci",
        max_examples=40,
        derandomize=True,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.register_profile("dev", max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
