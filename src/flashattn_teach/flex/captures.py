"""The tensors a user's ``score_mod`` or ``mask_mod`` reads besides its arguments: its captured tensors.

FlexAttention's functions are plain Python, ``lambda score, b, h, q_idx, kv_idx: score + bias[h]``, and a
learned bias is a tensor the function closes over, not an argument. torch finds such tensors by tracing the
function with dynamo; here they are found two ways, and the union is kept:

- a probe: the function is called once, on one element's 0-d arguments (as torch calls it), under a
  ``TorchFunctionMode`` that records every tensor a torch operation receives that is neither an argument
  nor made inside the call. This sees what the function really reads, however it reaches it (``ns.bias``,
  ``self.table``, ``module.BIAS``);
- a walk of what the function can reach without running it, for what a branch of the probe did not take:

    closure cells             def outer(): bias = ...; def score_mod(...): ... bias[h] ...
    globals it names          bias = ...  at module level, used by name in the function
    defaults                  def score_mod(score, b, h, q, kv, bias=bias): ...
    functools.partial         partial(score_mod, bias=bias): its function, args and keywords
    bound methods             a module's method: the module's parameters and buffers, its tensor attributes
    callable objects          an object with ``__call__``: its attributes
    containers                lists, tuples and dicts of the above

recursively, through the functions it reaches (``and_masks`` builds closures over other mask functions).
The order is the order of discovery, fixed for a function, so the Triton translator can number the
tensors (:mod:`flashattn_teach.triton.usermod`). A tensor that requires grad gets its gradient from every
CPU path's backward (:mod:`flashattn_teach.flex.mods`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

# Deep enough for combinators of combinators; a cycle is cut by the set of objects already seen.
MAX_DEPTH = 16


def captured_tensors(fn: Callable[..., object], probe: tuple[Tensor, ...] | None = None) -> tuple[Tensor, ...]:
    """Every tensor ``fn`` reads besides its arguments, each once: those ``fn(*probe)`` reads (when a probe
    is given and the call succeeds), then those the walk reaches."""
    found: dict[int, Tensor] = {}
    read = None if probe is None else tensors_read(fn, probe)
    for t in (*(read or ()), *_reach(fn, set(), 0)):
        found.setdefault(id(t), t)
    return tuple(found.values())


def tensors_read(fn: Callable[..., object], args: tuple[Tensor, ...]) -> tuple[Tensor, ...] | None:
    """The tensors ``fn(*args)`` hands to torch operations that are neither ``args`` nor made inside the
    call, in the order first read; None if the call raised (the real call will say why)."""
    mode = _Reads(args)
    try:
        with torch.no_grad(), mode:
            fn(*args)
    except Exception:
        return None
    return tuple(mode.found.values())


class _Reads(TorchFunctionMode):
    def __init__(self, args: tuple[Tensor, ...]) -> None:
        super().__init__()
        self.known = {id(t) for t in args}  # the arguments, then everything made inside the call
        self.found: dict[int, Tensor] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, Tensor) and id(leaf) not in self.known:
                self.found.setdefault(id(leaf), leaf)
        out = func(*args, **kwargs)
        self.known.update(id(leaf) for leaf in tree_flatten(out)[0] if isinstance(leaf, Tensor))
        return out


def _reach(obj: object, seen: set[int], depth: int) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
        return
    if depth > MAX_DEPTH or id(obj) in seen or isinstance(obj, (types.ModuleType, type, str, bytes)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
        children: list[object] = [v for v in vars(obj).values() if not isinstance(v, dict)]
    elif isinstance(obj, functools.partial):
        children = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, types.MethodType):
        children = [obj.__func__, obj.__self__]
    elif isinstance(obj, types.FunctionType):
        children = _function_children(obj)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    elif isinstance(obj, dict):
        children = list(obj.values())
    elif callable(obj) and hasattr(obj, "__dict__"):
        children = [type(obj).__call__, *vars(obj).values()]
    else:
        return
    for child in children:
        yield from _reach(child, seen, depth + 1)


def _function_children(fn: types.FunctionType) -> list[object]:
    """What a plain function reads besides its arguments: closure cells, defaults, and the globals its code
    (and the code of functions defined inside it) names."""
    children: list[object] = []
    for cell in fn.__closure__ or ():
        try:
            children.append(cell.cell_contents)
        except ValueError:  # an empty cell: a variable not yet bound
            continue
    children.extend(fn.__defaults__ or ())
    children.extend((fn.__kwdefaults__ or {}).values())
    for name in _global_names(fn.__code__):
        if name in fn.__globals__:
            children.append(fn.__globals__[name])
    return children


def _global_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return names
