"""The plain call's questions, asked with fewer Python calls (issue 38, host cost), still answer as before:
the FP8 question (``_validate/fp8.fp8_call``, each input's dtype written out) and the planner's backend
check (``dispatch/planner.plan``, which asks nothing of the default ``"auto"``)."""

from __future__ import annotations

import warnings

import pytest
import torch

from flashattn_teach._options import make_options
from flashattn_teach._validate.fp8 import fp8_call
from flashattn_teach.dispatch import planner
from flashattn_teach.errors import AttentionValueError

FP8 = [d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2")) if d is not None]


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("where", [0, 1, 2], ids=["q", "k", "v"])
def test_a_float8_input_anywhere_makes_an_fp8_call(where, dtype):
    qkv = [torch.zeros(1, 2, 4, 8) for _ in range(3)]
    assert not fp8_call(*qkv, (None, None, None))
    qkv[where] = qkv[where].to(dtype)
    assert fp8_call(*qkv, (None, None, None))


def test_descales_or_non_tensors():
    q = torch.zeros(1, 2, 4, 8)
    assert fp8_call(q, q, q, (None, torch.ones(1, 2), None))  # a descale given: checked as FP8
    assert not fp8_call([1.0], "k", None, (None, None, None))  # not tensors: validation names them later


def test_the_planner_still_checks_every_backend_but_the_default():
    q = torch.zeros(1, 2, 4, 8)
    opts = make_options(q, q, q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert planner.plan(q, q, q, opts).backend == "parallel"  # "auto": no warning, no check
    with pytest.warns(DeprecationWarning, match="'online' is deprecated"):
        assert planner.plan(q, q, q, opts, "online").backend == "query_major"
    with pytest.raises(AttentionValueError, match="backend must be one of"):
        planner.plan(q, q, q, opts, "fast")
