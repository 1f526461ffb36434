"""The small CPU call's fast paths (issue 38, host cost), each against the float64 dense oracle and each shown
to be taken: the one open tile (``reference/autograd.py``, ``reference/scores.whole_row``) on every head layout
``torch.matmul`` broadcasts, the options of a plain call kept by ``make_options`` (``_validate/plain.py``),
and its plan kept with them (``dispatch/planner._memo_key``). None of them may skip a check or an option."""

from __future__ import annotations

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach import _options
from flashattn_teach._options import PLAIN_CACHE_SIZE, make_options
from flashattn_teach.dispatch import planner
from flashattn_teach.errors import AttentionTypeError, AttentionValueError, BackendUnavailableError
from flashattn_teach.reference import autograd, dense_attention, parallel
from flashattn_teach.reference.scores import whole_row


def _tensors(*shapes, dtype=torch.float64, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad) for s in shapes]


@pytest.fixture
def open_tiles(monkeypatch):
    """The number of open tiles run (``whole_row`` calls from the autograd function's forward)."""
    calls = []
    whole_row = autograd.whole_row

    def counted(S, v, out=None, **keywords):
        calls.append(tuple(S.shape))
        return whole_row(S, v, out, **keywords)

    monkeypatch.setattr(autograd, "whole_row", counted)
    return calls


# (q, k, v) shapes whose heads torch.matmul broadcasts as they stand
LAYOUTS = {
    "(1, 8, 16, 64)": ((1, 8, 16, 64), (1, 8, 16, 64), (1, 8, 16, 64)),
    "(2, 8, 128, 64)": ((2, 8, 128, 64), (2, 8, 128, 64), (2, 8, 128, 64)),
    "2-D": ((7, 16), (9, 16), (9, 8)),
    "3-D, D_v != D": ((5, 7, 16), (5, 9, 16), (5, 9, 8)),
    "one key/value head": ((2, 4, 6, 16), (2, 1, 9, 16), (2, 1, 9, 16)),
    "one query head, four key/value heads": ((2, 1, 6, 16), (2, 4, 9, 16), (2, 4, 9, 16)),  # without GQA
    "one key head, four value heads": ((2, 4, 6, 16), (2, 1, 9, 16), (2, 4, 9, 12)),
    "batch broadcast": ((1, 4, 6, 16), (3, 4, 9, 16), (3, 4, 9, 16)),
    "ranks differ": ((4, 6, 16), (2, 4, 9, 16), (2, 4, 9, 16)),
}


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_open_tile_matches_the_dense_oracle_with_and_without_grad(layout, softcap, open_tiles):
    shapes = LAYOUTS[layout]
    gqa = layout != "one query head, four key/value heads"  # that one is torch's broadcast, not GQA
    q, k, v = _tensors(*shapes, grad=True)
    O_ref, lse_ref = dense_attention(q, k, v, softcap=softcap, enable_gqa=gqa, return_lse=True)
    dO = torch.randn_like(O_ref)
    with torch.no_grad():  # float32, no autograd function
        O32, lse32 = fa.flash_attention(
            q.float(), k.float(), v.float(), softcap=softcap, enable_gqa=gqa, return_lse=True
        )
    torch.testing.assert_close(O32.double(), O_ref.detach(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse32.double(), lse_ref.detach(), atol=2e-6, rtol=1e-5)
    O, lse = fa.flash_attention(q, k, v, softcap=softcap, enable_gqa=gqa, return_lse=True)  # float64, with grad
    torch.testing.assert_close(O, O_ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, lse_ref, atol=1e-12, rtol=1e-10)
    grads = torch.autograd.grad((O * dO).sum() + lse.sum(), (q, k, v))
    grads_ref = torch.autograd.grad((O_ref * dO).sum() + lse_ref.sum(), (q, k, v))
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-10, rtol=1e-8)
    assert len(open_tiles) == 2  # both calls took the open tile


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_open_tile_computes_in_float32_for_half_inputs(dtype, open_tiles):
    q, k, v = _tensors((2, 4, 10, 32), (2, 4, 12, 32), (2, 4, 12, 32), dtype=dtype)
    O, lse = fa.flash_attention(q, k, v, return_lse=True)
    O_ref, lse_ref = dense_attention(q.double(), k.double(), v.double(), return_lse=True)
    assert O.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(O.double(), O_ref, atol=1e-2, rtol=1e-2)  # O rounded to the input dtype
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)  # lse in float32
    assert len(open_tiles) == 1


