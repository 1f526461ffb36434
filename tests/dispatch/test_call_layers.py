"""A call crosses at most five layers of this package from the public function to the tile update (or the
kernel launch): the frames on the stack when the update runs are counted, the public function's included,
the update's own not (``docs/architecture.md``, "A call's layers", lists them). Frames outside the package
(torch's ``Function.apply``, the pool's thread) are not layers of ours and are not counted."""

from __future__ import annotations

import os
import sys
from types import FrameType

import pytest
import torch

import flashattn_teach as fa

MAX_LAYERS = 5
_PACKAGE = os.path.dirname(os.path.abspath(fa.__file__)) + os.sep
UPDATES = {"update", "update_", "whole_row"}  # core/online_softmax.py's update and the one-tile step


def _ours(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_PACKAGE)


def _chain(frame: FrameType | None, public: str) -> list[str]:
    """The package's frames from the public function ``public`` down to ``frame`` (included), outermost first."""
    frames = []
    while frame is not None:
        if _ours(frame):
            frames.append(f"{os.path.relpath(frame.f_code.co_filename, _PACKAGE)}:{frame.f_code.co_name}")
            if frame.f_code.co_name == public:
                return frames[::-1]
        frame = frame.f_back
    raise AssertionError(f"{public} is not on the stack: {frames[::-1]}")


def _layers_to_update(call, public: str) -> list[str]:
    """The chain of the first tile update ``call()`` runs on this thread (the parallel path's small calls run
    inline)."""
    seen: list[list[str]] = []

    def profile(frame, event, arg):
        if not seen and event == "call" and frame.f_code.co_name in UPDATES and _ours(frame):
            seen.append(_chain(frame.f_back, public))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    assert seen, "no tile update ran"
    return seen[0]


def _qkv(*shape, grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g).requires_grad_(grad) for _ in range(3)]


CPU_CALLS = {
    "sdpa causal (1, 8, 16, 64)": lambda: (
        "scaled_dot_product_attention",
        lambda q, k, v: fa.scaled_dot_product_attention(q, k, v, is_causal=True),
        (1, 8, 16, 64),
    ),
    "flash_attention (2, 8, 128, 64)": lambda: (
        "flash_attention",
        lambda q, k, v: fa.flash_attention(q, k, v),
        (2, 8, 128, 64),
    ),
    "flash_attention causal, N = 300, query_major": lambda: (
        "flash_attention",
        lambda q, k, v: fa.flash_attention(q, k, v, causal=True, backend="query_major"),
        (1, 2, 300, 16),
    ),
}


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
@pytest.mark.parametrize("case", list(CPU_CALLS))
def test_a_cpu_call_crosses_at_most_five_layers(case, grad):
    public, fn, shape = CPU_CALLS[case]()
    q, k, v = _qkv(*shape, grad=grad)
    chain = _layers_to_update(lambda: fn(q, k, v), public)
    assert len(chain) <= MAX_LAYERS, chain
    assert chain[1] == "dispatch/runner.py:run"  # the one place a backend is called


def test_a_decode_step_over_512_keys_crosses_at_most_five_layers():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 8, 1, 64, generator=g)
    kc, vc = (torch.randn(1, 8, 512, 64, generator=g) for _ in range(2))
    public = "flash_attention_with_kvcache"
    chain = _layers_to_update(lambda: fa.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=512), public)
    assert len(chain) <= MAX_LAYERS, chain
    assert "dispatch/runner.py:run" in chain


def test_the_count_sees_an_added_layer(monkeypatch):
    """The control: one more package function between the runner and the update is counted (the tiny call
    without grad runs the open tile from the runner, ``reference/autograd.py open_tile``)."""
    from flashattn_teach.dispatch import runner

    open_tile = runner.open_tile

    def extra_layer(*args):
        return open_tile(*args)

    extra_layer.__code__ = extra_layer.__code__.replace(co_filename=runner.__file__)  # a frame of the package
    monkeypatch.setattr(runner, "open_tile", extra_layer)
    q, k, v = _qkv(1, 8, 16, 64)
    chain = _layers_to_update(lambda: fa.flash_attention(q, k, v), "flash_attention")
    assert len(chain) == len(_layers_to_update(lambda: fa.flash_attention(q, k, v), "flash_attention"))
    monkeypatch.undo()
    assert len(chain) == len(_layers_to_update(lambda: fa.flash_attention(q, k, v), "flash_attention")) + 1


def test_the_triton_path_crosses_at_most_five_layers_to_the_launch(monkeypatch):
    """The kernel launch (``triton.launch.forward``) replaced by a recorder: the CUDA path's layers, on a CPU
    with the interpreter's device check; the launch asks no support question again."""
    pytest.importorskip("triton")
    from flashattn_teach.triton import autograd as triton_autograd
    from flashattn_teach.triton import support

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    chains = []

    def launch(q4, k4, v4, s, **kwargs):
        chains.append(_chain(sys._getframe(1), "flash_attention"))
        B, H, N, _ = q4.shape
        return q4.new_zeros(B, H, N, v4.shape[-1]), q4.new_zeros(B, H, N)

    asked = []
    reason = support.call_unsupported_reason
    monkeypatch.setattr(support, "call_unsupported_reason", lambda *a: asked.append(1) or reason(*a))
    monkeypatch.setattr(triton_autograd, "launch_forward", launch)
    q, k, v = _qkv(1, 2, 16, 16)
    fa.flash_attention(q.half(), k.half(), v.half(), causal=True, backend="triton")
    assert len(chains) == 1 and len(chains[0]) <= MAX_LAYERS, chains
    assert asked == [1]  # once, by the planner
