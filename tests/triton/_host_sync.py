"""A probe for host synchronisation: what would make a CUDA call wait for the GPU, or break a CUDA graph's
capture, seen on CPU tensors.

A host sync reads a tensor's values on the host. Under the dispatcher that is ``aten._local_scalar_dense``
(``.item()``, ``int()``, ``float()``, ``bool()`` of a tensor, ``if t:``, ``max()`` over a tensor's elements),
``aten.is_nonzero``, ``aten.nonzero`` (a data-dependent shape) and ``aten.equal``. ``.tolist()``,
``.numpy()`` and ``.cpu()`` do not reach the dispatcher for a CPU tensor (for a CUDA one they copy to the
host and wait), so the probe wraps those three methods. Only calls made from this library's source are
recorded, with the line that made them: the Triton interpreter reads its arguments on the host by design.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashattn_teach

SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.equal.default,
}
HOST_METHODS = ("tolist", "numpy", "cpu")
_SOURCE = str(Path(flashattn_teach.__file__).resolve().parent)
_IGNORED = (str(Path(torch.__file__).resolve().parent), __file__, str(Path(traceback.__file__).resolve().parent))


@dataclass(frozen=True)
class HostSync:
    op: str
    where: str  # file:line of the library's code that asked for it

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


def _caller() -> str | None:
    """The innermost frame outside torch and this probe, as ``path:line`` if it is the library's, else None
    (the Triton interpreter, a test)."""
    for frame in reversed(traceback.extract_stack()):
        path = str(Path(frame.filename).resolve())
        if path.startswith(_IGNORED) or "contextlib" in path:
            continue
        if path.startswith(_SOURCE):
            return f"{Path(path).relative_to(Path(_SOURCE).parent)}:{frame.lineno}"
        return None
    return None


class _Recorder(TorchDispatchMode):
    def __init__(self, found: list[HostSync]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC_OPS:
            where = _caller()
            if where is not None:
                self.found.append(HostSync(str(func), where))
        return func(*args, **(kwargs or {}))


def _wrap(name: str, real: Callable, found: list[HostSync]) -> Callable:
    def method(self, *args, **kwargs):
        where = _caller()
        if where is not None:
            found.append(HostSync(f"Tensor.{name}", where))
        return real(self, *args, **kwargs)

    return method


@contextmanager
def host_syncs() -> Iterator[list[HostSync]]:
    """``with host_syncs() as found:`` records into ``found`` every host sync the library asks for."""
    found: list[HostSync] = []
    reals = {name: getattr(torch.Tensor, name) for name in HOST_METHODS}
    for name, real in reals.items():
        setattr(torch.Tensor, name, _wrap(name, real, found))
    try:
        with _Recorder(found):
            yield found
    finally:
        for name, real in reals.items():
            setattr(torch.Tensor, name, real)


def report(found: list[HostSync]) -> str:
    return "\n".join(sorted({str(s) for s in found})) or "none"
