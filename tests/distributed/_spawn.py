"""Run a function on W freshly spawned processes joined in one gloo process group, and collect what each
rank returns (or the exception it raised), with a deadline so that a hung rank fails the test instead of
hanging CI."""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: BaseException | None = None
    trace: str = ""


def _child(fn: Callable[..., Any], rank: int, world_size: int, init: str, args: tuple, results: Any) -> None:
    torch.set_num_threads(1)  # W ranks share the machine's cores
    result = RankResult(rank)
    try:
        dist.init_process_group(
            "gloo", init_method=init, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
        )
        result.value = fn(rank, world_size, *args)
    except BaseException as e:  # report it to the parent, which decides what was expected
        result.error, result.trace = e, traceback.format_exc()
    results.put(result)
    results.close()
    results.join_thread()  # flush the queue before leaving without teardown
    # Skip the process group's teardown: a peer that died or timed out can make it block.
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, deadline: float = 120.0) -> list[RankResult]:
    """``fn(rank, world_size, *args)`` on each rank; results by rank. A rank that reports nothing before
    ``deadline`` seconds (it died, or hangs) gets an ``error`` saying so."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, init, args, results)) for r in range(world_size)]
        for p in procs:
            p.start()
        got: dict[int, RankResult] = {}
        end = time.monotonic() + deadline
        while len(got) < world_size and time.monotonic() < end:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
            try:
                r = results.get(timeout=0.5)
            except queue.Empty:
                continue
            got[r.rank] = r
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [got.get(r, RankResult(r, error=RuntimeError(f"rank {r} reported nothing"))) for r in range(world_size)]


def values(results: list[RankResult]) -> list[Any]:
    """Every rank's value; fails with the first rank's traceback if any rank raised."""
    for r in results:
        if r.error is not None:
            raise AssertionError(f"rank {r.rank} raised:\n{r.trace or r.error}")
    return [r.value for r in results]
