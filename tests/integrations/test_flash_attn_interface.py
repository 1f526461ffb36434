"""flashattn_teach.flash_attn_interface: flash-attn 2's functions in flash-attn's ``(B, N, H, D)`` layout.

Each function is judged against a float64 reference written here in flash-attn's layout and conventions
(bottom-right causal and windows, ALiBi at ``|i + N_k - N_q - j|``, ``softcap <= 0`` no cap), or torch's
SDPA, never against the library function it calls. Shapes keep ``N != H`` so that a layout mistake cannot
pass: ``flashattn_teach.flash_attention`` given the same tensors (torch's layout) is shown to differ.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import flashattn_teach as fa
from flashattn_teach import flash_attn_interface as fi

F64 = torch.float64


def _randn(*shape, seed=0, dtype=F64, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)


def _reference(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None):
    """float64 ``(out (B, N_q, H, D_v), lse (B, H, N_q))`` by flash-attn's documented rules."""
    _, N_q, H, D = q.shape
    N_k, H_kv = k.shape[1], k.shape[2]
    k, v = (t.double().repeat_interleave(H // H_kv, dim=2) for t in (k, v))
    S = torch.einsum("bihd,bjhd->bhij", q.double(), k) * (scale if scale is not None else D**-0.5)
    if softcap > 0:
        S = softcap * torch.tanh(S / softcap)
    i = torch.arange(N_q)[:, None] + N_k - N_q  # each row's diagonal, bottom-right
    j = torch.arange(N_k)[None, :]
    if alibi is not None:
        S = S - alibi.double().reshape(-1, H, 1, 1) * (i - j).abs()
    left, right = window[0], 0 if causal else window[1]
    hidden = torch.zeros(N_q, N_k, dtype=torch.bool)
    if left >= 0:
        hidden |= j < i - left
    if right >= 0:
        hidden |= j > i + right
    S = S.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(S, dim=-1)
    P = torch.exp(S - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", P, v), lse


def test_flash_attn_func_takes_flash_attns_layout_where_flash_attention_takes_torchs():
    q, k, v = _randn(2, 7, 3, 8, seed=1), _randn(2, 7, 3, 8, seed=2), _randn(2, 7, 3, 8, seed=3)
    out = fi.flash_attn_func(q, k, v)
    sdpa = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(out, sdpa)
    assert out.shape == (2, 7, 3, 8) and out.is_contiguous()  # flash-attn's layout, as .view() needs
    # the mistake this module exists for: the same tensors given to flash_attention are read as 3 heads of 7...
    # tokens the wrong way round: right shape, wrong values
    wrong = fa.flash_attention(q, k, v)
    assert wrong.shape == out.shape and (wrong - out).abs().max() > 0.1


@pytest.mark.parametrize("N_q, N_k", [(5, 9), (9, 5), (6, 6)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_matches_flash_attns_rules_with_every_option(N_q, N_k, causal):
    q, k, v = _randn(2, N_q, 4, 16, seed=1), _randn(2, N_k, 2, 16, seed=2), _randn(2, N_k, 2, 16, seed=3)
    q = q * 4  # scores past the softcap
    alibi = torch.rand(2, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float32)
    window = torch.tensor([3, 1])  # flash-attn's tests pass the window as a tensor
    out, lse, S_dmask = fi.flash_attn_func(
        q, k, v, 0.0, None, causal, window, 5.0, alibi, False, True
    )  # flash-attn's positions: dropout_p, softmax_scale, causal, window_size, softcap, alibi, deterministic, probs
    expected, expected_lse = _reference(q, k, v, causal=causal, window=(3, 1), softcap=5.0, alibi=alibi)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)
    assert lse.shape == (2, 4, N_q) and S_dmask.numel() == 0  # flash-attn: no S_dmask without dropout


def test_softcap_zero_or_below_is_no_cap_and_scale_is_honoured():
    q, k, v = _randn(1, 5, 2, 8, seed=1) * 5, _randn(1, 6, 2, 8, seed=2), _randn(1, 6, 2, 8, seed=3)
    torch.testing.assert_close(fi.flash_attn_func(q, k, v, softcap=-1.0), _reference(q, k, v)[0])
    torch.testing.assert_close(fi.flash_attn_func(q, k, v, softmax_scale=0.3), _reference(q, k, v, scale=0.3)[0])


def test_packed_forms_equal_the_unpacked_call_and_their_gradients_reach_the_packed_tensor():
    qkv = _randn(2, 6, 3, 3, 8, seed=1, requires_grad=True)
    out = fi.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = qkv.detach().unbind(2)
    torch.testing.assert_close(out, _reference(q, k, v, causal=True)[0])
    out.sum().backward()
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    _reference(q2, k2, v2, causal=True)[0].sum().backward()
    torch.testing.assert_close(qkv.grad, torch.stack([q2.grad, k2.grad, v2.grad], dim=2))

    q = _randn(2, 4, 4, 8, seed=2)
    kv = _randn(2, 7, 2, 2, 8, seed=3)
    out, lse, _ = fi.flash_attn_kvpacked_func(q, kv, causal=True, return_attn_probs=True)
    expected, expected_lse = _reference(q, kv[:, :, 0], kv[:, :, 1], causal=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)


def _keep_and_weights(S_dmask, lse, q, k, *, causal):
    """What flash-attn's tests read from S_dmask: the keep mask (sign) and the softmax weights."""
    _, N_q, H, D = q.shape
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double().repeat_interleave(H // k.shape[2], dim=2))
    scores = scores * D**-0.5
    if causal:
        N_k = k.shape[1]
        scores = scores.masked_fill(torch.ones(N_q, N_k, dtype=torch.bool).tril(N_k - N_q).logical_not(), -math.inf)
    m = scores.amax(-1, keepdim=True)
    return S_dmask >= 0, S_dmask.abs() * torch.exp(m - lse[..., None])


@pytest.mark.parametrize("causal", [False, True])
def test_return_attn_probs_with_dropout_gives_the_weights_and_the_pattern_the_call_used(causal):
    q, k, v = _randn(2, 40, 4, 8, seed=1), _randn(2, 50, 2, 8, seed=2), _randn(2, 50, 2, 8, seed=3)
    torch.manual_seed(7)
    out, lse, S_dmask = fi.flash_attn_func(q, k, v, 0.3, causal=causal, return_attn_probs=True)
    assert S_dmask.shape == (2, 4, 40, 50) and S_dmask.dtype == q.dtype
    keep, P = _keep_and_weights(S_dmask, lse, q, k, causal=causal)
    torch.testing.assert_close(P, torch.softmax(P.log(), dim=-1).nan_to_num(0.0))  # each row sums to 1
    rebuilt = torch.einsum("bhij,bjhd->bihd", P * keep / 0.7, v.repeat_interleave(2, dim=2))
    torch.testing.assert_close(out, rebuilt)  # exactly the weights the call dropped
    visible = P > 0
    assert abs((~keep & visible).sum() / visible.sum() - 0.3) < 0.03
    torch.manual_seed(7)  # the same seed, the same call
    torch.testing.assert_close(fi.flash_attn_func(q, k, v, 0.3, causal=causal), out, atol=0, rtol=0)


def _packing(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_varlen_functions_match_each_sequence_alone():
    lengths_q, lengths_k = [3, 0, 6], [5, 2, 6]
    cu_q, cu_k = _packing(lengths_q), _packing(lengths_k)
    q, k, v = _randn(9, 4, 8, seed=1), _randn(13, 2, 8, seed=2), _randn(13, 2, 8, seed=3)
    alibi = torch.rand(3, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float32)
    out, lse, empty = fi.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 6, 6, causal=True, window_size=(2, -1), alibi_slopes=alibi, return_attn_probs=True
    )
    assert out.shape == (9, 4, 8) and lse.shape == (4, 9) and empty.numel() == 0
    for b in range(3):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lengths_q[b] == 0:
            continue
        expected, expected_lse = _reference(
            q[None, rq], k[None, rk], v[None, rk], causal=True, window=(2, -1), alibi=alibi[b : b + 1]
        )
        torch.testing.assert_close(out[rq], expected[0])
        torch.testing.assert_close(lse[:, rq], expected_lse[0])

    kv = torch.stack([k, v], dim=1)  # (total_k, 2, H_kv, D)
    packed = fi.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 6, 6, causal=True, window_size=(2, -1))
    torch.testing.assert_close(
        packed, fi.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, causal=True, window_size=(2, -1))
    )

    qkv = _randn(11, 3, 2, 8, seed=5)
    cu = _packing([4, 7])
    out = fi.flash_attn_varlen_qkvpacked_func(qkv, cu, 7, causal=True)
    for b, rows in enumerate((slice(0, 4), slice(4, 11))):
        q1, k1, v1 = (t[None, rows] for t in qkv.unbind(1))
        torch.testing.assert_close(out[rows], _reference(q1, k1, v1, causal=True)[0][0], msg=f"sequence {b}")


def test_varlen_paged_pools_in_flash_attns_layout():
    cu_q, cu_k = _packing([2, 3]), _packing([5, 7])
    q, k, v = _randn(5, 2, 8, seed=1), _randn(12, 1, 8, seed=2), _randn(12, 1, 8, seed=3)
    page = 4
    pool_k, pool_v = _randn(6, page, 1, 8, seed=4), _randn(6, page, 1, 8, seed=5)  # (num_blocks, page, H_kv, D)
    table = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    for b, (k0, n) in enumerate(((0, 5), (5, 7))):
        for j in range(n):
            pool_k[table[b, j // page], j % page] = k[k0 + j]
            pool_v[table[b, j // page], j % page] = v[k0 + j]
    paged = fi.flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, 3, 7, causal=True, block_table=table)
    torch.testing.assert_close(paged, fi.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 7, causal=True))


def test_varlen_dropout_weights_are_the_ones_the_call_used():
    cu_q, cu_k = _packing([5, 8]), _packing([9, 6])
    q, k, v = _randn(13, 2, 8, seed=1), _randn(15, 2, 8, seed=2), _randn(15, 2, 8, seed=3)
    torch.manual_seed(3)
    out, lse, S_dmask = fi.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 9, 0.25, return_attn_probs=True)
    assert S_dmask.shape == (2, 2, 8, 9)
    for b in range(2):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        n_q, n_k = rq.stop - rq.start, rk.stop - rk.start
        seq = S_dmask[b : b + 1, :, :n_q, :n_k]
        assert (S_dmask[b, :, n_q:] == 0).all() and (S_dmask[b, :, :, n_k:] == 0).all()
        keep, P = _keep_and_weights(seq, lse[None, :, rq], q[None, rq], k[None, rk], causal=False)
        rebuilt = torch.einsum("bhij,bjhd->bihd", P * keep / 0.75, v[None, rk])
        torch.testing.assert_close(out[rq], rebuilt[0])


def _rotate(x, cos, sin, positions, interleaved):
    """Rotary embedding as complex multiplication: pair p of token t times exp(i theta[t, p])."""
    R = 2 * cos.shape[1]
    xr = x[..., :R].double()
    pairs = xr.unflatten(-1, (-1, 2)) if interleaved else torch.stack(xr.chunk(2, dim=-1), dim=-1)
    z = torch.view_as_complex(pairs.contiguous()) * torch.polar(
        torch.ones_like(cos.double()), torch.atan2(sin.double(), cos.double())
    )[positions].unsqueeze(-2)
    rotated = torch.view_as_real(z)
    rotated = rotated.flatten(-2) if interleaved else torch.cat(rotated.unbind(-1), dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., R:]], dim=-1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_with_kvcache_appends_in_place_and_attends_in_flash_attns_layout(causal, interleaved):
    B, N_max, H, H_kv, D, n_new = 2, 12, 4, 2, 8, 3
    q = _randn(B, n_new, H, D, seed=1)
    k_cache, v_cache = _randn(B, N_max, H_kv, D, seed=2), _randn(B, N_max, H_kv, D, seed=3)
    k, v = _randn(B, n_new, H_kv, D, seed=4), _randn(B, n_new, H_kv, D, seed=5)
    seqlens = torch.tensor([4, 7], dtype=torch.int32)
    angle = _randn(N_max, 2, seed=6)  # rotary_dim 4 of D = 8
    cos, sin = angle.cos(), angle.sin()
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out, lse = fi.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cos, sin, seqlens, causal=causal, rotary_interleaved=interleaved,
        return_softmax_lse=True,
    )  # fmt: skip
    assert out.shape == (B, n_new, H, D) and lse.shape == (B, H, n_new)
    for b in range(B):
        s = int(seqlens[b])
        new_positions = torch.arange(s, s + n_new)[None]
        k_ro = _rotate(k[b : b + 1], cos, sin, new_positions, interleaved)
        torch.testing.assert_close(k_cache[b, s : s + n_new], k_ro[0])  # written in place, rotated
        torch.testing.assert_close(v_cache[b, s : s + n_new], v[b])
        torch.testing.assert_close(k_cache[b, :s], before_k[b, :s], atol=0, rtol=0)  # the rest untouched
        torch.testing.assert_close(v_cache[b, s + n_new :], before_v[b, s + n_new :], atol=0, rtol=0)
        q_positions = new_positions if causal else torch.full((1, n_new), s)
        q_ro = _rotate(q[b : b + 1], cos, sin, q_positions, interleaved)
        keys, values = k_cache[b : b + 1, : s + n_new], v_cache[b : b + 1, : s + n_new]
        expected, expected_lse = _reference(q_ro, keys, values, causal=causal)
        torch.testing.assert_close(out[b : b + 1], expected)
        torch.testing.assert_close(lse[b : b + 1], expected_lse)


def test_with_kvcache_batch_idx_leftpad_and_pages():
    B, B_cache, N_max, H, D = 2, 4, 10, 2, 8
    q = _randn(B, 1, H, D, seed=1)
    k_cache, v_cache = _randn(B_cache, N_max, H, D, seed=2), _randn(B_cache, N_max, H, D, seed=3)
    k, v = _randn(B, 1, H, D, seed=4), _randn(B, 1, H, D, seed=5)
    seqlens, rows = torch.tensor([5, 8], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32)
    leftpad = torch.tensor([2, 0], dtype=torch.int32)
    other_rows = k_cache[[0, 2]].clone()
    out = fi.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_batch_idx=rows, cache_leftpad=leftpad
    )
    assert torch.equal(k_cache[[0, 2]], other_rows)  # rows no element names are untouched
    for b in range(B):
        r, s, first = int(rows[b]), int(seqlens[b]), int(leftpad[b])
        torch.testing.assert_close(k_cache[r, s], k[b, 0])
        torch.testing.assert_close(v_cache[r, s], v[b, 0])
        expected, _ = _reference(q[b : b + 1], k_cache[r : r + 1, first : s + 1], v_cache[r : r + 1, first : s + 1])
        torch.testing.assert_close(out[b : b + 1], expected)

    page = 3  # the same caches as pages (num_blocks, page, H_kv, D) through a block table
    table = torch.tensor([[5, 0, 3, 7], [1, 6, 2, 4]], dtype=torch.int32)
    pool_k, pool_v = _randn(8, page, H, D, seed=6), _randn(8, page, H, D, seed=7)
    for b in range(B):
        for j in range(N_max):
            pool_k[table[b, j // page], j % page] = k_cache[int(rows[b]), j]
            pool_v[table[b, j // page], j % page] = v_cache[int(rows[b]), j]
    contiguous = fi.flash_attn_with_kvcache(q, k_cache[rows.long()], v_cache[rows.long()], cache_seqlens=seqlens + 1)
    paged = fi.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=seqlens + 1, block_table=table)
    torch.testing.assert_close(paged, contiguous)


def test_with_kvcache_without_cache_seqlens_reads_the_whole_cache():
    q, k_cache, v_cache = _randn(2, 2, 2, 8, seed=1), _randn(2, 6, 1, 8, seed=2), _randn(2, 6, 1, 8, seed=3)
    out = fi.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, causal=True)[0])


def test_what_cannot_be_done_is_refused_by_name():
    q4 = _randn(2, 5, 2, 8)
    with pytest.raises(ValueError, match=r"q must be \(batch_size, seqlen, nheads, headdim\).*flash_attention"):
        fi.flash_attn_func(q4[0], q4[0], q4[0])  # (N, H, D): a varlen layout given to the padded function
    with pytest.raises(ValueError, match=r"qkv must be \(batch_size, seqlen, 3, nheads, headdim\)"):
        fi.flash_attn_qkvpacked_func(_randn(2, 5, 2, 2, 8))
    with pytest.raises(TypeError, match="window_size must be a pair"):
        fi.flash_attn_func(q4, q4, q4, window_size=3)
    k_cache = _randn(2, 9, 2, 8)
    with pytest.raises(ValueError, match="pass cache_seqlens"):
        fi.flash_attn_with_kvcache(q4[:, :1], k_cache, k_cache.clone(), q4[:, :1], q4[:, :1])
    with pytest.raises(ValueError, match="cache_batch_idx selects rows of contiguous caches"):
        fi.flash_attn_with_kvcache(
            q4[:, :1], k_cache, k_cache, cache_seqlens=1, cache_batch_idx=torch.tensor([0, 1]),
            block_table=torch.zeros(2, 1, dtype=torch.int32),
        )  # fmt: skip
    angle = _randn(9, 2)
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin rotate the new keys"):
        fi.flash_attn_with_kvcache(q4[:, :1], k_cache, k_cache, cache_seqlens=1, rotary_cos=angle, rotary_sin=angle)
    before = k_cache.clone()
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin have 3 positions"):
        fi.flash_attn_with_kvcache(
            q4[:, :1], k_cache, k_cache.clone(), q4[:, :1], q4[:, :1], angle[:3].cos(), angle[:3].sin(),
            cache_seqlens=4,
        )  # fmt: skip
    assert torch.equal(k_cache, before)  # refused before anything was written


def test_flash_attns_test_helpers_read_s_dmask_as_one_block():
    assert fi._get_block_size_n(torch.device("cpu"), 64, True, False) >= 2**31
    assert fi.USE_TRITON_ROCM is False


def test_flash_attentions_docstring_says_its_layout_and_where_flash_attns_lives():
    opening = fa.flash_attention.__doc__.split("Args:")[0]
    assert "(B, H, N, D)" in opening and "flashattn_teach.flash_attn_interface" in opening
