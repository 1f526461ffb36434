"""Paths no GPU has run stay off by default (:mod:`flashattn_teach.triton.provenance`), and ``explain`` says so.

- On a (faked) sm_90 GPU a bf16/fp16 call's default configuration has no warp-specialised forward, no
  one-kernel backward, no longest-first grid and no backward tile by TMA, although the table's row has all
  four (the control);
  each environment switch turns its path on alone; a value that is neither on nor off is refused by name.
- Run in the interpreter with the sm_90 fp16 row (faked as the default), the kernels that launch show it:
  the forward unspecialised, per-head grid order and two backward kernels by default; each switch, and a
  configuration passed for one call, launch the other path; every run matches the float64 oracle.
- ``explain`` names the forward, why it is not specialised (off by default, and how to try it), whether a
  GPU ran the forward and backward paths and when, the grid order of a causal call, and the options no GPU
  has run; on sm_80 (no warp-specialised row) it does not claim a switch.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

import pytest
import torch
from _triton_cases import DEVICE, ON_GPU, REL_TOL, assert_close_scaled

import flashattn_teach as fa
from flashattn_teach._validate.inputs import validate_inputs
from flashattn_teach.errors import AttentionValueError
from flashattn_teach.masks.grid import LONGEST, PER_HEAD
from flashattn_teach.reference import dense_attention
from flashattn_teach.triton import autograd, launch, provenance, support, triton_attention
from flashattn_teach.triton.configs import shipped_config
from flashattn_teach.triton.flags import grid_order
from flashattn_teach.triton.variants import PLAIN

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(ON_GPU, reason="fakes an sm_90 default for CPU tensors in the interpreter"),
]

SWITCHES = (
    "FLASHATTN_TEACH_WARP_SPECIALIZE",
    "FLASHATTN_TEACH_FUSED_BACKWARD",
    "FLASHATTN_TEACH_LONGEST_FIRST",
    "FLASHATTN_TEACH_BACKWARD_TMA",
)
PATHS = ("ws", "fused", "longest_first", "backward_tma")


@pytest.fixture(autouse=True)
def _switches_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)


def _inputs(N_q: int, N_k: int, D: int, dtype: torch.dtype = torch.float16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, N_q, D, generator=g)
    k, v = (torch.randn(1, 1, N_k, D, generator=g) for _ in range(2))
    return tuple(t.to(DEVICE, dtype) for t in (q, k, v))


def _shapes(q, k, v):
    return validate_inputs(q, k, v, causal_align="top_left", enable_gqa=True)


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """The default configuration of CPU tensors as on a GPU of ``arch``, wherever it is asked for."""

    def default_config(q, s, variants=PLAIN, *, tried=True):
        return launch.arch_config(arch, q.dtype, s, variants, tried=tried)

    for module in (launch, support, autograd):
        monkeypatch.setattr(module, "default_config", default_config)


# --- the default configuration ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_sm90_default_leaves_out_every_path_no_gpu_has_run(dtype) -> None:
    s = _shapes(*_inputs(64, 64, 128))
    row = launch.arch_config("sm90", dtype, s, tried=False)
    assert row.forward.ws and row.backward_fused is not None and row.longest_first  # the table asks for them
    assert row.backward_dq is not None and row.backward_dq.tma
    assert row == shipped_config(128, dtype, "sm90")
    default = launch.arch_config("sm90", dtype, s)
    assert not default.forward.ws and default.forward == row.forward.unspecialised()
    assert default.backward_fused is None and not default.longest_first
    assert default.backward_dq == row.backward_dq.by_pointers() and not default.backward_dq.tma
    assert default.backward_dkdv is not None and not default.backward_dkdv.tma
    assert grid_order(default) == PER_HEAD and grid_order(row) == LONGEST


@pytest.mark.parametrize(
    ("variable", "field"),
    [
        ("FLASHATTN_TEACH_WARP_SPECIALIZE", "ws"),
        ("FLASHATTN_TEACH_FUSED_BACKWARD", "fused"),
        ("FLASHATTN_TEACH_LONGEST_FIRST", "longest_first"),
        ("FLASHATTN_TEACH_BACKWARD_TMA", "backward_tma"),
    ],
)
def test_each_switch_turns_its_path_on_alone(monkeypatch, variable, field) -> None:
    s = _shapes(*_inputs(64, 64, 128))

    def paths() -> dict[str, bool]:
        c = launch.arch_config("sm90", torch.bfloat16, s)
        tma = c.backward_dq is not None and c.backward_dq.tma
        return {"ws": c.forward.ws, "fused": c.backward_fused is not None, "longest_first": c.longest_first} | {
            "backward_tma": tma
        }

    assert paths() == dict.fromkeys(PATHS, False)
    monkeypatch.setenv(variable, "0")
    assert not any(paths().values())
    monkeypatch.setenv(variable, "1")
    assert paths() == {name: name == field for name in PATHS}


def test_a_switch_that_is_neither_on_nor_off_is_refused_by_name(monkeypatch) -> None:
    monkeypatch.setenv("FLASHATTN_TEACH_WARP_SPECIALIZE", "maybe")
    with pytest.raises(AttentionValueError, match=r"FLASHATTN_TEACH_WARP_SPECIALIZE must be 1 .* got 'maybe'"):
        provenance.switched_on("warp_specialize")
    assert provenance.switched_on("warp_specialize", True)  # a per-call choice does not read it


def test_the_sm80_and_fp32_rows_have_nothing_to_switch_on(monkeypatch) -> None:
    s = _shapes(*_inputs(64, 64, 128))
    for name in SWITCHES:
        monkeypatch.setenv(name, "1")
    assert not launch.arch_config("sm80", torch.bfloat16, s).forward.ws
    assert not launch.arch_config("sm90", torch.float32, s).forward.ws


# --- what launches, in the interpreter ---------------------------------------------------------------


@contextlib.contextmanager
def _launches() -> Iterator[list[tuple[str, dict]]]:
    """(kernel name, its keyword arguments) of every kernel launched in the interpreter inside the block."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: list[tuple[str, dict]] = []
    real = InterpretedFunction.run

    def recording(self, *args, **kwargs):
        seen.append((self.fn.__name__, kwargs))
        return real(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(InterpretedFunction, "run", recording)
        yield seen


def _run(config=None):
    """Causal fp16 hd16 forward and backward on the sm_90 row's tiles: (kernel launches, O, grads, want)."""
    q, k, v = (t.requires_grad_() for t in _inputs(70, 90, 16))
    with _launches() as seen:
        O = triton_attention(q, k, v, causal=True, enable_gqa=True, config=config)
        grads = torch.autograd.grad(O.sum(), (q, k, v))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want_O = dense_attention(qd, kd, vd, causal=True, enable_gqa=True)
    want = torch.autograd.grad(want_O.sum(), (qd, kd, vd))
    assert_close_scaled(O, want_O, REL_TOL[torch.float16], "O")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert_close_scaled(got, ref, 2 * REL_TOL[torch.float16], name)
    # GRID_ORDER rides in the flags record F (triton/flags.py); the preprocess takes none
    return [(name, kw.get("WS"), kw.get("DQ_ATOMIC"), kw["F"].GRID_ORDER if "F" in kw else None) for name, kw in seen]


def test_the_default_launches_the_paths_a_gpu_ran_and_each_switch_its_own(monkeypatch) -> None:
    _fake_gpu(monkeypatch, "sm90")
    pre = ("attn_bwd_preprocess", None, None, None)
    two = [("attn_bwd_dkdv", None, False, PER_HEAD), ("attn_bwd_dq", None, None, PER_HEAD)]
    assert _run() == [("attn_fwd", False, None, PER_HEAD), pre, *two]
    monkeypatch.setenv("FLASHATTN_TEACH_WARP_SPECIALIZE", "1")
    assert _run() == [("attn_fwd", True, None, PER_HEAD), pre, *two]
    monkeypatch.setenv("FLASHATTN_TEACH_FUSED_BACKWARD", "1")
    monkeypatch.setenv("FLASHATTN_TEACH_LONGEST_FIRST", "1")
    assert _run() == [("attn_fwd", True, None, LONGEST), pre, ("attn_bwd_dkdv", None, True, LONGEST)]


def test_a_configuration_passed_for_one_call_runs_the_paths_it_names(monkeypatch) -> None:
    _fake_gpu(monkeypatch, "sm90")
    row = shipped_config(16, torch.float16, "sm90")  # the table's row: every path
    pre = ("attn_bwd_preprocess", None, None, None)
    assert _run(row) == [("attn_fwd", True, None, LONGEST), pre, ("attn_bwd_dkdv", None, True, LONGEST)]
    only_ws = provenance.as_tried(row, warp_specialize=True)
    two = [("attn_bwd_dkdv", None, False, PER_HEAD), ("attn_bwd_dq", None, None, PER_HEAD)]
    assert _run(only_ws) == [("attn_fwd", True, None, PER_HEAD), pre, *two]
    monkeypatch.setenv("FLASHATTN_TEACH_WARP_SPECIALIZE", "1")  # asked per call, the switch is not read
    assert _run(provenance.as_tried(row, warp_specialize=False))[0] == ("attn_fwd", False, None, PER_HEAD)


# --- explain ------------------------------------------------------------------------------------------


def test_explain_names_the_forward_why_and_what_a_gpu_ran(monkeypatch) -> None:
    _fake_gpu(monkeypatch, "sm90")
    q, k, v = _inputs(64, 64, 128)
    text = str(fa.explain(q, k, v, is_causal=True, enable_gqa=True, backend="triton"))
    assert (
        "forward 128x128 w8 s3 tma: warp-specialised forward: off by default until a GPU run passes the first "
        "light; set FLASHATTN_TEACH_WARP_SPECIALIZE=1 to try it"
    ) in text, text
    assert "forward by TMA: ran on an H200 on 2026-11-30 (triton 3.6," in text, text
    assert "causal grid each head's blocks longest first (per-head causal grid: ran on an H200" in text, text
    assert "FLASHATTN_TEACH_LONGEST_FIRST=1" in text, text
    assert "one-kernel backward: off by default until a GPU run passes the first light" in text, text
    assert "two-kernel backward through pointers: ran on an H200 on 2026-11-30" in text, text
    assert "backward tiles by TMA: off by default" in text, text
    assert "never run on a GPU" not in text, text  # a plain call: every path it takes has run

    monkeypatch.setenv("FLASHATTN_TEACH_WARP_SPECIALIZE", "1")
    monkeypatch.setenv("FLASHATTN_TEACH_FUSED_BACKWARD", "1")
    monkeypatch.setenv("FLASHATTN_TEACH_BACKWARD_TMA", "1")
    text = str(fa.explain(q, k, v, enable_gqa=True, backend="triton"))
    assert "forward 128x128 w4 s2 tma ws: warp-specialised" in text, text
    assert "warp-specialised forward: never run on a GPU" in text, text
    assert "one kernel per key block" in text and "one-kernel backward: never run on a GPU" in text, text
    assert "causal grid" not in text, text  # not causal: index order, nothing to say
    text = str(fa.explain(q, k, v, enable_gqa=True, backend="triton", deterministic=True))
    assert "two-kernel backward by TMA: never run on a GPU" in text, text


def test_explain_names_options_no_gpu_has_run(monkeypatch) -> None:
    _fake_gpu(monkeypatch, "sm90")
    q, k, v = _inputs(64, 64, 128)
    text = str(fa.explain(q, k, v, window=(8, 0), softcap=30.0, enable_gqa=True, backend="triton"))
    assert "never run on a GPU: window, softcap" in text, text


@pytest.mark.parametrize(("arch", "dtype"), [("sm80", torch.float16), ("sm90", torch.float32)])
def test_explain_claims_no_switch_where_the_row_has_no_specialised_forward(monkeypatch, arch, dtype) -> None:
    _fake_gpu(monkeypatch, arch)
    q, k, v = _inputs(64, 64, 64, dtype)
    text = str(fa.explain(q, k, v, enable_gqa=True, backend="triton"))
    assert "not warp-specialised: the configuration does not ask for it (ws=False)" in text, text
    assert "FLASHATTN_TEACH_WARP_SPECIALIZE" not in text, text
    assert "forward through pointers: ran on an H200 on 2026-11-30" in text, text


def test_explain_says_the_fp8_forward_has_not_run_on_a_gpu(monkeypatch) -> None:
    from flashattn_teach.triton import fp8

    monkeypatch.setattr(fp8, "INTERPRETER_ROUNDS_AS_GPU", True)  # plan it on the kernel, as on an sm_90 GPU
    g = torch.Generator().manual_seed(0)
    q8, k8, v8 = (torch.randn(1, 2, 16, 64, generator=g).to(torch.float8_e4m3fn) for _ in range(3))
    qd, kd, vd = (torch.ones(1, 2) for _ in range(3))
    p = fa.explain(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, backend="triton")
    assert p.backend == "triton" and "FP8 forward: never run on a GPU" in p.reason, p
