"""The ring's communication: pass a tensor to the next rank, check that every rank made the same call, and
turn a rank that fails or never arrives into an error within a timeout instead of a hang.

Only ``torch.distributed`` point-to-point operations (``isend``/``irecv``) and one small ``all_gather``
are used, so the ring runs on gloo (CPU tensors) and NCCL (CUDA tensors) alike. Every wait goes through
``Work.wait(timeout=...)``: gloo raises when a peer closed its connection or the time ran out.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import AttentionError, AttentionValueError


class RingTimeoutError(AttentionError, TimeoutError):
    """A rank of the ring failed, or did not arrive within ``timeout`` seconds."""


class RingMismatchError(AttentionValueError):
    """The ranks of one ring call passed different shapes, dtypes or options."""


@dataclass(frozen=True)
class Ring:
    """This rank's place in the ring: it sends to ``next`` and receives from ``prev`` (global ranks)."""

    group: dist.ProcessGroup | None
    rank: int  # in the group
    world_size: int
    next: int
    prev: int
    timeout: timedelta

    @classmethod
    def of(cls, group: dist.ProcessGroup | None, timeout: float) -> Ring:
        if not dist.is_available() or not dist.is_initialized():
            raise AttentionValueError("ring_attention needs torch.distributed initialised (init_process_group)")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise AttentionValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        rank, W = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise AttentionValueError("ring_attention was called on a rank that is not a member of group")

        def global_rank(r: int) -> int:
            return r if group is None else dist.get_global_rank(group, r)

        return cls(group, rank, W, global_rank((rank + 1) % W), global_rank((rank - 1) % W), timedelta(seconds=timeout))

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work``, raising :class:`RingTimeoutError` if a peer failed or the timeout passed."""
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as e:
            raise RingTimeoutError(
                f"ring_attention: rank {self.rank} of {self.world_size} gave up waiting for {what} "
                f"(timeout={self.timeout.total_seconds():g} s): a rank failed or never arrived ({e})"
            ) from e

    def shift(self, t: Tensor, tag: int) -> Shift:
        """Start sending ``t`` to the next rank and receiving the previous rank's tensor of the same shape."""
        if self.world_size == 1:
            return Shift(self, t, [], "")
        received = torch.empty_like(t)
        # Both operations go out at once, so that no rank waits on its send before posting its receive.
        ops = [
            dist.P2POp(dist.isend, t.contiguous(), self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
        ]
        return Shift(self, received, dist.batch_isend_irecv(ops), f"a shard from rank {self.prev} (tag {tag})")


@dataclass
class Shift:
    """A transfer in flight; :meth:`wait` returns the tensor received from the previous rank."""

    ring: Ring
    received: Tensor
    works: list[dist.Work]
    what: str

    def wait(self) -> Tensor:
        for work in self.works:
            self.ring.wait(work, self.what)
        return self.received


@dataclass(frozen=True)
class Field:
    """One argument as integers, so that every rank's value travels in one int64 tensor, and back."""

    name: str
    values: tuple[int, ...]
    readable: Callable[[tuple[int, ...]], str]


def float_bits(x: float) -> int:
    """The bits of a float64 as an int64: a float travels in the integer signature exactly."""
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def bits_float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def check_same_call(ring: Ring, fields: list[Field], device: torch.device) -> None:
    """Raise :class:`RingMismatchError` on every rank unless all ranks passed the same ``fields``.

    One ``all_gather`` of a small int64 tensor (every rank's fields have the same length); the error
    names the first field that differs and the two ranks, rank 0 and the first that disagrees with it.
    """
    if ring.world_size == 1:
        return
    mine = torch.tensor([x for f in fields for x in f.values], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(ring.world_size)]
    ring.wait(dist.all_gather(everyone, mine, group=ring.group, async_op=True), "the other ranks' arguments")
    rows = [tuple(int(x) for x in t.tolist()) for t in everyone]
    for r, row in enumerate(rows):
        start = 0
        for f in fields:
            stop = start + len(f.values)
            first, theirs = rows[0][start:stop], row[start:stop]
            if theirs != first:
                raise RingMismatchError(
                    f"ring_attention: every rank must pass the same {f.name}, but rank 0 passed "
                    f"{f.readable(first)} and rank {r} passed {f.readable(theirs)}"
                )
            start = stop
