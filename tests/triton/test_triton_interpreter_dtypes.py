"""triton's interpreter multiplies bfloat16 tiles wrongly with no error (a 16 x 16 ``tl.dot`` is off by about
1e10 with triton 3.9): the Triton paths refuse bfloat16 CPU tensors in the interpreter by name instead of
answering, and float16 runs there."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402

import flashattn_teach as fa  # noqa: E402
from flashattn_teach.errors import BackendUnavailableError  # noqa: E402


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 16, 16, generator=g).to(dtype) for _ in range(3))  # type: ignore[return-value]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs CPU tensors")
def test_bfloat16_is_refused_in_the_interpreter_and_float16_runs() -> None:
    q, k, v = _inputs(torch.bfloat16)
    with pytest.raises(BackendUnavailableError, match="interpreter"):
        fa.flash_attention(q, k, v, backend="triton")
    with pytest.raises(BackendUnavailableError, match="interpreter"):
        fa.flash_attention_with_kvcache(q[:, :, :1], k, v, cache_seqlens=16, backend="triton")
    q, k, v = _inputs(torch.float16)
    O = fa.flash_attention(q, k, v, backend="triton")
    O_ref = fa.dense_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(O.double(), O_ref, atol=2e-3, rtol=2e-3)
    # bfloat16 under "auto" takes a CPU path, no refusal
    assert fa.flash_attention(*_inputs(torch.bfloat16)).dtype == torch.bfloat16
