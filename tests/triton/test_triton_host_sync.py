"""The Triton paths ask the host for no tensor's values: no ``.item()``, ``int()``/``bool()`` of a tensor,
``.tolist()``, ``.cpu()``, ``nonzero`` or ``equal`` on the forward, the backward and a decode step. Such a
read waits for the GPU on every call and makes a CUDA graph's capture fail (``_host_sync.py`` has the probe).

On CPU tensors the kernels run in the interpreter; a check that reads values only for host tensors
(``values_on_host``) is told that these are device tensors, as they would be on a GPU, so the probe sees the
path a CUDA call takes.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402
from _host_sync import host_syncs, report  # noqa: E402
from _triton_cases import DEVICE  # noqa: E402

import flashattn_teach as fa  # noqa: E402
from flashattn_teach._validate import inputs as validate_inputs  # noqa: E402


@pytest.fixture
def as_device_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validate_inputs, "values_on_host", lambda t: False)


def _qkv(*shape: int, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=g).to(DEVICE).requires_grad_(requires_grad) for _ in range(3))


def _no_syncs(step) -> None:
    step()  # the first call compiles (or sets up the interpreter), as a warm-up before a capture does
    with host_syncs() as found:
        step()
    assert not found, "host syncs:\n" + report(found)


def test_the_probe_sees_the_reads_host_tensors_get(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: told that its tensors are host tensors, the library checks ``seqlens_k`` with
    ``bool()`` and reads ``cache_seqlens`` with ``.tolist()``; the probe sees both, at the library's lines,
    and not the test's own ``.item()``."""
    monkeypatch.setattr(validate_inputs, "values_on_host", lambda t: True)
    q, k, v = _qkv(2, 2, 40, 16)
    k_cache, v_cache = torch.zeros(2, 2, 64, 16, device=DEVICE), torch.zeros(2, 2, 64, 16, device=DEVICE)
    with host_syncs() as found:
        fa.flash_attention(q, k, v, seqlens_k=torch.tensor([30, 40], device=DEVICE), backend="triton")
        fa.flash_attention_with_kvcache(
            q[:, :, :1], k_cache, v_cache, cache_seqlens=torch.tensor([5, 9], device=DEVICE), backend="triton"
        )
        torch.ones(2).sum().item()
    where = {(s.op, s.where.split(":")[0]) for s in found}
    assert ("aten._local_scalar_dense.default", "flashattn_teach/_validate/inputs.py") in where, report(found)
    assert ("Tensor.tolist", "flashattn_teach/serving/checks.py") in where, report(found)
    assert all(s.where.startswith("flashattn_teach/") for s in found), report(found)


@pytest.mark.parametrize("seqlens", [False, True], ids=["plain", "seqlens_k"])
def test_forward_and_backward_ask_the_host_nothing(seqlens: bool, as_device_tensors) -> None:
    q, k, v = _qkv(2, 2, 40, 16, requires_grad=True)
    kwargs = dict(seqlens_k=torch.tensor([30, 40], dtype=torch.int32, device=DEVICE)) if seqlens else {}

    def step():
        O = fa.flash_attention(q, k, v, causal=True, backend="triton", **kwargs)
        O.backward(torch.ones_like(O))

    _no_syncs(step)


def test_gqa_with_more_keys_than_queries_asks_the_host_nothing() -> None:
    q = _qkv(2, 4, 24, 16, requires_grad=True)[0]
    _, k, v = _qkv(2, 2, 56, 16, requires_grad=True)

    def step():
        O = fa.flash_attention(q, k, v, causal=True, causal_align="bottom_right", enable_gqa=True, backend="triton")
        O.backward(torch.ones_like(O))

    _no_syncs(step)


def test_variants_ask_the_host_nothing(as_device_tensors) -> None:
    q, k, v = _qkv(1, 2, 40, 16, requires_grad=True)
    slopes = torch.rand(2, device=DEVICE)

    def step():
        O = fa.flash_attention(q, k, v, causal=True, window=(8, 0), softcap=5.0, alibi_slopes=slopes, backend="triton")
        O.backward(torch.ones_like(O))

    _no_syncs(step)


@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
def test_a_decode_step_asks_the_host_nothing(append: bool, as_device_tensors) -> None:
    k_cache, v_cache = torch.zeros(2, 2, 64, 16, device=DEVICE), torch.zeros(2, 2, 64, 16, device=DEVICE)
    q, k, v = _qkv(2, 2, 1, 16)
    cache_seqlens = torch.tensor([5, 9], dtype=torch.int32, device=DEVICE)
    new = (k, v) if append else (None, None)

    def step():
        fa.flash_attention_with_kvcache(
            q, k_cache, v_cache, *new, cache_seqlens=cache_seqlens, causal=True, backend="triton"
        )

    _no_syncs(step)


@pytest.mark.skipif(DEVICE == "cuda", reason="a failed device-side assert ends the process's CUDA context")
def test_a_device_seqlens_k_out_of_range_is_still_refused(as_device_tensors) -> None:
    """Checked by ``torch._assert_async`` rather than on the host (on CUDA a device-side assert)."""
    q, k, v = _qkv(2, 1, 16, 16)
    with pytest.raises(RuntimeError, match=r"seqlens_k must lie in \[0, N_k\]"):
        fa.flash_attention(q, k, v, seqlens_k=torch.tensor([3, 17], device=DEVICE), backend="triton")


@pytest.mark.xfail(
    strict=True,
    reason="packed calls read cu_seqlens on the host (_validate/varlen.py, masks/packed.py PackedSequences.build)",
)
def test_a_packed_call_asks_the_host_nothing(as_device_tensors) -> None:
    cu = torch.tensor([0, 10, 40], dtype=torch.int32, device=DEVICE)
    q, k, v = _qkv(40, 2, 16, requires_grad=True)

    def step():
        O = fa.flash_attention_varlen(q, k, v, cu, cu, 30, 30, causal=True, backend="triton")
        O.backward(torch.ones_like(O))

    _no_syncs(step)
