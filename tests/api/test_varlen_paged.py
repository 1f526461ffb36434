"""``flash_attention_varlen(..., block_table=)`` (flash-attn's varlen over a paged KV cache) on every CPU
backend, against the float64 oracle of ``varlen_paged_cases.py`` (keys read back from the pages by hand, one
dense softmax per sequence): page sizes 1, 7 and 16, shuffled tables with garbage past the used pages, GQA,
``D_v != D``, a sequence with no keys, both pool layouts; bottom-right causal, a window, softcap with
per-sequence ALiBi, sinks. Gradients into ``q`` and the pools (zero on the slots no sequence reads); the
paged call equals the packed call on the same keys bitwise, dropout included; refusals by name, the pools
unchanged.
"""

from __future__ import annotations

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach.dispatch import runner
from flashattn_teach.errors import AttentionTypeError, AttentionValueError
from varlen_paged_cases import H_KV, H_Q, LENGTHS, keys_by_hand, oracle, paged_varlen

BACKENDS = ["dense", "query_major", "parallel", "key_major"]
CASES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (4, 1)},
    "softcap_alibi": {"softcap": 3.0, "alibi": True},
    "causal_sinks": {"causal": True, "sinks": True},
}


def _kwargs(case: str) -> tuple[dict, dict]:
    """The call's keywords and the oracle's, for ``case``."""
    kw = dict(CASES[case])
    if kw.pop("alibi", False):  # (B, H_q): a slope per sequence and head
        kw["alibi_slopes"] = torch.linspace(0.05, 0.6, len(LENGTHS) * H_Q).reshape(len(LENGTHS), H_Q)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.tensor([0.5, -1.0, 2.0, 0.0])
    ref = {n: kw[n] for n in ("causal", "window", "softcap", "sinks") if n in kw}
    if "alibi_slopes" in kw:
        ref["alibi"] = kw["alibi_slopes"]
    return kw, ref


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("page_size", [1, 7, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_varlen_matches_the_float64_oracle_on_every_cpu_backend(case: str, page_size: int, layout: str) -> None:
    p = paged_varlen(page_size=page_size, layout=layout)
    kw, ref_kw = _kwargs(case)
    O_ref, lse_ref = oracle(p, **ref_kw)
    for backend in BACKENDS:
        O, lse = fa.flash_attention_varlen(*p.args(), block_table=p.block_table, backend=backend, return_lse=True, **kw)
        assert O.shape == O_ref.shape and lse.shape == lse_ref.shape, backend
        torch.testing.assert_close(O.double(), O_ref, atol=2e-5, rtol=2e-5, msg=f"{case} {backend}: O")
        torch.testing.assert_close(lse.double(), lse_ref, atol=2e-5, rtol=2e-5, msg=f"{case} {backend}: lse")
    # the sequence with no keys: its rows give O = 0 and lse = sink_h (-inf without sinks)
    rows = slice(int(p.cu_q[1]), int(p.cu_q[2]))
    assert torch.equal(O[rows], torch.zeros_like(O[rows]))
    want = kw["sinks"][:, None].expand(H_Q, 2) if "sinks" in kw else torch.full((H_Q, 2), -torch.inf)
    assert torch.equal(lse[:, rows], want)


def test_the_oracle_sees_a_wrong_block_table() -> None:
    """Negative control: the same pools read through the table with two sequences' rows swapped give other
    keys, and the oracle (and the call) another answer."""
    p = paged_varlen(page_size=7)
    O, _ = oracle(p)
    swapped = p.block_table.clone()
    swapped[[0, 4]] = swapped[[4, 0]]
    O_wrong, _ = oracle(type(p)(**{**p.__dict__, "block_table": swapped}))
    assert (O - O_wrong).abs().max() > 0.1
    O_call = fa.flash_attention_varlen(*p.args(), block_table=p.block_table)
    assert (O_call.double() - O_wrong).abs().max() > 0.1


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_gradients_reach_q_and_the_pools_through_the_gather(layout: str) -> None:
    p = paged_varlen(page_size=7, layout=layout, dtype=torch.float64)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k_pages, p.v_pages)]
    O = fa.flash_attention_varlen(
        leaves[0], leaves[1], leaves[2], *p.args()[3:], block_table=p.block_table, causal=True, sinks=sinks
    )
    dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (O * dO).sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (p.q, p.k_pages, p.v_pages)]
    O_ref, _ = oracle(p, q=ref[0], k_pages=ref[1], v_pages=ref[2], causal=True, sinks=sinks)
    (O_ref * dO).sum().backward()
    torch.testing.assert_close(O, O_ref)
    for name, got, want in zip(("q", "k_pages", "v_pages"), leaves, ref, strict=True):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad, want.grad, msg=f"d{name}")
    # the slots no sequence reads (the two spare pages, the tails of last pages) get exactly zero
    read = torch.zeros(p.k_pages.shape[0], p.k_pages.shape[2], dtype=torch.bool)
    for b, (_, n_k) in enumerate(LENGTHS):
        for j in range(n_k):
            read[int(p.block_table[b, j // 7]), j % 7] = True
    assert torch.equal(leaves[1].grad.transpose(1, 2)[~read], torch.zeros_like(leaves[1].grad.transpose(1, 2)[~read]))
    assert leaves[1].grad.transpose(1, 2)[read].abs().sum() > 0


def test_the_paged_call_is_the_packed_call_on_the_same_keys_dropout_included() -> None:
    p = paged_varlen(page_size=16, layout="bnhd")
    table = p.block_table
    k, v = (
        torch.cat([keys_by_hand(pages, table, b, n_k) for b, (_, n_k) in enumerate(LENGTHS)])
        for pages in (p.k_pages, p.v_pages)
    )  # (total_k, H_kv, .)
    for backend in ("parallel", "query_major"):
        torch.manual_seed(3)
        O = fa.flash_attention_varlen(*p.args(), block_table=table, causal=True, dropout_p=0.3, backend=backend)
        torch.manual_seed(3)
        O_packed = fa.flash_attention_varlen(p.q, k, v, *p.args()[3:], causal=True, dropout_p=0.3, backend=backend)
        assert torch.equal(O, O_packed), backend
    # an int64 table reads the same pages
    O64 = fa.flash_attention_varlen(*p.args(), block_table=table.long(), causal=True)
    assert torch.equal(O64, fa.flash_attention_varlen(*p.args(), block_table=table, causal=True))


def _refusal(p, match: str, exc=AttentionValueError, **change) -> None:
    args = dict(
        zip(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"), p.args(), strict=True)
    )
    args["block_table"] = p.block_table
    args.update(change)
    before = [t.clone() for t in (p.k_pages, p.v_pages, p.block_table)]
    with pytest.raises(exc, match=match):
        fa.flash_attention_varlen(**args)
    for t, b in zip((p.k_pages, p.v_pages, p.block_table), before, strict=True):
        assert torch.equal(t, b)


def test_refusals_name_the_argument_and_leave_the_pools_alone() -> None:
    p = paged_varlen(page_size=7)
    used = -(-LENGTHS[0][1] // 7)  # pages of sequence 0
    for bad in (p.k_pages.shape[0], -1):
        table = p.block_table.clone()
        table[0, used - 1] = bad
        _refusal(p, rf"block_table\[0, {used - 1}\] = {bad} is not a page", block_table=table)
    _refusal(p, r"block_table must have shape \(5, max_blocks\)", block_table=p.block_table[:4])
    _refusal(p, "block_table must be int32", exc=AttentionTypeError, block_table=p.block_table.float())
    _refusal(p, "sequence 0 has 20 keys", block_table=p.block_table[:, :2])  # 2 pages of 7 < 20 keys
    packed = p.k_pages[0].transpose(0, 1)  # (page_size, H_kv, D): packed keys where a pool is wanted
    _refusal(p, r"k must have shape \(num_blocks, H_kv, page_size, D\)", k=packed, v=p.v_pages[0].transpose(0, 1))
    _refusal(p, "must share num_blocks, H_kv and page_size", v=p.v_pages[:, :, :6])
    _refusal(p, "same head dimension D", k=p.k_pages[..., :8])
    _refusal(p, "multiple of the key/value heads", q=p.q[:, :3])
    _refusal(p, "cu_seqlens_k must start at 0", cu_seqlens_k=p.cu_k + 1)
    _refusal(p, "max_seqlen_k = 3 is smaller", max_seqlen_k=3)
    _refusal(p, "page pools .* need block_table=", block_table=None)
    # garbage past a sequence's pages is never read: the table of the cases holds 10**6 and -1 there
    assert (p.block_table == 10**6).any() and (p.block_table == -1).any()
    assert H_KV == p.k_pages.shape[1]


@pytest.mark.parametrize("backend", ["auto", "query_major", "dense"])
def test_explain_names_the_backend_the_paged_call_runs(monkeypatch, backend: str) -> None:
    p = paged_varlen(page_size=7, layout="bnhd")
    seen = []
    run = runner.run
    monkeypatch.setattr(runner, "run", lambda plan, *a: seen.append(plan.backend) or run(plan, *a))
    fa.flash_attention_varlen(*p.args(), block_table=p.block_table, causal=True, backend=backend)
    q, k, v, cu_q, cu_k, max_q, max_k = p.args()
    plan = fa.explain(
        q,
        k,
        v,
        is_causal=True,
        causal_align="bottom_right",
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        block_table=p.block_table,
        backend=backend,
    )
    assert seen == [plan.backend] and "block_table" in plan.reason
    with pytest.raises(AttentionValueError, match="block_table is taken here with packed sequences"):
        fa.explain(q, k, v, block_table=p.block_table)


def test_no_sequences_give_empty_outputs() -> None:
    p = paged_varlen(page_size=7)
    cu = torch.zeros(1, dtype=torch.int32)
    table = torch.zeros(0, 3, dtype=torch.int32)
    O, lse = fa.flash_attention_varlen(p.q[:0], p.k_pages, p.v_pages, cu, cu, 0, 0, block_table=table, return_lse=True)
    assert O.shape == (0, H_Q, p.v_pages.shape[3]) and lse.shape == (H_Q, 0)
