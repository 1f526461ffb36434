"""``explain`` covers packed sequences: given ``cu_seqlens_q, cu_seqlens_k`` it answers for the call
``flash_attention_varlen`` would make, from the same options and the same planner."""

from __future__ import annotations

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach.dispatch import runner

CU = torch.tensor([0, 5, 5, 12])  # three sequences of 5, 0 and 7 rows


def packed(H_q: int = 4, H_kv: int = 2, D: int = 8):
    g = torch.Generator().manual_seed(3)
    total = int(CU[-1])
    return tuple(torch.randn(total, h, D, generator=g) for h in (H_q, H_kv, H_kv))


@pytest.mark.parametrize("backend", ["auto", "query_major", "key_major", "dense"])
def test_explain_names_the_backend_the_varlen_call_runs(monkeypatch, backend):
    q, k, v = packed()
    seen = []
    run = runner.run
    monkeypatch.setattr(runner, "run", lambda p, *a: seen.append(p.backend) or run(p, *a))
    fa.flash_attention_varlen(q, k, v, CU, CU, 7, 7, causal=True, backend=backend)
    plan = fa.explain(
        q,
        k,
        v,
        is_causal=True,
        causal_align="bottom_right",
        cu_seqlens_q=CU,
        cu_seqlens_k=CU,
        max_seqlen_q=7,
        max_seqlen_k=7,
        backend=backend,
    )
    assert seen == [plan.backend]


def test_explain_counts_the_tiles_off_the_block_diagonal_as_skipped():
    # Two sequences of 600 rows and keys at 128 x 512 tiles: key blocks [0, 512), [512, 1024), [1024, 1200).
    # Row blocks 0-3 (sequence 0): FULL, PARTIAL (keys 512-599), SKIP. Row block 4 (rows 512-639, both
    # sequences): PARTIAL x 3. Row blocks 5-9 (sequence 1): SKIP, PARTIAL (keys 600-1023), FULL.
    cu = torch.tensor([0, 600, 1200])
    q = torch.randn(1200, 2, 8)
    text = fa.explain(
        q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=600, max_seqlen_k=600, backend="query_major"
    )
    assert "30 tiles of 128 x 512: 9 visited whole, 12 visited with a tile mask, 9 skipped" in text.reason


def test_explain_refuses_bad_bounds_as_the_call_does():
    q, k, v = packed()
    with pytest.raises(fa.AttentionValueError, match="cu_seqlens_q") as explained:
        fa.explain(q, k, v, cu_seqlens_q=torch.tensor([0, 5, 13]), cu_seqlens_k=CU, max_seqlen_q=7, max_seqlen_k=7)
    with pytest.raises(fa.AttentionValueError, match="cu_seqlens_q") as called:
        fa.flash_attention_varlen(q, k, v, torch.tensor([0, 5, 13]), CU, 7, 7)
    assert str(explained.value) == str(called.value)