def test_the_open_tile_runs_its_products_in_float32_under_autocast(open_tiles):
    q, k, v = _tensors((1, 4, 10, 32), (1, 4, 12, 32), (1, 4, 12, 32), dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        O, lse = fa.flash_attention(q, k, v, return_lse=True)
    qb, kb, vb = (t.to(torch.bfloat16).double() for t in (q, k, v))  # the inputs autocast hands over
    O_ref, lse_ref = dense_attention(qb, kb, vb, return_lse=True)
    assert O.dtype == torch.bfloat16
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)  # bfloat16 products would miss this
    torch.testing.assert_close(O.double(), O_ref, atol=1e-2, rtol=1e-2)
    assert len(open_tiles) == 1


@pytest.mark.parametrize("given", [False, True], ids=["new O", "O into out"])
def test_whole_row_writes_P_over_its_tile_and_O_into_out(given):
    """Two buffers a call, ``S`` and ``O``: ``S`` becomes ``P`` and ``O`` goes into ``out`` (each buffer more
    cost 470-600 page faults a call at (2, 8, 128, 64), host_cost.md); ``O`` and ``lse`` are the softmax's,
    against float64 by hand."""
    S0, v, buf = _tensors((2, 3, 5, 7), (2, 3, 7, 4), (2, 3, 5, 4))
    S = S0.clone()
    O, lse = whole_row(S, v, buf if given else None)
    assert (O.data_ptr() == buf.data_ptr()) == given
    torch.testing.assert_close(S, torch.softmax(S0, dim=-1), atol=0, rtol=0)
    torch.testing.assert_close(lse, torch.logsumexp(S0, dim=-1), atol=1e-14, rtol=1e-14)
    torch.testing.assert_close(O, torch.softmax(S0, dim=-1) @ v, atol=1e-14, rtol=1e-14)


def test_the_open_tile_under_torch_func_transforms(open_tiles):
    """vmap, grad and jvp run the open tile too (their tensors take no ``out=``: a new ``P`` there)."""
    qs, k, v = _tensors((3, 2, 4, 6, 8), (2, 4, 9, 8), (2, 4, 9, 8))
    O = torch.func.vmap(lambda q: fa.flash_attention(q, k, v))(qs)
    torch.testing.assert_close(O, torch.stack([dense_attention(q, k, v) for q in qs]), atol=1e-12, rtol=1e-10)
    q = qs[0]
    dq = torch.func.grad(lambda q: fa.flash_attention(q, k, v).sum())(q)
    torch.testing.assert_close(dq, torch.func.grad(lambda q: dense_attention(q, k, v).sum())(q), atol=1e-10, rtol=1e-8)
    t = torch.randn_like(q)
    _, tO = torch.func.jvp(lambda q: fa.flash_attention(q, k, v), (q,), (t,))
    torch.testing.assert_close(
        tO, torch.func.jvp(lambda q: dense_attention(q, k, v), (q,), (t,))[1], atol=1e-10, rtol=1e-8
    )
    assert len(open_tiles) >= 3


# what keeps a call off the open tile: each is a mask, a bias, dropout, sinks, or heads matmul cannot broadcast
NOT_OPEN = {
    "causal": {"causal": True},
    "window": {"window": (3, 3)},
    "alibi": {"alibi_slopes": torch.full((4,), 0.5, dtype=torch.float64)},
    "seqlens_k": {"seqlens_k": torch.tensor([5, 12])},
    "attn_mask": {"attn_mask": torch.ones(10, 12, dtype=torch.bool)},
    "sinks": {"sinks": torch.zeros(4, dtype=torch.float64)},
    "grouped heads": {"kv_heads": 2},
    "the key-major loop": {"backend": "key_major"},
}


