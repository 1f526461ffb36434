"""The block-mask classification kernel (:mod:`flashattn_teach.triton.kernels.block_mask`) against the CPU
classification (:mod:`flashattn_teach.flex.classify`), in Triton's interpreter on CPU tensors (on CUDA
tensors where a GPU is present): the launcher is called directly with ``@triton.jit`` mask functions of the
generated signature ``(b, h, q_idx, kv_idx, C0, C1, C2, C3)``, written here by hand.
"""

from __future__ import annotations

import pytest
import torch

from flashattn_teach.errors import AttentionValueError
from flashattn_teach.flex.block_mask_build import kinds_from_visibility
from flashattn_teach.flex.classify import tile_visibility

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from flashattn_teach.triton.block_mask import launch_block_kinds  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N_Q, N_K = 203, 150


@triton.jit
def _causal_jit(b, h, q_idx, kv_idx, C0, C1, C2, C3):
    return q_idx >= kv_idx


@triton.jit
def _head_window_jit(b, h, q_idx, kv_idx, C0, C1, C2, C3):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 16 * (h + 1))


@triton.jit
def _document_jit(b, h, q_idx, kv_idx, C0, C1, C2, C3):
    # C0: the (B, 203) document ids, contiguous; an index past the row reads 0, as the translator's gathers
    doc_q = tl.load(C0 + b * 203 + q_idx, mask=q_idx < 203, other=0)
    doc_k = tl.load(C0 + b * 203 + kv_idx, mask=kv_idx < 203, other=0)
    return doc_q == doc_k


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _head_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 16 * (h + 1))


DOC = torch.repeat_interleave(torch.arange(8), torch.tensor([30, 1, 60, 40, 72, 0, 0, 0])).view(1, 203)
DOC = torch.cat([DOC, DOC.flip(1)]).to(DEVICE)  # (2, 203): different documents per batch element


def _document(b, h, q_idx, kv_idx):
    return DOC[b, q_idx] == DOC[b, kv_idx]


CASES = {
    "causal": (_causal_jit, _causal, (1, 1), ()),
    "head_window": (_head_window_jit, _head_window, (1, 3), ()),
    "document": (_document_jit, _document, (2, 1), (DOC,)),
}


@pytest.mark.parametrize("tiling", [(64, 32), (32, 64), (128, 128), (16, 16)])
@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_writes_the_cpu_classifications_kinds(name, tiling):
    jit, fn, (B, H), captures = CASES[name]
    kinds = launch_block_kinds(jit, captures, B, H, N_Q, N_K, *tiling, DEVICE)
    expect = kinds_from_visibility(*tile_visibility(fn, B, H, N_Q, N_K, *tiling, DEVICE))
    assert kinds.dtype == torch.int8 and kinds.shape == expect.shape
    assert torch.equal(kinds, expect)


def test_the_launcher_refuses_a_block_size_that_is_not_a_power_of_two():
    with pytest.raises(AttentionValueError, match="powers of two"):
        launch_block_kinds(_causal_jit, (), 1, 1, N_Q, N_K, 48, 32, DEVICE)


def test_the_launcher_refuses_more_captures_than_pointer_slots():
    with pytest.raises(AttentionValueError, match="at most 4"):
        launch_block_kinds(_document_jit, (DOC,) * 5, 2, 1, N_Q, N_K, 32, 32, DEVICE)


# ---- the user's function translated (flashattn_teach.triton.usermod), as create_block_mask runs it on CUDA


def _sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 48)


def _prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 40) | (q_idx >= kv_idx)


def _dilated_window(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx) % 2 == 0) & (q_idx >= kv_idx) & (q_idx - kv_idx <= 96)


TRANSLATED = {
    "causal": (_causal, 1, 1),
    "sliding_window": (_sliding_window, None, None),
    "prefix_lm": (_prefix_lm, 2, 2),
    "dilated_window": (_dilated_window, 1, 1),
    "head_window": (_head_window, 2, 3),
    "document": (_document, 2, 3),
}


def _translated_kinds():
    pytest.importorskip("flashattn_teach.flex.captures", reason="the lead's flex.captures is not merged here yet")
    pytest.importorskip("flashattn_teach.triton.usermod", reason="H_trace's usermod is not merged here yet")
    from flashattn_teach.triton.block_mask import triton_block_kinds

    return triton_block_kinds


@pytest.mark.parametrize("tiling", [(64, 32), (128, 128)])
@pytest.mark.parametrize("name", list(TRANSLATED))
def test_translated_mask_mods_give_the_cpu_classifications_kinds(name, tiling):
    triton_block_kinds = _translated_kinds()
    fn, B, H = TRANSLATED[name]
    B, H = B or 1, H or 1
    kinds = triton_block_kinds(fn, B, H, N_Q, N_K, *tiling, DEVICE)
    assert kinds is not None, "the function was not translated"
    expect = kinds_from_visibility(*tile_visibility(fn, B, H, N_Q, N_K, *tiling, DEVICE))
    assert torch.equal(kinds, expect)


def test_a_function_the_translator_refuses_falls_back_to_the_torch_classification():
    triton_block_kinds = _translated_kinds()

    def reduces(b, h, q_idx, kv_idx):  # a reduction: not a pointwise function of the indices
        return q_idx >= kv_idx.min()

    assert triton_block_kinds(reduces, 1, 1, N_Q, N_K, 64, 32, DEVICE) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(TRANSLATED))
def test_create_block_mask_on_cuda_equals_the_cpus(name):
    from flashattn_teach import create_block_mask

    fn, B, H = TRANSLATED[name]
    on_gpu = create_block_mask(fn, B, H, 1000, 777, device="cuda", BLOCK_SIZE=(64, 32))
    on_cpu = create_block_mask(_cpu_twin(fn), B, H, 1000, 777, device="cpu", BLOCK_SIZE=(64, 32))
    assert on_gpu.block_kinds.device.type == "cuda"
    assert torch.equal(on_gpu.block_kinds.cpu(), on_cpu.block_kinds)
    assert torch.equal(on_gpu.kv_indices.cpu(), on_cpu.kv_indices)


def _cpu_twin(fn):
    """The same mask_mod reading CPU copies of the document ids (the GPU one reads them on the device)."""
    if fn is not _document:
        return fn
    doc = DOC.cpu()
    return lambda b, h, q_idx, kv_idx: doc[b, q_idx] == doc[b, kv_idx]
