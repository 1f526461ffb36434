"""CUDA-graph checks of the Triton paths: a training step's attention (forward and backward) and a decode
step, captured once and replayed with new values copied into the captured (static) tensors, against the same
calls run eagerly on those values. No pytest here, so that ``benchmarks/gpu_checks.py`` runs them too;
nothing touches CUDA at import.

A capture fails at once on a host sync (``cudaErrorStreamCaptureUnsupported``), so capturing is itself the
check that the host path reads no tensor's values; the replay checks that nothing the host computed per
call was frozen wrongly (the grid, the decode split count, the tensor descriptors: all from shapes and
addresses, which the static tensors keep). Inputs change between capture and replay, and the replay must
not return the captured call's outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

import flashattn_teach as fa

# bf16 outputs of the same kernels on the same inputs: the forward runs the same programs in the same order;
# the backward may sum in another order where it uses atomics, so its gradients get bf16's rounding
GRAD_RTOL = 2e-2


def _warm_up(step: Callable[[], object], n: int = 3) -> None:
    """Run ``step`` on a side stream before capturing it (the pattern of torch's CUDA-graph notes): Triton
    compiles and loads its kernels, and the caching allocator settles, outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(n):
            step()
    torch.cuda.current_stream().wait_stream(side)


def _close(got: Tensor, want: Tensor, rtol: float, what: str) -> None:
    err = (got.float() - want.float()).abs().max().item()
    scale = max(1.0, want.float().abs().max().item())
    assert err <= rtol * scale, f"{what}: replay differs from eager by {err:.3g} (scale {scale:.3g})"


def check_training_step_replays(device: str = "cuda") -> None:
    """bf16, causal, head dim 128: ``O = attention(q, k, v)``, ``O.backward(dO)`` captured, replayed on new
    q, k, v, dO, and compared with eager on the same values."""
    B, H, N, D = 2, 4, 384, 128
    g = torch.Generator(device=device).manual_seed(0)

    def fresh() -> list[Tensor]:
        return [torch.randn(B, H, N, D, generator=g, device=device, dtype=torch.bfloat16) for _ in range(4)]

    q, k, v, dO = (t.requires_grad_(i < 3) for i, t in enumerate(fresh()))

    def step() -> Tensor:
        O = fa.flash_attention(q, k, v, causal=True, backend="triton")
        O.backward(dO)
        return O

    _warm_up(step)
    for t in (q, k, v):
        t.grad = None  # allocated inside the capture, overwritten (not accumulated) by each replay
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        O_static = step()
    graph.replay()
    O_first = O_static.detach().clone()

    new = fresh()
    with torch.no_grad():
        for static, value in zip((q, k, v, dO), new, strict=True):
            static.copy_(value)
    graph.replay()
    torch.cuda.synchronize()

    leaves = [t.detach().clone().requires_grad_() for t in new[:3]]
    O_eager = fa.flash_attention(*leaves, causal=True, backend="triton")
    O_eager.backward(new[3])
    assert not torch.equal(O_static, O_first), "the replay returned the captured call's output"
    assert torch.equal(O_static, O_eager), "forward: the replay differs from eager"
    for name, static, leaf in zip("qkv", (q, k, v), leaves, strict=True):
        assert static.grad is not None and leaf.grad is not None
        _close(static.grad, leaf.grad, GRAD_RTOL, f"d{name}")


def check_decode_step_replays(device: str = "cuda") -> None:
    """bf16, head dim 128, GQA 4:1: one new token per sequence appended at ``cache_seqlens`` and attended,
    captured, replayed with new queries, new keys/values and new lengths, compared with eager."""
    B, H_q, H_kv, N_max, D = 3, 8, 2, 1024, 128
    g = torch.Generator(device=device).manual_seed(1)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)

    k_cache, v_cache = randn(B, H_kv, N_max, D), randn(B, H_kv, N_max, D)
    q, k, v = randn(B, H_q, 1, D), randn(B, H_kv, 1, D), randn(B, H_kv, 1, D)
    cache_seqlens = torch.tensor([17, 500, 1000], dtype=torch.int32, device=device)

    def step() -> Tensor:
        out = fa.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, causal=True)
        assert isinstance(out, Tensor)
        return out

    with torch.no_grad():
        _warm_up(step)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            O_static = step()
        graph.replay()
        O_first = O_static.clone()

        new_q, new_k, new_v = randn(B, H_q, 1, D), randn(B, H_kv, 1, D), randn(B, H_kv, 1, D)
        new_lengths = torch.tensor([900, 3, 256], dtype=torch.int32, device=device)
        for static, value in zip((q, k, v, cache_seqlens), (new_q, new_k, new_v, new_lengths), strict=True):
            static.copy_(value)
        k_eager, v_eager = k_cache.clone(), v_cache.clone()  # the caches as the replay finds them
        graph.replay()
        O_eager = fa.flash_attention_with_kvcache(
            new_q, k_eager, v_eager, new_k, new_v, cache_seqlens=new_lengths, causal=True
        )
        torch.cuda.synchronize()
    assert isinstance(O_eager, Tensor)
    assert not torch.equal(O_static, O_first), "the replay returned the captured call's output"
    assert torch.equal(O_static, O_eager), "decode: the replay differs from eager"
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager), "the replay appended elsewhere"


def graph_checks(device: str = "cuda") -> list[tuple[str, Callable[[], None]]]:
    return [
        ("cuda-graph training step (bf16 causal hd128)", lambda: check_training_step_replays(device)),
        ("cuda-graph decode step (bf16 hd128 gqa4)", lambda: check_decode_step_replays(device)),
    ]
