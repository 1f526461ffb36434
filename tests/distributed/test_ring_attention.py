"""Ring attention across spawned processes on gloo, against the float64 dense oracle.

Starting a process group costs seconds, so each test module fixture spawns one group and runs many cases
inside it; the tests then read the results. Every rank rebuilds the full tensors from the case's seed and
computes the dense oracle itself, so the comparison needs no communication besides the ring's own.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ring_cases import Case, Errors, absent_rank, bad_calls, run_cases, run_world_and_subgroups
from _spawn import run_ranks, values

from flashattn_teach.distributed import RingMismatchError, RingTimeoutError

ROOT = Path(__file__).resolve().parents[2]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}

CASES_2 = [
    *(Case(layout, causal) for layout in ("contiguous", "zigzag") for causal in (False, True)),
    *(Case(layout, True, dtype=torch.float32, seed=1) for layout in ("contiguous", "zigzag")),
    Case("zigzag", False, dtype=torch.float32, B=2, seed=2),
    *(Case(layout, True, H_q=4, H_kv=2, D_v=5, seed=3) for layout in ("contiguous", "zigzag")),  # GQA
    Case("zigzag", True, H_q=3, H_kv=1, seed=4),  # MQA
    *(Case(layout, True, return_lse=True, seed=5) for layout in ("contiguous", "zigzag")),
    # tiles that do not divide N_local = 12 (nor the chunks of 6)
    *(Case(layout, True, block=(5, 7), return_lse=True, seed=6) for layout in ("contiguous", "zigzag")),
    Case("zigzag", False, dtype=torch.float32, block=(4, 5), H_q=4, H_kv=2, seed=7),
]
CASES_4 = [
    *(Case(layout, causal, N=64, seed=10) for layout in ("contiguous", "zigzag") for causal in (False, True)),
    Case("zigzag", True, N=32, dtype=torch.float32, H_q=4, H_kv=2, return_lse=True, seed=11),
    Case("contiguous", True, N=36, block=(4, 5), H_q=2, H_kv=1, return_lse=True, seed=12),
]
CASES_SUBGROUPS = [Case("zigzag", True, H_q=4, H_kv=2, return_lse=True, seed=13)]
# The fused kernels as the ring's local backend, forward and backward: on CPU tensors, so only in the
# Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA; spawned ranks inherit it).
TRITON_CASE = Case("zigzag", True, dtype=torch.float32, backend="triton", H_q=4, H_kv=2, D=16, D_v=16, N=16)
RUN_TRITON = importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"


def _all(results: list[list[Errors]]) -> list[Errors]:
    return [e for rank in results for e in rank]


@pytest.fixture(scope="module")
def two_ranks() -> list[list[Errors]]:
    return values(run_ranks(run_cases, 2, CASES_2 + ([TRITON_CASE] if RUN_TRITON else [])))


@pytest.fixture(scope="module")
def four_ranks_and_subgroups() -> list[tuple[list[Errors], list[Errors]]]:
    return values(run_ranks(run_world_and_subgroups, 4, CASES_4, CASES_SUBGROUPS))


@pytest.fixture(scope="module")
def four_ranks(four_ranks_and_subgroups) -> list[list[Errors]]:
    return [world for world, _ in four_ranks_and_subgroups]


def _assert_matches_oracle(errors: list[Errors]) -> None:
    for e in errors:
        tol = TOL[e.case.dtype]
        worst = max(e.O, e.lse, e.dq, e.dk, e.dv)
        assert worst <= tol, f"{e.case}: O {e.O:.1e} lse {e.lse:.1e} dq {e.dq:.1e} dk {e.dk:.1e} dv {e.dv:.1e}"


def test_ring_outputs_and_gradients_match_dense_oracle_on_2_ranks(two_ranks):
    _assert_matches_oracle(_all(two_ranks))


def test_ring_outputs_and_gradients_match_dense_oracle_on_4_ranks(four_ranks):
    _assert_matches_oracle(_all(four_ranks))


def test_ring_in_two_subgroups_at_once_matches_dense_oracle(four_ranks_and_subgroups):
    _assert_matches_oracle(_all([sub for _, sub in four_ranks_and_subgroups]))


def test_a_rank_alone_without_the_ring_differs_from_the_oracle(two_ranks, four_ranks):
    """Negative control: the rank's own block, unmerged with the others, is far from the oracle on some
    rank of every case, so the comparison above would catch a ring that dropped or misplaced a shard."""
    for results in (two_ranks, four_ranks):
        for per_case in zip(*results, strict=True):
            assert max(e.unmerged for e in per_case) > 0.05, per_case[0].case


def test_ring_runs_the_schedule_of_the_layout(two_ranks, four_ranks):
    """The tiles the ring's forward ran (recorded per backend call) are those the layout plans."""
    for e in _all(two_ranks) + _all(four_ranks):
        assert e.tiles == e.planned_tiles, e.case


def test_zigzag_balances_causal_work_and_contiguous_does_not(four_ranks):
    tiles = {
        layout: [e.tiles for rank in four_ranks for e in rank if e.case == Case(layout, True, N=64, seed=10)]
        for layout in ("contiguous", "zigzag")
    }
    assert len(set(tiles["zigzag"])) == 1, tiles
    assert tiles["contiguous"] == sorted(tiles["contiguous"]) and tiles["contiguous"][-1] > 4 * tiles["contiguous"][0]


def test_bad_calls_raise_on_every_rank():
    for rank, (shapes, causal, odd, *scales) in enumerate(values(run_ranks(bad_calls, 2))):
        assert isinstance(shapes, RingMismatchError), (rank, shapes)
        assert "same query shape, but rank 0 passed (1, 2, 8, 4) and rank 1 passed (1, 2, 6, 4)" in str(shapes)
        assert isinstance(causal, RingMismatchError), (rank, causal)
        assert "same causal, but rank 0 passed True and rank 1 passed False" in str(causal)
        assert isinstance(odd, ValueError) and "N_local must be even" in str(odd), (rank, odd)
        # scales given as tensors or numpy floats are compared as the numbers they are, not only Python floats
        assert len(scales) == 3, (rank, scales)
        for e in scales:
            assert isinstance(
                e, RingMismatchError
            ) and "same scale, but rank 0 passed 0.5 and rank 1 passed 0.25" in str(e), (rank, e)


@pytest.mark.parametrize("dies", [True, False], ids=["dies", "never-arrives"])
def test_a_missing_rank_raises_within_the_timeout(dies):
    timeout = 2.0
    message, elapsed = values(run_ranks(absent_rank, 2, timeout, dies, deadline=60.0)[:1])[0]
    assert "rank 0 of 2 gave up waiting" in message
    assert elapsed < timeout + 20.0
    assert issubclass(RingTimeoutError, TimeoutError)


@pytest.mark.skipif(not RUN_TRITON, reason="needs triton and TRITON_INTERPRET=1 (the cases are CPU tensors)")
def test_ring_with_triton_blocks_matches_dense_oracle(two_ranks):
    triton_errors = [e for e in _all(two_ranks) if e.case == TRITON_CASE]
    assert len(triton_errors) == 2
    _assert_matches_oracle(triton_errors)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_example_under_torchrun_matches_oracle():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += [
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        str(ROOT / "examples" / "ring_attention.py"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=True).stdout
    errors = dict(re.findall(r"max error (\w+)\s+(\S+)", out))
    assert set(errors) == {"O", "dQ", "dK", "dV"}, out
    assert all(float(e) < 1e-10 for e in errors.values()), out
