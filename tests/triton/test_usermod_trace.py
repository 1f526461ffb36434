"""Tracing user score_mod / mask_mod functions: what is refused and how the error says so, the graph, the
cache and the generated source. No kernel runs here (tests/triton/test_usermod_emit.py runs them)."""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashattn_teach.errors import AttentionValueError
from flashattn_teach.triton.usermod import (
    MAX_CAPTURES,
    UnsupportedUserFunction,
    compile_mask_mod,
    compile_score_mod,
    generated_source,
    unsupported_reason,
)
from flashattn_teach.triton.usermod.trace import trace


def line_of(fn, text: str) -> str:
    """``file:line`` of the first line of ``fn``'s source containing ``text``."""
    lines, first = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"test_usermod_trace.py:{first + offset}"


def refusal(fn, captures=(), kind="score_mod") -> str:
    with pytest.raises(UnsupportedUserFunction) as info:
        trace(fn, captures, kind)
    assert unsupported_reason(fn, captures, kind) == str(info.value)
    return str(info.value)


# --- refusals name the operation and the user's line ----------------------------------------------------
def test_an_unsupported_torch_function_is_named_with_its_line() -> None:
    def with_softmax(score, b, h, q_idx, kv_idx):
        scaled = score * 2
        return torch.softmax(scaled, dim=-1)

    message = refusal(with_softmax)
    assert message.startswith(f"score_mod uses torch.softmax ({line_of(with_softmax, 'torch.softmax')})"), message
    assert "the Triton translator does not support" in message and "CPU reference" in message


def test_an_unsupported_tensor_method_is_named_with_its_line() -> None:
    def with_cumsum(score, b, h, q_idx, kv_idx):
        return score.cumsum(-1)

    assert f"uses Tensor.cumsum ({line_of(with_cumsum, '.cumsum')})" in refusal(with_cumsum)


def test_python_if_on_a_tensor_is_refused_with_its_line() -> None:
    def branches(score, b, h, q_idx, kv_idx):
        if q_idx >= kv_idx:
            return score
        return -score

    message = refusal(branches)
    assert (
        f"uses a tensor in Python control flow (`if`, `and`, `or`, `not` or bool()) ({line_of(branches, 'if ')})"
        in message
    )
    assert "torch.where" in message


def test_python_and_between_masks_is_refused() -> None:
    def python_and(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) and (q_idx - kv_idx < 4)

    assert line_of(python_and, " and ") in refusal(python_and, kind="mask_mod")


def test_a_fifth_captured_tensor_is_refused_at_the_line_reading_it() -> None:
    tables = [torch.arange(8.0) * k for k in range(5)]

    def five_tables(score, b, h, q_idx, kv_idx):
        out = score + tables[0][h] + tables[1][h] + tables[2][h] + tables[3][h]
        return out + tables[4][h]

    message = refusal(five_tables, tables)
    assert f"reads a 5th captured tensor ({line_of(five_tables, 'tables[4]')})" in message
    assert f"MAX_CAPTURES = {MAX_CAPTURES}" in message
    # four are fine, and a captures list longer than what is read is fine too
    assert unsupported_reason(lambda s, b, h, q, kv: s + tables[0][h] + tables[3][h], tables, "score_mod") is None


def test_a_tensor_not_among_the_captures_is_refused() -> None:
    bias = torch.zeros(4)
    message = refusal(lambda s, b, h, q, kv: s + bias[h], ())
    assert "reads a tensor of shape (4,) that is not among its captured tensors" in message


def test_a_value_torch_computes_from_captures_at_trace_time_is_refused() -> None:
    # bias[offset] of two real tensors runs eagerly while tracing: its value would be baked in
    bias, offset = torch.zeros(4), torch.tensor(1)
    message = refusal(lambda s, b, h, q, kv: s + bias[offset], (bias, offset))
    assert "reads a tensor of shape () that is not among its captured tensors" in message


def test_slices_whole_tensors_and_partial_lookups_are_refused() -> None:
    table = torch.zeros(4, 8)
    assert "indexes a captured tensor with slice" in refusal(lambda s, b, h, q, kv: s + table[:, h], (table,))
    assert "uses a whole captured tensor of shape (4, 8)" in refusal(lambda s, b, h, q, kv: s + table, (table,))
    assert "part of a captured tensor" in refusal(lambda s, b, h, q, kv: s + table[h], (table,))
    assert "indexes a traced value" in refusal(lambda s, b, h, q, kv: s[0])
    assert "floating-point tensor" in refusal(lambda s, b, h, q, kv: s + table[h, s], (table,))


def test_reductions_and_shapes_are_refused() -> None:
    assert "uses torch.max as a reduction" in refusal(lambda s, b, h, q, kv: s - torch.max(s, 1).values)
    assert "uses Tensor.max as a reduction" in refusal(lambda s, b, h, q, kv: s - s.max())
    assert "reads Tensor.shape" in refusal(lambda s, b, h, q, kv: s * s.shape[-1])


def test_a_mask_mod_must_return_bool_and_a_score_mod_floats() -> None:
    assert "mask_mod returns a integer tensor" in refusal(lambda b, h, q, kv: q - kv, kind="mask_mod")
    assert "score_mod returns a integer tensor" in refusal(lambda s, b, h, q, kv: q - kv)
    assert "score_mod returns a float " in refusal(lambda s, b, h, q, kv: 0.0)
    assert unsupported_reason(lambda b, h, q, kv: True, (), "mask_mod") is None  # a Python bool broadcasts


