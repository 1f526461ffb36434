"""The thread pool the ``parallel`` backend runs its tasks on: workers whose torch ops are single-threaded.

Threads: each pool thread sets its own intra-op thread count to 1 once, in the pool's initializer.
``torch.set_num_threads`` is per thread for the calling thread's OpenMP and MKL settings, but it also sets
the process default that a thread adopts at its first parallel op; the pool restores that default after
its threads are set up, so the calling thread and threads started later are unaffected. The inline path
sets the calling thread's count to 1 for the duration of the call and restores it; a thread that makes its
first torch call during that window adopts 1.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait

import torch


def default_workers() -> int:
    """The calling thread's ``torch.get_num_threads()``: the cores torch would use for one op (by default
    the physical cores; ``OMP_NUM_THREADS`` or ``torch.set_num_threads`` change it)."""
    return torch.get_num_threads()


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()
IN_WORKER = threading.local()


def _single_threaded_worker() -> None:
    torch.get_num_threads()  # adopt the process default now, so adopting it later cannot undo the next line
    torch.set_num_threads(1)
    IN_WORKER.active = True


def _start_pool(workers: int) -> ThreadPoolExecutor:
    restore = torch.get_num_threads()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="flashattn_teach", initializer=_single_threaded_worker)
    # Each waiting task occupies a thread, so the pool starts all `workers` threads before the barrier opens.
    ready = threading.Barrier(workers + 1)
    for _ in range(workers):
        pool.submit(ready.wait)
    ready.wait()
    torch.set_num_threads(restore)  # the process default, which the initializers set to 1
    return pool


def _pool(workers: int) -> ThreadPoolExecutor:
    with _POOLS_LOCK:
        if workers not in _POOLS:
            _POOLS[workers] = _start_pool(workers)
        return _POOLS[workers]


def _forget_pools() -> None:
    """In a forked child: none of the parent's threads exist there, and the lock may have been held."""
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


@contextlib.contextmanager
def single_threaded_ops() -> Iterator[None]:
    """One intra-op thread in the calling thread while the block runs; its count is restored afterwards."""
    restore = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(restore)


def run_tasks(task: Callable[..., None], args: Iterable[tuple], *, inline: bool, workers: int) -> None:
    """``task(*a)`` for every ``a``, on the pool or (``inline``) in the calling thread, without autograd."""
    if inline:
        with torch.no_grad(), single_threaded_ops():
            for a in args:
                task(*a)
        return
    futures = [_pool(workers).submit(_no_grad, task, *a) for a in args]
    wait(futures)
    for f in futures:
        f.result()  # re-raises a task's exception


def _no_grad(task: Callable[..., None], *args) -> None:
    with torch.no_grad():  # grad mode is per thread, and on by default in a new one
        task(*args)


def chunk_pool() -> Callable[[Callable[..., None], Iterable[tuple[int, ...]]], None] | None:
    """``pool(task, chunks)`` on the worker threads, for work split in chunks outside the tile loops (the
    block-mask classification, :mod:`flashattn_teach.flex.classify`); None with one worker."""
    workers = default_workers()
    if workers <= 1:
        return None
    return functools.partial(run_tasks, inline=False, workers=workers)
