"""CUDA graphs capture and replay the Triton paths: a training step's attention and a decode step
(``graph_cases.py`` has the checks, shared with ``benchmarks/gpu_checks.py``); skipped without CUDA. The CPU
side of the same property, that the host path reads no tensor's values, is ``test_triton_host_sync.py``."""

from __future__ import annotations

import graph_cases
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_a_captured_training_step_replays_new_inputs_as_eager_computes_them() -> None:
    graph_cases.check_training_step_replays()


def test_a_captured_decode_step_replays_new_inputs_as_eager_computes_them() -> None:
    graph_cases.check_decode_step_replays()
