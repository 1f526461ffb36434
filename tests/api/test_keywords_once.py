"""The keywords the calls share are written once (``flashattn_teach._options``' ``TypedDict`` s), and every public
function of the library takes exactly those and its own: the signature ``help()`` shows, the defaults the
written-out signatures had, the unknown-keyword error, mypy's view, and the numbers, against float64 torch SDPA.

The defaults below are copied from the written-out signatures before the keywords were defined once (git
history), not from the definition: a default that moved would fail here.
"""

from __future__ import annotations

import inspect
import pydoc
import subprocess
import sys
import textwrap
from typing import get_args

import pytest
import torch
import torch.nn.functional as F
from typing_extensions import get_type_hints, is_typeddict

import flashattn_teach as fa
from flashattn_teach import _options
from flashattn_teach._validate.keywords import keyword_table
from flashattn_teach.reference import dense_attention, key_major_attention, online_attention

KW = inspect.Parameter.KEYWORD_ONLY

# every shared keyword's default in the signatures as they were written out (flash_attention's, the references')
PADDED = {
    "causal": False,
    "causal_align": "top_left",
    "scale": None,
    "enable_gqa": False,
    "window": None,
    "softcap": None,
    "alibi_slopes": None,
    "seqlens_k": None,
    "attn_mask": None,
    "dropout_p": 0.0,
    "deterministic": False,
    "score_mod": None,
    "mask_mod": None,
    "block_mask": None,
    "sinks": None,
}
PACKED = {name: PADDED[name] for name in _options.PackedKeywords.__annotations__}
DECODE_OWN = {"cache_seqlens": inspect.Parameter.empty, "block_table": None, "cache_leftpad": None}
DECODE = {**{name: PADDED[name] for name in _options.StepKeywords.__annotations__}, **DECODE_OWN}
DECODE |= {"num_splits": 0, "backend": "auto"}
DESCALES = {"q_descale": None, "k_descale": None, "v_descale": None}
REFERENCE = {name: d for name, d in PADDED.items() if name != "deterministic"}  # the references had no deterministic

# each public function: (its keyword-only parameters and defaults as they were, the shared definition it reads)
PUBLIC = {
    "flash_attention": (
        fa.flash_attention,
        {**PADDED, "enable_gqa": True, "backend": "auto", "return_lse": False, **DESCALES},
        _options.AttentionKeywords,
    ),
    "dense_attention": (dense_attention, {**REFERENCE, "return_lse": False}, _options.AttentionKeywords),
    "online_attention": (
        online_attention,
        {**REFERENCE, "block_m": 128, "block_n": 512, "return_lse": False},
        _options.AttentionKeywords,
    ),
    "key_major_attention": (
        key_major_attention,
        {**REFERENCE, "block_m": 128, "block_n": 512, "return_lse": False},
        _options.AttentionKeywords,
    ),
    "flash_attention_varlen": (
        fa.flash_attention_varlen,
        {**PACKED, "causal_align": "bottom_right", "block_table": None, "backend": "auto", "return_lse": False},
        _options.PackedKeywords,
    ),
    "explain": (
        fa.explain,
        {**PADDED, "is_causal": False, "backend": "auto", "verbose": False, "block_table": None, **DESCALES}
        | {"cu_seqlens_q": None, "cu_seqlens_k": None, "max_seqlen_q": None, "max_seqlen_k": None},
        _options.AttentionKeywords,
    ),
    "flash_attention_with_kvcache": (fa.flash_attention_with_kvcache, {**DECODE, "return_lse": False}, None),
    "explain_with_kvcache": (fa.explain_with_kvcache, DECODE, None),
}
# the keywords the references did not take before: deterministic (accepted now, as flash_attention takes it)
ADDED = {"dense_attention": {"deterministic"}, "online_attention": {"deterministic"}}
ADDED["key_major_attention"] = {"deterministic"}


def _keywords(function) -> dict[str, object]:
    return {n: p.default for n, p in inspect.signature(function).parameters.items() if p.kind is KW}


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_function_takes_the_shared_definitions_keywords(name):
    function, _, shared = PUBLIC[name]
    taken = _keywords(function)
    if shared is None:  # the decode calls: the step's shared keywords and the decode call's own, written once
        shared = _options.StepKeywords
        assert set(keyword_table(_options.DecodeKeywords)) <= set(taken), name
    # every shared keyword the function takes is the definition's, none more, none fewer
    assert set(taken) & set(keyword_table(_options.AttentionKeywords)) == set(keyword_table(shared)), name
    # and its signature is its **options TypedDict's, with return_lse the one keyword written out beside it
    hint = get_type_hints(inspect.unwrap(function), include_extras=True)["options"]
    whole = hint if is_typeddict(hint) else get_args(hint)[0]  # options: SomeKeywords, or **options: Unpack[...]
    assert set(taken) - {"return_lse"} == set(keyword_table(whole)), name


