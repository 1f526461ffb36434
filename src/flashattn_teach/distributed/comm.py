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
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._validate.inputs import real_number
from ..dispatch import BACKENDS
from ..errors import AttentionError, AttentionValueError
from .layout import LAYOUTS

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_DIMS = 6  # dims of each shape sent in the cross-rank check (more are compared by count only)


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


def _shape(name: str, t: Tensor) -> Field:
    """``(ndim, *shape)`` padded to a fixed length, so that every rank's signature has one length."""
    dims = tuple(t.shape[:_MAX_DIMS])
    return Field(f"{name} shape", (t.dim(), *dims, *(-1,) * (_MAX_DIMS - len(dims))), _read_shape)


def _read_shape(values: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in values[1 : 1 + min(values[0], _MAX_DIMS)]) + ")"


def _choice(name: str, value: object, choices: tuple[Any, ...]) -> Field:
    index = next((n for n, c in enumerate(choices) if c == value and type(c) is type(value)), -1)
    return Field(name, (index,), lambda x: repr(choices[x[0]]) if x[0] >= 0 else "another value")


_NONE, _GIVEN, _INVALID = 0, 1, 2  # how an optional number travels: (kind, value)


def _read_number(x: tuple[int, ...], read: Callable[[int], str]) -> str:
    return {_NONE: "None", _GIVEN: read(x[1]), _INVALID: "an invalid value"}[x[0]]


def _optional_int(name: str, value: object) -> Field:
    """``None`` or an int; anything else travels as invalid, for the validation after the check to refuse."""
    if value is None:
        kind, bits = _NONE, 0
    elif isinstance(value, int) and not isinstance(value, bool):
        kind, bits = _GIVEN, value
    else:
        kind, bits = _INVALID, 0
    return Field(name, (kind, bits), lambda x: _read_number(x, str))


def _scale(scale: object) -> Field:
    """``None`` or a real number, its float64 bits exactly, read as the validation reads it (a Python or
    numpy number, or a one-element tensor); anything else travels as invalid."""
    kind, bits = _NONE, 0
    if scale is not None:
        try:
            kind, bits = _GIVEN, float_bits(real_number("scale", scale))
        except AttentionError:
            kind, bits = _INVALID, 0
    return Field("scale", (kind, bits), lambda x: _read_number(x, lambda b: repr(bits_float(b))))


@dataclass(frozen=True)
class CallOptions:
    """The options of one ``ring_attention`` call as the user passed them, before validation."""

    causal: object
    return_lse: object
    layout: object
    backend: object
    scale: object
    block_m: object
    block_n: object


def signature(q: Tensor, k: Tensor, v: Tensor, options: CallOptions) -> list[Field]:
    """What every rank must pass alike: shapes, dtype, device type, whether gradients are needed (the
    backward is a ring too), and every option. An invalid value still encodes (as "another value"), so the
    ranks compare first and then all refuse it together."""
    fields = [_shape("query", q), _shape("key", k), _shape("value", v)]
    fields.append(_choice("dtype", q.dtype, _DTYPES))
    fields.append(_choice("device type", q.device.type, ("cpu", "cuda")))
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    fields.append(_choice("requires_grad (with grad mode on)", needs_grad, (False, True)))
    fields.append(_choice("causal", options.causal, (False, True)))
    fields.append(_choice("return_lse", options.return_lse, (False, True)))
    fields.append(_choice("layout", options.layout, LAYOUTS))
    fields.append(_choice("backend", options.backend, BACKENDS))
    fields.append(_optional_int("block_m", options.block_m))
    fields.append(_optional_int("block_n", options.block_n))
    fields.append(_scale(options.scale))
    return fields
