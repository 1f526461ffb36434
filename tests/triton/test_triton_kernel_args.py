"""The kernels' arguments as named records (``flashattn_teach.triton.records``): no kernel takes more than 20
runtime arguments, an unused variant is None in its record (no placeholder pointer), and the records carry
what the old positional lists carried."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from flashattn_teach.dropout import DropoutKey
from flashattn_teach.triton.records import Bounds, ScoreTerms, Strided, strided
from flashattn_teach.triton.variants import PLAIN, UNBOUNDED, KernelVariants

pytest.importorskip("triton")
KERNELS_DIR = Path(__file__).resolve().parents[2] / "src" / "flashattn_teach" / "triton" / "kernels"
MAX_RUNTIME_ARGS = 20  # issue 38: constexprs do not count


def _launched_kernels():
    from flashattn_teach.triton.kernels.backward import attn_bwd_preprocess
    from flashattn_teach.triton.kernels.backward_dkdv import attn_bwd_dkdv
    from flashattn_teach.triton.kernels.backward_dq import attn_bwd_dq
    from flashattn_teach.triton.kernels.decode import decode_combine, decode_split_fwd
    from flashattn_teach.triton.kernels.forward import attn_fwd

    return [attn_fwd, attn_bwd_preprocess, attn_bwd_dkdv, attn_bwd_dq, decode_split_fwd, decode_combine]


def _params(kernel) -> list[inspect.Parameter]:
    """The Python function's parameters (``kernel.fn``: a JITFunction's, or the interpreter's stand-in's)."""
    return list(inspect.signature(kernel.fn).parameters.values())


def _runtime(kernel) -> list[str]:
    """The parameters that are not ``tl.constexpr`` (annotations are strings under postponed evaluation)."""
    return [p.name for p in _params(kernel) if "constexpr" not in str(p.annotation)]


def test_no_kernel_takes_more_than_20_runtime_arguments() -> None:
    counts = {k.fn.__name__: len(_runtime(k)) for k in _launched_kernels()}
    assert all(n <= MAX_RUNTIME_ARGS for n in counts.values()), counts
    # the widest, the one-kernel backward's dK/dV kernel, sits at the limit: a new argument goes in a record
    assert counts["attn_bwd_dkdv"] == MAX_RUNTIME_ARGS, counts


def test_no_format_skips_left_in_the_kernels() -> None:
    skipped = [f.name for f in KERNELS_DIR.glob("*.py") if "fmt: skip" in f.read_text()]
    assert skipped == []


def test_kernels_read_no_stride_argument_by_its_old_flat_name() -> None:
    """``stride_qd`` and the like are gone from the kernels' signatures: strides come with their tensor."""
    for k in _launched_kernels():
        flat = [n for n in _runtime(k) if re.fullmatch(r"stride_(q|k|v|o|do|dq|dk|dv)[bhnd]", n)]
        assert flat == [], (k.fn.__name__, flat)


def test_strided_zeroes_the_batch_stride_of_packed_sequences() -> None:
    t = torch.empty(1, 3, 10, 8).transpose(1, 2)  # (1, 10, 3, 8) viewed from (1, 3, 10, 8)
    b, h, n, d = t.stride()
    assert strided(t) == Strided(t, stride_h=h, stride_n=n, stride_b=b, stride_d=d)
    assert strided(t, varlen=True) == Strided(t, stride_h=h, stride_n=n, stride_b=0, stride_d=d)
    # a descriptor's record takes the strides of the tensor it reads
    assert strided("desc", (4, 3, 2, 1)) == Strided("desc", stride_h=3, stride_n=2, stride_b=4, stride_d=1)


def test_a_plain_call_passes_none_for_every_variant_tensor() -> None:
    """No placeholder pointer: what a call does not use is None, which the JIT makes a constexpr None."""
    assert PLAIN.bounds(0) == Bounds(OFFSET=0, LEFT=UNBOUNDED, RIGHT=UNBOUNDED, SEQLENS_K=None)
    assert PLAIN.score_terms() == ScoreTerms(softcap_log2=1.0, alibi=None, mask=None)
    assert PLAIN.packed() is None
    mods = PLAIN.mods_record(torch.device("cpu"), 64, 64, 100, 100, listed=True)
    assert mods.score_captures == (None,) * 4 and mods.mask_captures == (None,) * 4
    assert mods.kinds is None and mods.tiles is None


def test_variant_records_carry_the_variants_by_name() -> None:
    slopes = torch.rand(1, 4)  # one row for every batch element: batch stride 0
    mask = torch.zeros(2, 4, 5, 7).expand(2, 4, 5, 7)
    key = DropoutKey(p=0.25, seed=2**40 + 3, offset=96)
    v = KernelVariants(
        window=True,
        left=3,
        right=0,
        softcap=30.0,
        alibi_slopes=slopes,
        seqlens_k=torch.tensor([5, 7]),
        dropout=key,
        attn_mask=mask,
    )
    b = v.bounds(1)
    assert (b.OFFSET, b.LEFT, b.RIGHT) == (1, 3, 0) and b.SEQLENS_K is v.seqlens_k
    terms = v.score_terms()
    assert terms.softcap_log2 == pytest.approx(30.0 / torch.log(torch.tensor(2.0)).item())
    assert terms.alibi is not None and terms.alibi.ptr is slopes
    assert (terms.alibi.stride_b, terms.alibi.stride_h) == (0, slopes.stride(1))
    assert terms.mask is not None and tuple(terms.mask[1:]) == mask.stride()
    d = v.dropout_args()
    assert (d.seed, d.offset, d.threshold) == (key.seed, key.offset, key.threshold)
    assert d.keep_scale == pytest.approx(1 / (1 - 0.25))
