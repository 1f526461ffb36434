"""Every kernel launches on its tensors' GPU (issue 37, item 5): inside ``torch.cuda.device(t.device)``.

A Triton launch goes to the current CUDA device, so tensors on another GPU would fault. Checked three ways:

- :func:`devices.device_guard` enters ``torch.cuda.device`` with the tensor's device, for CUDA only (a
  recording stand-in for ``torch.cuda.device``; this machine may have no GPU);
- in the interpreter, every kernel that the forward, both backwards (one kernel and two, split dK/dV), packed
  sequences, the decode step (split and combined) and the block-mask classification launch runs inside the
  guard (a recording guard and a recording ``InterpretedFunction.run``);
- in the source, every ``kernel[grid](...)`` of a ``@triton.jit`` function sits in a function decorated
  with ``launches_on_device`` or inside a ``with ... device_guard(...)`` block, so a new launcher without
  it fails here even before it has a test (negative control: a launcher written without it).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _triton_cases import DEVICE, ON_GPU

import flashattn_teach as fa
from flashattn_teach.triton import AttentionConfig, KernelConfig, devices, triton_attention, triton_attention_varlen

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

SRC = Path(fa.__file__).parent


def test_the_guard_enters_torch_cuda_device_with_the_tensors_device(monkeypatch) -> None:
    entered: list[torch.device] = []

    @contextlib.contextmanager
    def recording(device: torch.device) -> Iterator[None]:
        entered.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "device", recording)
    with devices.device_guard(torch.device("cuda", 1)):
        pass
    assert entered == [torch.device("cuda", 1)]
    with devices.device_guard(torch.device("cpu")):  # the interpreter's tensors: nothing to enter
        pass
    assert entered == [torch.device("cuda", 1)]


@contextlib.contextmanager
def _launches_and_guard() -> Iterator[list[tuple[str, bool]]]:
    """(kernel name, whether a device guard was open) of every interpreter launch inside the block."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: list[tuple[str, bool]] = []
    open_guards: list[torch.device] = []
    real_run, real_guard = InterpretedFunction.run, devices.device_guard

    @contextlib.contextmanager
    def guard(device: torch.device) -> Iterator[None]:
        open_guards.append(device)
        try:
            with real_guard(device):
                yield
        finally:
            open_guards.pop()

    def run(self, *args, **kwargs):
        seen.append((self.fn.__name__, bool(open_guards) and all(d.type == DEVICE for d in open_guards)))
        return real_run(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(devices, "device_guard", guard)
        mp.setattr(InterpretedFunction, "run", run)
        yield seen


@pytest.mark.skipif(ON_GPU, reason="records the interpreter's launches")
def test_every_launcher_launches_inside_the_device_guard() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g, dtype=torch.float16).requires_grad_() for _ in range(3))
    split = AttentionConfig(
        forward=KernelConfig(32, 16, 4, 1),
        backward_dkdv=KernelConfig(16, 32, 4, 1, split=True),
        backward_dq=KernelConfig(32, 16, 4, 1),
    )
    with _launches_and_guard() as seen:
        for deterministic, config in ((False, None), (True, None), (True, split)):
            O = triton_attention(q, k, v, causal=True, deterministic=deterministic, config=config)
            torch.autograd.grad(O.sum(), (q, k, v))
        cu = torch.tensor([0, 15, 40], dtype=torch.int32)
        packed = [t.detach()[0].transpose(0, 1) for t in (q, k, v)]  # (total, H, D)
        triton_attention_varlen(*packed, cu, cu, 25, 25, causal=True)
        cache = torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float16)
        fa.flash_attention_with_kvcache(
            q.detach()[:, :, :1], cache, cache.clone(), cache_seqlens=50, num_splits=2, backend="triton"
        )
        from flashattn_teach.triton.block_mask import triton_block_kinds

        kinds = triton_block_kinds(lambda b, h, i, j: i >= j, 1, 1, 64, 64, 16, 16, torch.device(DEVICE))
        assert kinds is not None
    names = {name for name, _ in seen}
    expected = {"attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq", "decode_split_fwd"}
    assert expected | {"decode_combine", "block_kinds_kernel"} <= names, names
    assert [name for name, guarded in seen if not guarded] == []


# --- in the source ------------------------------------------------------------------------------------


def _jit_names(tree: ast.Module) -> set[str]:
    """Names a module imports from the kernels' packages (where every ``@triton.jit`` function lives)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and "kernels" in node.module.split("."):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def _guarded(stack: list[ast.AST]) -> bool:
    for node in stack:
        if isinstance(node, ast.FunctionDef) and any(
            (d.id if isinstance(d, ast.Name) else getattr(d, "attr", "")) == "launches_on_device"
            for d in node.decorator_list
        ):
            return True
        if isinstance(node, ast.With) and any("device_guard" in ast.unparse(item.context_expr) for item in node.items):
            return True
    return False


def launch_sites(source: str) -> list[tuple[str, int, bool]]:
    """``(kernel, line, guarded)`` of every ``kernel[grid](...)`` call of a kernel the module imports."""
    tree = ast.parse(source)
    kernels = _jit_names(tree)
    found = []

    def visit(node: ast.AST, stack: list[ast.AST]) -> None:
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in kernels
        ):
            found.append((node.func.value.id, node.lineno, _guarded(stack)))
        for child in ast.iter_child_nodes(node):
            visit(child, [*stack, node])

    visit(tree, [])
    return found


def test_every_kernel_launch_in_the_source_is_inside_the_device_guard() -> None:
    sites = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[:2] == ("triton", "kernels"):
            continue  # the @triton.jit functions themselves (calls between them are not launches)
        sites += [(f"{rel}:{line}", name, guarded) for name, line, guarded in launch_sites(path.read_text())]
    launched = {name for _, name, _ in sites}
    every = {"attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq", "decode_split_fwd", "decode_combine"}
    assert every | {"block_kinds_kernel"} <= launched, launched  # the scan sees every launcher
    assert [where for where, _, guarded in sites if not guarded] == []


def test_the_source_scan_finds_a_launcher_without_the_guard() -> None:
    without = (
        "from .kernels.forward import attn_fwd\n"
        "def forward(q):\n"
        "    attn_fwd[(1,)](q)\n"
        "@launches_on_device\n"
        "def guarded(q):\n"
        "    attn_fwd[(1,)](q)\n"
        "def block(q):\n"
        "    with devices.device_guard(q.device):\n"
        "        attn_fwd[(1,)](q)\n"
    )
    assert launch_sites(without) == [("attn_fwd", 3, False), ("attn_fwd", 6, True), ("attn_fwd", 9, True)]