def test_an_exception_in_the_user_function_is_reported_with_its_line() -> None:
    def fails(score, b, h, q_idx, kv_idx):
        return score + {}["missing"]

    message = refusal(fails)
    assert message.startswith(f"score_mod raised KeyError: 'missing' ({line_of(fails, 'missing')})"), message


def test_unsupported_reason_never_raises_and_is_none_when_supported() -> None:
    assert unsupported_reason(lambda s, b, h, q, kv: torch.where(q >= kv, s, -float("inf")), (), "score_mod") is None
    assert unsupported_reason(lambda b, h, q, kv: q >= kv, (), "mask_mod") is None
    assert "kind must be" in unsupported_reason(lambda b, h, q, kv: q >= kv, (), "bias")
    assert "TypeError" in unsupported_reason(lambda s: s, (), "score_mod")  # the wrong arity, as a reason


def test_unsupported_user_function_is_a_value_error_of_this_library() -> None:
    assert issubclass(UnsupportedUserFunction, AttentionValueError)
    assert issubclass(UnsupportedUserFunction, ValueError)


# --- the graph -------------------------------------------------------------------------------------------
def test_combinators_trace_through_and_repeated_lookups_are_one_node() -> None:
    doc = torch.zeros(2, 16, dtype=torch.int64)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def document(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    def and_masks(*mods):
        return lambda b, h, q, kv: functools.reduce(lambda x, y: x & y, (m(b, h, q, kv) for m in mods))

    graph = trace(and_masks(causal, document, document), (doc,), "mask_mod")
    ops = [n.op for n in graph.cone(graph.output)]
    assert ops.count("gather") == 2 and ops.count("eq") == 1 and ops.count("ge") == 1
    assert graph.output.op == "and" and graph.slots == [0]


def test_compiled_captures_are_the_tensors_read_in_slot_order() -> None:
    a, b_, c = torch.zeros(4), torch.ones(4), torch.full((4,), 2.0)

    def reads_c_then_a(score, b, h, q_idx, kv_idx):
        return score + c[h] * a[h]

    compiled = compile_score_mod(reads_c_then_a, (a, b_, c))
    assert len(compiled.captures) == 2 and compiled.captures[0] is c and compiled.captures[1] is a
    assert "C0 = captures[2]" in compiled.source and "C1 = captures[0]" in compiled.source


def test_python_dtypes_promote_as_in_torch() -> None:
    graph = trace(lambda s, b, h, q, kv: (q - kv) / 2 + (q > kv) * 3, (), "score_mod")
    kinds = {n.op: n.kind for n in graph.nodes}
    assert kinds["truediv"] == "f" and kinds["gt"] == "b" and kinds["mul"] == "i" and graph.output.kind == "f"


def test_the_tracer_imports_no_triton() -> None:
    # the planner asks unsupported_reason on machines without triton; only compile_* loads it
    script = (
        "import sys, torch\n"
        "from flashattn_teach.triton.usermod import generated_source, unsupported_reason\n"
        "assert unsupported_reason(lambda s, b, h, q, kv: s * 2, (), 'score_mod') is None\n"
        "assert 'def mask_mod' in generated_source(lambda b, h, q, kv: q >= kv)\n"
        "print('triton' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


# --- the cache and the generated source --------------------------------------------------------------------
def test_compiling_twice_reuses_the_translation_and_layouts_are_in_the_key() -> None:
    def bias_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    bias = torch.zeros(4)
    first, again = compile_score_mod(bias_mod, (bias,)), compile_score_mod(bias_mod, (bias,))
    assert first.jit is again.jit and first.source == again.source
    bias = torch.zeros(6)
    wider = compile_score_mod(bias_mod, (bias,))
    assert "(h < 6)" in wider.source and "(h < 4)" in first.source and wider.captures[0] is bias


def test_numbers_a_function_closes_over_are_in_the_key() -> None:
    def make(cap):
        return lambda s, b, h, q, kv: cap * torch.tanh(s / cap)

    assert "= 20.0 * " in generated_source(make(20.0)) and "= 50.0 * " in generated_source(make(50.0))
    scaled = functools.partial(lambda s, b, h, q, kv, k=1.0: s * k, k=3.5)
    assert "3.5" in generated_source(scaled)


def test_the_generated_source_is_what_triton_jit_reads() -> None:
    pytest.importorskip("triton")
    compiled = compile_mask_mod(lambda b, h, q, kv: (q - kv) % 2 == 0, ())
    function = getattr(compiled.jit, "fn", compiled.jit)
    assert inspect.getsource(function) in compiled.source
    assert "def mask_mod(b, h, q_idx, kv_idx, C0, C1, C2, C3):" in compiled.source
    assert "_mod(" in compiled.source  # Python's % on a possibly negative q - kv


def test_generated_source_tells_the_kind_by_arity() -> None:
    assert "def score_grad(" in generated_source(lambda s, b, h, q, kv: s * 2)
    assert "def mask_mod(" in generated_source(lambda b, h, q, kv: q >= kv)
    with pytest.raises(AttentionValueError, match="takes 3 parameters without defaults"):
        generated_source(lambda b, q, kv: q >= kv)
