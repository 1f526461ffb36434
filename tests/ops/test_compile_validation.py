"""Under ``torch.compile`` a call is checked as in eager mode, before the custom op: the same inputs give the
same errors, and every scalar eager mode accepts (numpy floats, one-element tensors) compiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashattn_teach as fa

# dynamo's "eager" backend: the graph is captured as in any compile, then run without code generation
COMPILE = dict(backend="eager")


def _qkv(seed=0, B=2, H=2, N=8, D=16, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(3))


def _packed(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(9, 2, 8, generator=g, dtype=dtype) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    return q, k, v, cu, cu, 5, 5


BAD_FLASH = {
    "causal=1": dict(causal=1),
    "return_lse=1": dict(return_lse=1),
    "window=(2,)": dict(window=(2,)),
    "window=(1.5, 0)": dict(window=(1.5, 0)),
    "softcap=-1": dict(softcap=-1.0),
    "dropout_p=2": dict(dropout_p=2.0),
    "scale=inf": dict(scale=float("inf")),
    "causal_align": dict(causal_align="middle"),
    "backend": dict(backend="bogus"),
    "enable_gqa=1": dict(enable_gqa=1),
}


def _error(fn):
    try:
        fn()
    except Exception as e:
        return type(e), str(e)
    return None


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("case", sorted(BAD_FLASH))
def test_compiled_flash_attention_refuses_what_eager_refuses(case, fullgraph):
    q, k, v = _qkv()
    kw = BAD_FLASH[case]
    expected = _error(lambda: fa.flash_attention(q, k, v, **kw))
    assert expected is not None and issubclass(expected[0], (TypeError, ValueError)), expected
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: fa.flash_attention(q, k, v, **kw), fullgraph=fullgraph, **COMPILE)
    # With fullgraph=True dynamo reports an exception raised while tracing as its own error, which quotes ours.
    with pytest.raises(Exception if fullgraph else expected[0]) as got:
        compiled(q, k, v)
    assert expected[1] in str(got.value)


@pytest.mark.parametrize("kw", [dict(is_causal=1), dict(enable_gqa="yes"), dict(dropout_p=-0.5)], ids=str)
def test_compiled_sdpa_refuses_what_eager_refuses(kw):
    q, k, v = _qkv()
    expected = _error(lambda: fa.scaled_dot_product_attention(q, k, v, **kw))
    assert expected is not None
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: fa.scaled_dot_product_attention(q, k, v, **kw), **COMPILE)
    with pytest.raises(expected[0], match=None) as got:
        compiled(q, k, v)
    assert expected[1] in str(got.value)


@pytest.mark.parametrize("case", ["causal=1", "return_lse=1", "window=(2,)", "softcap=-1", "dropout_p=2"])
def test_compiled_varlen_refuses_what_eager_refuses(case):
    args = _packed()
    kw = BAD_FLASH[case]
    expected = _error(lambda: fa.flash_attention_varlen(*args, **kw))
    assert expected is not None
    torch._dynamo.reset()
    compiled = torch.compile(lambda q: fa.flash_attention_varlen(q, *args[1:], **kw), **COMPILE)
    with pytest.raises(expected[0]) as got:
        compiled(args[0])
    assert expected[1] in str(got.value)


# (the scale, its value, whether torch's own compiled SDPA takes it with fullgraph=True: a numpy float32 read
# while tracing is a data-dependent symbol that no fullgraph compile can branch on, torch's included)
SCALES = {
    "numpy float32": (np.float32(0.3), float(np.float32(0.3)), False),
    "numpy float64": (np.float64(0.3), 0.3, True),
    "0-d tensor": (torch.tensor(0.3, dtype=torch.float64), 0.3, True),
}


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", sorted(SCALES))
def test_every_scale_eager_accepts_compiles(name, dynamic):
    given, value, fullgraph = SCALES[name]
    q, k, v = _qkv()
    expected = fa.flash_attention(q, k, v, scale=value)
    torch._dynamo.reset()
    compile = dict(fullgraph=fullgraph, dynamic=dynamic, **COMPILE)
    flash = torch.compile(lambda q, k, v: fa.flash_attention(q, k, v, scale=given), **compile)
    torch.testing.assert_close(flash(q, k, v), expected, atol=1e-12, rtol=0)
    sdpa = torch.compile(lambda q, k, v: fa.scaled_dot_product_attention(q, k, v, scale=given), **compile)
    torch.testing.assert_close(sdpa(q, k, v), expected, atol=1e-12, rtol=0)
    args = _packed()
    varlen = torch.compile(lambda q: fa.flash_attention_varlen(q, *args[1:], scale=given), **compile)
    torch.testing.assert_close(varlen(args[0]), fa.flash_attention_varlen(*args, scale=value), atol=1e-12, rtol=0)


@pytest.mark.parametrize("fn", ["sdpa", "flash_attention"])
def test_a_mask_that_requires_grad_compiles_with_dynamic_shapes_and_fullgraph(fn):
    """Traced through (the op gives masks no gradient): validation must not format symbolic sizes."""
    q, k, v = _qkv()
    mask = torch.randn(1, 1, 8, 8, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, mask):
        if fn == "sdpa":
            return fa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return fa.flash_attention(q, k, v, attn_mask=mask)

    torch._dynamo.reset()
    compiled = torch.compile(f, dynamic=True, fullgraph=True, **COMPILE)
    (expected,) = torch.autograd.grad(f(q, k, v, mask).square().sum(), mask)
    (got,) = torch.autograd.grad(compiled(q, k, v, mask).square().sum(), mask)
    torch.testing.assert_close(got, expected)


def test_seqlens_k_compiles_with_dynamic_shapes_and_is_range_checked_when_it_runs():
    q, _, _ = _qkv()
    compiled = torch.compile(lambda q, L: fa.flash_attention(q, q, q, seqlens_k=L), dynamic=True, fullgraph=True)
    lengths = torch.tensor([5, 8])
    torch.testing.assert_close(compiled(q, lengths), fa.flash_attention(q, q, q, seqlens_k=lengths))
    with pytest.raises(RuntimeError, match=r"seqlens_k must lie in \[0, N_k\]"):
        compiled(q, torch.tensor([5, 9]))


def test_varlen_with_no_sequences_names_a_negative_max_seqlen():
    q = k = v = torch.randn(0, 2, 8)
    cu = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q must be at least 0"):
        fa.flash_attention_varlen(q, k, v, cu, cu, -1, 0)
    O = fa.flash_attention_varlen(q, k, v, cu, cu, 0, 0)  # no sequences, no rows: an empty output
    assert O.shape == (0, 2, 8)


@pytest.mark.parametrize(
    "kw",
    [
        dict(dropout_p=np.float64(0.0)),
        dict(dropout_p=torch.tensor(0.1, dtype=torch.float64)),
        dict(softcap=np.float64(2.0)),
        dict(softcap=torch.tensor(2.0, dtype=torch.float64)),
    ],
    ids=["dropout numpy", "dropout tensor", "softcap numpy", "softcap tensor"],
)
def test_dropout_and_softcap_given_as_numpy_or_tensor_compile_with_fullgraph(kw):
    q, k, v = _qkv()
    torch.manual_seed(0)
    expected = fa.flash_attention(q, k, v, **kw)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: fa.flash_attention(q, k, v, **kw), fullgraph=True, **COMPILE)
    torch.manual_seed(0)  # the same dropout seed: the graph draws it with eager's torch.randint
    torch.testing.assert_close(compiled(q, k, v), expected, atol=1e-12, rtol=0)


def test_a_deprecated_backend_spelling_compiles_with_fullgraph_and_warns_when_it_runs():
    q, k, v = _qkv()
    with pytest.warns(DeprecationWarning, match="backend='keymajor' is deprecated; use 'key_major'"):
        expected = fa.flash_attention(q, k, v, backend="keymajor")
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: fa.flash_attention(q, k, v, backend="keymajor"), fullgraph=True, **COMPILE)
    with pytest.warns(DeprecationWarning, match="backend='keymajor' is deprecated"):
        got = compiled(q, k, v)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
