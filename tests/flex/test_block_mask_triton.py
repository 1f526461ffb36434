"""The block-mask classification kernel (:mod:`flashattn_teach.triton.kernels.block_mask`) against the CPU
classification (:mod:`flashattn_teach.flex.classify`), in Triton's interpreter on CPU tensors (on CUDA
tensors where a GPU is present): the launcher is called directly with ``@triton.jit`` mask functions of the
generated signature ``(b, h, q_idx, kv_idx, C0, C1, C2, C3)``, written here by hand.
"""

from __future__ import annotations

import pytest
import torch

from flashattn_teach.errors import AttentionValueError
from flashattn_teach.flex.block_mask import kinds_from_visibility
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