@pytest.mark.parametrize("case", list(NOT_OPEN))
def test_the_other_calls_take_the_tile_loop_and_match_the_oracle(case, open_tiles):
    kw = dict(NOT_OPEN[case])
    H_kv = kw.pop("kv_heads", 4)
    q, k, v = _tensors((2, 4, 10, 16), (2, H_kv, 12, 16), (2, H_kv, 12, 16))
    O = fa.flash_attention(q, k, v, **kw)
    kw.pop("backend", None)
    torch.testing.assert_close(O, dense_attention(q, k, v, enable_gqa=True, **kw), atol=1e-12, rtol=1e-10)
    assert open_tiles == []


def test_dropout_takes_the_tile_loop(open_tiles):
    q, k, v = _tensors((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16))
    torch.manual_seed(3)
    O = fa.flash_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(3)
    assert torch.equal(O, fa.flash_attention(q, k, v, dropout_p=0.3))  # the same key drawn again
    assert open_tiles == []
    assert not torch.equal(O, fa.flash_attention(q, k, v))
    assert len(open_tiles) == 1


# ---------------------------------------------------------------------------------- make_options' cache


def test_a_plain_call_s_options_are_checked_once_and_found_again(monkeypatch):
    q, k, v = _tensors((1, 8, 16, 64), (1, 8, 16, 64), (1, 8, 16, 64), dtype=torch.float32)
    first = make_options(q, k, v, causal=True, scale=0.5)
    checks = []
    validate = _options.validate_inputs
    monkeypatch.setattr(_options, "validate_inputs", lambda *a, **kw: checks.append(1) or validate(*a, **kw))
    q2, k2, v2 = (t.clone() for t in (q, k, v))  # other tensors, the same types, dtypes, devices and shapes
    assert make_options(q2, k2, v2, causal=True, scale=0.5) is first
    assert checks == []