@pytest.mark.parametrize("name", PUBLIC)
def test_every_keyword_keeps_its_default_and_kind(name):
    function, before, _ = PUBLIC[name]
    taken = _keywords(function)
    if name == "explain":  # explain's SDPA head was positional-or-keyword; now every keyword is keyword-only
        assert list(inspect.signature(function).parameters)[:3] == ["query", "key", "value"]
    assert set(taken) - set(before) == ADDED.get(name, set()), name
    assert {n: taken[n] for n in before} == before, name


@pytest.mark.parametrize("name", PUBLIC)
def test_every_keyword_shows_its_type(name):
    function = PUBLIC[name][0]
    for parameter in inspect.signature(function).parameters.values():
        assert parameter.annotation is not inspect.Parameter.empty, (name, parameter.name)
    assert "ScoreMod | None" in str(inspect.signature(fa.flash_attention).parameters["score_mod"])
    shown = pydoc.render_doc(fa.flash_attention, renderer=pydoc.plaintext)  # what help() prints
    assert "window: 'tuple[int, int] | None' = None" in shown and "enable_gqa: 'bool' = True" in shown


@pytest.mark.parametrize("name", PUBLIC)
def test_a_misspelt_keyword_raises_naming_it_and_the_nearest_spelling(name):
    function = PUBLIC[name][0]
    # the wrapper refuses before reading any argument, so None stands for the tensors
    with pytest.raises(
        TypeError, match=rf"{name}\(\) got an unexpected keyword argument 'casual' \(did you mean causal="
    ):
        function(None, None, None, casual=True)
    with pytest.raises(TypeError, match=rf"{name}\(\) got an unexpected keyword argument 'xyzzy'$"):
        function(None, None, None, xyzzy=1)


def test_the_decode_calls_cache_seqlens_stays_required():
    q = torch.randn(1, 2, 1, 4)
    with pytest.raises(TypeError, match="missing required keyword-only argument: 'cache_seqlens'"):
        fa.flash_attention_with_kvcache(q, q, q)


def test_make_options_takes_every_shared_keyword_by_name_and_refuses_others():
    q = torch.randn(1, 2, 3, 4)
    opts = _options.make_options(q, q, q, **{n: d for n, d in PADDED.items() if n != "enable_gqa"}, enable_gqa=True)
    assert opts.enable_gqa and not opts.causal
    whole = _options.make_options(q, q, q, {"causal": True, "backend": "dense"})  # a call's keywords, passed whole
    assert whole.causal
    with pytest.raises(TypeError, match="make_options\\(\\) got an unexpected keyword argument 'casual'"):
        _options.make_options(q, q, q, casual=True)


def test_explain_takes_either_spelling_of_causal_but_not_both():
    q = torch.randn(1, 2, 8, 4)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    assert fa.explain(q, q, q, is_causal=True) == fa.explain(q, q, q, causal=True)
    assert fa.explain(q, q, q, is_causal=True) != fa.explain(q, q, q, attn_mask=mask)  # the control: it reads it
    with pytest.raises(TypeError, match="not both"):
        fa.explain(q, q, q, is_causal=True, causal=True)
    with pytest.raises(TypeError, match="is_causal must be a bool"):  # the error names the spelling given
        fa.explain(q, q, q, is_causal="yes")


def test_explain_refuses_a_padded_batchs_keyword_with_packed_sequences():
    q, cu = torch.randn(6, 2, 4), torch.tensor([0, 2, 6])
    packed = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 4, "max_seqlen_k": 4}
    assert fa.explain(q, q, q, **packed).backend
    with pytest.raises(ValueError, match="seqlens_k not taken with packed sequences"):
        fa.explain(q, q, q, seqlens_k=torch.tensor([2]), **packed)


# ------------------------------------------------------------------------------------ numbers against SDPA


