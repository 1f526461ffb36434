"""A ``TorchDispatchMode`` that records the largest tensor any torch op allocates, for the no-N x N checks of
``dispatch/test_no_nxn.py`` and ``reference/test_dropout.py``."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor an op allocates: outputs sharing no storage with the op's inputs."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        storages = {a.untyped_storage().data_ptr() for a in inputs}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
                self.largest = max(self.largest, t.numel())
        return out