# each changes one thing the options depend on; none may find the first call's options
VARIANTS = {
    "query length": lambda q, k, v: ((q[..., :5, :], k, v), {}),
    "dtype": lambda q, k, v: ((q.double(), k.double(), v.double()), {}),
    "heads of key and value": lambda q, k, v: ((q, k[:, :1], v[:, :1]), {}),
    "causal": lambda q, k, v: ((q, k, v), {"causal": True}),
    "scale": lambda q, k, v: ((q, k, v), {"scale": 0.5}),  # the default is 1 / sqrt(16)
    "window": lambda q, k, v: ((q, k, v), {"window": (2, 0)}),
    "softcap": lambda q, k, v: ((q, k, v), {"softcap": 5.0}),
    "dropout_p": lambda q, k, v: ((q, k, v), {"dropout_p": 0.1}),
    "deterministic": lambda q, k, v: ((q, k, v), {"deterministic": True}),
    "causal_align": lambda q, k, v: ((q, k, v), {"causal_align": "bottom_right", "causal": True}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_options_that_differ_in_anything_are_not_found(variant):
    q, k, v = _tensors((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16), dtype=torch.float32)
    plain = make_options(q, k, v)
    tensors, keywords = VARIANTS[variant](q, k, v)
    other = make_options(*tensors, **keywords)
    assert other is not plain and other != plain
    _options._PLAIN.clear()
    assert make_options(*tensors, **keywords) == other  # as checked afresh


def test_the_cache_skips_no_check():
    q, k, v = _tensors((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16), dtype=torch.float32)
    make_options(q, k, v, causal=True, window=(1, 0), scale=1.0, dropout_p=0.0)
    with pytest.raises(AttentionTypeError, match="causal must be a bool"):
        make_options(q, k, v, causal=1)  # 1 == True as a dict key
    with pytest.raises(AttentionTypeError, match="window left must be an int"):
        make_options(q, k, v, causal=True, window=(True, 0))  # (True, 0) == (1, 0)
    with pytest.raises(AttentionValueError, match="scale must be finite"):
        make_options(q, k, v, scale=float("nan"))
    with pytest.raises(AttentionValueError, match="dropout_p must be in"):
        make_options(q, k, v, dropout_p=1.5)
    with pytest.raises(AttentionTypeError, match="one dtype"):
        make_options(q, k.double(), v)
    with pytest.raises(AttentionValueError, match="one device"):
        make_options(q, k, v.to("meta"))
    # what the key does not take is checked every time, and gives the same options
    listed = make_options(q, k, v, causal=True, window=[1, 0], scale=1.0)
    assert listed == make_options(q, k, v, causal=True, window=(1, 0), scale=1.0)


def test_calls_with_tensors_functions_or_subclasses_are_checked_every_time():
    q, k, v = _tensors((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), dtype=torch.float32)
    mask = torch.ones(4, 4, dtype=torch.bool)
    assert make_options(q, k, v, attn_mask=mask) is not make_options(q, k, v, attn_mask=mask)
    mod = lambda s, b, h, i, j: s  # noqa: E731
    assert make_options(q, k, v, score_mod=mod) is not make_options(q, k, v, score_mod=mod)
    p = torch.nn.Parameter(q)
    assert make_options(p, k, v) is not make_options(p, k, v)


def test_the_cache_is_bounded_and_not_read_while_compiling(monkeypatch):
    for n in range(1, PLAIN_CACHE_SIZE + 10):
        q = torch.zeros(1, 1, n, 4)
        make_options(q, q, q)
        assert len(_options._PLAIN) <= PLAIN_CACHE_SIZE
    q = torch.zeros(1, 1, 3, 4)
    assert make_options(q, q, q) is make_options(q, q, q)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert make_options(q, q, q) is not make_options(q, q, q)


# ------------------------------------------------------------------------------------- the plan's memo


def test_a_plain_call_s_plan_is_kept_with_its_options():
    q, k, v = _tensors((1, 8, 16, 64), (1, 8, 16, 64), (1, 8, 16, 64), dtype=torch.float32)
    opts = make_options(q, k, v)
    p = planner.plan(q, k, v, opts)
    assert planner.plan(q, k, v, opts) is p
    assert p == planner._plan(q, k, v, opts, "auto")
    assert planner.plan(q, k, v, opts, "dense") == planner.Plan("dense", "requested explicitly")


def test_the_plan_s_memo_follows_what_the_plan_reads(monkeypatch):
    q, k, v = _tensors((1, 8, 16, 64), (1, 8, 16, 64), (1, 8, 16, 64), dtype=torch.float32)
    opts = make_options(q, k, v)
    small = planner.plan(q, k, v, opts)
    monkeypatch.setattr(parallel, "MIN_PARALLEL_SCORES", 0)
    spread = planner.plan(q, k, v, opts)
    assert "too few for the worker threads" in small.reason and "too few" not in spread.reason
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert f"over {threads + 1} single-threaded workers" in planner.plan(q, k, v, opts).reason
    finally:
        torch.set_num_threads(threads)
    assert planner._memo_key(q, opts, "triton") is None  # asked every time: the support questions read the tensors
    monkeypatch.setattr(planner, "transforms_active", lambda: True)
    assert planner.plan(q, k, v, opts).backend == "query_major"
    with pytest.raises(BackendUnavailableError, match=r"torch\.func transform"):
        planner.plan(q, k, v, opts, "parallel")


def test_a_mask_that_comes_to_require_grad_is_planned_again():
    q, k, v = _tensors((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8))
    mask = torch.zeros(4, 4, dtype=torch.float64)
    opts = make_options(q, k, v, attn_mask=mask)
    assert planner.plan(q, k, v, opts).backend == "parallel"
    mask.requires_grad_(True)
    assert planner.plan(q, k, v, opts).backend == "dense"