def _sdpa64(q, k, v, *, visible=None, scale=None):
    """torch's SDPA in float64 with an explicit bool mask (grouped heads repeated by hand)."""
    G = q.shape[-3] // k.shape[-3]
    k, v = (t.repeat_interleave(G, dim=-3) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)


def _visible(N_q, N_k, *, bottom_right=False, window=None):
    i = torch.arange(N_q)[:, None] + (N_k - N_q if bottom_right else 0)
    j = torch.arange(N_k)
    left, right = window if window is not None else (-1, 0)
    seen = j <= i + right
    return seen & (j >= i - left) if left >= 0 else seen


CASES = {  # options -> the SDPA call that means the same
    "causal": ({"causal": True}, {"visible": _visible(5, 7)}),
    "bottom_right": ({"causal": True, "causal_align": "bottom_right"}, {"visible": _visible(5, 7, bottom_right=True)}),
    "window": ({"window": (2, 1)}, {"visible": _visible(5, 7, window=(2, 1))}),
    "scale": ({"scale": 0.3}, {"scale": 0.3}),
    "attn_mask": ({"attn_mask": _visible(5, 7).flip(-1)}, {"visible": _visible(5, 7).flip(-1)}),
}
FUNCTIONS = {
    "flash_attention": fa.flash_attention,
    "dense_attention": dense_attention,
    "online_attention": lambda *a, **kw: online_attention(*a, block_m=2, block_n=3, **kw),
    "key_major_attention": lambda *a, **kw: key_major_attention(*a, block_m=2, block_n=3, **kw),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", FUNCTIONS)
def test_the_numbers_are_torchs_sdpa_in_float64(name, case):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(2))
    options, sdpa = CASES[case]
    out = FUNCTIONS[name](q, k, v, enable_gqa=True, **options)
    torch.testing.assert_close(out, _sdpa64(q, k, v, **sdpa), rtol=0, atol=1e-12)


def test_the_varlen_and_decode_calls_are_torchs_sdpa_in_float64():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 3, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    want = _sdpa64(q, k, v, visible=_visible(3, 9, bottom_right=True))
    packed = fa.flash_attention_varlen(
        q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), *(torch.tensor([0, n]) for n in (3, 9)), 3, 9,
        causal=True,
    )  # fmt: skip
    torch.testing.assert_close(packed.transpose(0, 1)[None], want, rtol=0, atol=1e-12)
    step = fa.flash_attention_with_kvcache(q, k, v, cache_seqlens=9, causal=True, num_splits=2)
    torch.testing.assert_close(step, want, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------- mypy's view

TYPED = """
import torch
import flashattn_teach as fa
from flashattn_teach.reference import online_attention

q = torch.randn(1, 2, 3, 4)
reveal_type(fa.flash_attention(q, q, q, causal=True))
reveal_type(fa.flash_attention(q, q, q, window=(1, 0), return_lse=True))
reveal_type(online_attention(q, q, q, block_m=2, return_lse=True))
reveal_type(fa.flash_attention_with_kvcache(q, q, q, cache_seqlens=1, return_lse=True))
fa.flash_attention(q, q, q, casual=True)
fa.flash_attention(q, q, q, window=3)
fa.explain(q, q, q, verbose="yes")
fa.flash_attention_with_kvcache(q, q, q, num_splits=None)
"""


def test_mypy_sees_every_keyword_and_its_type(tmp_path):
    pytest.importorskip("mypy")
    (tmp_path / "typed.py").write_text(textwrap.dedent(TYPED))
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent", str(tmp_path / "typed.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = run.stdout.splitlines()
    revealed = [line.split("Revealed type is ")[1] for line in lines if "Revealed type is" in line]
    assert revealed == ['"torch._tensor.Tensor"'] + ['"tuple[torch._tensor.Tensor, torch._tensor.Tensor]"'] * 3, lines
    errors: dict[int, str] = {}
    for line in lines:
        if ": error:" in line:
            errors[int(line.split(":")[1])] = errors.get(int(line.split(":")[1]), "") + line
    assert set(errors) == {11, 12, 13, 14}, lines  # each wrong call, and none of the right ones
    assert 'Unexpected keyword argument "casual"' in errors[11] and 'did you mean "causal"' in errors[11]
    assert '"Tensor", "Tensor", "Tensor", "int"' in errors[12]  # window=3: no overload takes an int window
    assert 'Argument "verbose" to "explain" has incompatible type "str"' in errors[13]
    assert '"Tensor", "Tensor", "Tensor", "None"' in errors[14]  # num_splits=None
