"""Integer arithmetic in translated score_mod / mask_mod functions is torch's: int64 where torch's is (the
indices), the capture's width where torch's is, Python numbers wrapped to it; in the interpreter.

Each function is evaluated by a tiny kernel on one tile at positions ``q0 + rows``, ``kv0 + cols`` (near
2^31 too, where ``q_idx + 1`` leaves int32) and by torch on int64 grids; then through the public call
against the dense path and torch's own eager ``flex_attention``, and through the block-mask classifier.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.nn.attention import flex_attention as torch_flex  # noqa: E402

import flashattn_teach as fa  # noqa: E402
from flashattn_teach._options import make_options  # noqa: E402
from flashattn_teach.errors import BackendUnavailableError  # noqa: E402
from flashattn_teach.flex.block_mask_build import kinds_from_visibility  # noqa: E402
from flashattn_teach.flex.classify import tile_visibility  # noqa: E402
from flashattn_teach.triton.block_mask import triton_block_kinds  # noqa: E402
from flashattn_teach.triton.support import call_unsupported_reason  # noqa: E402
from flashattn_teach.triton.usermod import compile_mask_mod, compile_score_mod, unsupported_reason  # noqa: E402

BLOCK_M, BLOCK_N = 16, 16
KNUTH = 2654435761  # Knuth's multiplicative hash constant, >= 2^31

CAP32 = torch.tensor([3, 7, -5, 2**30], dtype=torch.int32)
CAP8 = torch.tensor([100, 50, -90, 7], dtype=torch.int8)
CAPU8 = torch.tensor([200, 3, 255, 0], dtype=torch.uint8)


@triton.jit
def _eval_mask(out_ptr, b, h, q0, kv0, C0, C1, C2, C3, MASK_MOD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.arange(0, BM)[:, None]
    cols = tl.arange(0, BN)[None, :]
    visible = MASK_MOD(b, h, q0 + rows, kv0 + cols, C0, C1, C2, C3)
    tile = tl.where(visible, 1, 0) + tl.zeros((BM, BN), dtype=tl.int32)
    tl.store(out_ptr + rows * BN + cols, tile.to(tl.int8))


@triton.jit
def _eval_score(out_ptr, b, h, q0, kv0, C0, C1, C2, C3, SCORE_MOD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.arange(0, BM)[:, None]
    cols = tl.arange(0, BN)[None, :]
    score = tl.zeros((BM, BN), dtype=tl.float32)
    tl.store(out_ptr + rows * BN + cols, SCORE_MOD(score, b, h, q0 + rows, kv0 + cols, C0, C1, C2, C3))


def _grids(b: int, h: int, q0: int, kv0: int) -> tuple[torch.Tensor, ...]:
    """torch's int64 indices, as the CPU paths pass them: scalars b, h, (M, 1) rows, (1, N) columns."""
    return (
        torch.tensor(b),
        torch.tensor(h),
        torch.arange(q0, q0 + BLOCK_M)[:, None],
        torch.arange(kv0, kv0 + BLOCK_N)[None, :],
    )


def _pointers(captures: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [*captures, *[torch.zeros(1)] * (4 - len(captures))]


def _translated_mask(fn, captures, b, h, q0, kv0) -> torch.Tensor:
    compiled = compile_mask_mod(fn, captures)
    out = torch.empty(BLOCK_M, BLOCK_N, dtype=torch.int8)
    _eval_mask[(1,)](out, b, h, q0, kv0, *_pointers(compiled.captures), MASK_MOD=compiled.jit, BM=BLOCK_M, BN=BLOCK_N)
    return out.bool()


def _translated_score(fn, captures, b, h, q0, kv0) -> torch.Tensor:
    compiled = compile_score_mod(fn, captures)
    out = torch.empty(BLOCK_M, BLOCK_N, dtype=torch.float32)
    _eval_score[(1,)](out, b, h, q0, kv0, *_pointers(compiled.captures), SCORE_MOD=compiled.jit, BM=BLOCK_M, BN=BLOCK_N)
    return out


MASKS = {
    # (q + 1) 2^16 (kv + 1) 2^16 passes 2^31 from q = kv = 0; torch's int64 holds it (2^44 at q = kv = 63)
    "product_past_2^31": lambda b, h, q, kv: ((q + 1) * 2**16 * (kv + 1) * 2**16) % 3 == 0,
    # past 2^63 too: torch's int64 wraps, and so must the translation (then % of a negative number)
    "product_past_2^63": lambda b, h, q, kv: ((q + 1) * 2**40 * (kv + 1) * 2**40) % 7 < 3,
    "knuth_hash": lambda b, h, q, kv: (q * KNUTH + h) % 64 < (kv * KNUTH) % 64,
    "index_plus_one": lambda b, h, q, kv: (q + 1) // 2 >= (kv + 1) // 2,
    "int64_constant_compared": lambda b, h, q, kv: q + 2**33 > kv * 2,
    # an int32 capture stays int32 in torch: the product and the constant 2^32 + 5 wrap there
    "int32_capture_wraps": lambda b, h, q, kv: (CAP32[h] * 2**20 > 0) & (CAP32[h] < 2**32 + 5),
    "int32_capture_with_index": lambda b, h, q, kv: (CAP32[h] * 2**20 + q) % 5 < (kv % 5),
    # int8 and uint8 results wrap at 8 bits in torch
    "int8_capture_wraps": lambda b, h, q, kv: CAP8[h] * 3 > kv - q,
    "uint8_capture_wraps": lambda b, h, q, kv: CAPU8[h] + 100 > kv % 128,
    # Python numbers past int32 on both sides of torch.where: int64 in torch, typed so in the source
    "where_of_wide_numbers": lambda b, h, q, kv: torch.where(q > kv, 2**31, -(2**31)) + kv * KNUTH > 0,
    "clamp_with_one_bound": lambda b, h, q, kv: torch.clamp(q - kv, min=-3) * 2**30 < 5 * 2**30,
}
CAPTURES = {"int32_capture_wraps": (CAP32,), "int32_capture_with_index": (CAP32,), "int8_capture_wraps": (CAP8,),
            "uint8_capture_wraps": (CAPU8,)}  # fmt: skip
# (b, h, q0, kv0): small positions, and positions where q_idx + 1 and q_idx * 2 leave int32
POSITIONS = [(0, 0, 0, 0), (1, 1, 37, 5), (0, 2, 2**31 - BLOCK_M, 2**31 - 3 * BLOCK_N), (0, 3, 2**30, 2**31 - BLOCK_N)]


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("name", list(MASKS))
def test_translated_integer_mask_mods_equal_torchs_int64_evaluation(name, position) -> None:
    fn, captures = MASKS[name], CAPTURES.get(name, ())
    want = fn(*_grids(*position)).expand(BLOCK_M, BLOCK_N)
    got = _translated_mask(fn, captures, *position)
    assert torch.equal(got, want), f"{name} at {position}: {(got != want).sum().item()} of the tile differ"


# constants around the int32 and int64 edges, Knuth's hash among them
_CONSTANTS = [1, 3, -7, 2**16, 2**31 - 1, 2**31, KNUTH, -(2**31), 2**32 + 5, 2**40, 2**62, 2**63, 2**64 - 1]


def _integer_trees(depth: int):
    names = st.sampled_from([("q",), ("kv",), ("h",), ("cap32",), ("cap8",), ("capu8",)])
    leaves = st.one_of(names, st.tuples(st.just("c"), st.sampled_from(_CONSTANTS)))
    if depth == 0:
        return leaves
    sub = _integer_trees(depth - 1)
    return st.one_of(
        leaves,
        st.tuples(st.sampled_from(["+", "-", "*", "max", "min", "&", "|", "^"]), sub, sub),
        st.tuples(st.sampled_from(["//", "%"]), sub, st.sampled_from([3, -5, 2**20, KNUTH, 2**33])),
        st.tuples(st.sampled_from(["neg", "abs", "~", "**2", "**3"]), sub),
        st.tuples(st.just("where"), sub, sub, sub),
    )


def _pairwise(function, bound: str, x, y):
    """``torch.maximum`` (``minimum``) of two tensors; with a Python number, ``clamp`` with it as the bound."""
    if isinstance(x, int) and isinstance(y, int):
        return max(x, y) if bound == "min" else min(x, y)
    if isinstance(x, int) or isinstance(y, int):
        tensor, number = (y, x) if isinstance(x, int) else (x, y)
        return torch.clamp(tensor, **{bound: number})
    return function(x, y)


def _integer_expression(tree, h, q, kv):
    op, *args = tree
    if op in ("q", "kv", "h", "cap32", "cap8", "capu8"):  # the captures' own dtypes, as torch keeps them
        return {"q": q, "kv": kv, "h": h, "cap32": CAP32[h], "cap8": CAP8[h], "capu8": CAPU8[h]}[op]
    if op == "c":
        return args[0]
    e = [_integer_expression(a, h, q, kv) if isinstance(a, tuple) else a for a in args]
    table = {
        "+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y, "//": lambda x, c: x // c,
        "%": lambda x, c: x % c, "&": lambda x, y: x & y, "|": lambda x, y: x | y, "^": lambda x, y: x ^ y,
        "max": lambda x, y: _pairwise(torch.maximum, "min", x, y),
        "min": lambda x, y: _pairwise(torch.minimum, "max", x, y),
        "neg": lambda x: -x, "abs": lambda x: abs(x), "~": lambda x: ~x, "**2": lambda x: x**2, "**3": lambda x: x**3,
        "where": lambda c, x, y: torch.where(c % 2 == 0, x, y),
    }  # fmt: skip
    return table[op](*e)


@settings(max_examples=60, deadline=None)
@given(tree=_integer_trees(3), position=st.sampled_from(POSITIONS))
def test_random_integer_expressions_equal_torchs(tree, position) -> None:
    def random_mask(b, h, q_idx, kv_idx):
        value = _integer_expression(tree, h, q_idx, kv_idx) + q_idx * 0  # a tensor even for a constant tree
        return value % 65521 < 32760  # a prime modulus: any difference in the value shows with odds 1/2

    captures = (CAP32, CAP8, CAPU8)
    try:
        want = random_mask(*_grids(*position)).expand(BLOCK_M, BLOCK_N)
    except (RuntimeError, OverflowError, TypeError):  # torch refuses it (a constant past its dtype)
        return
    reason = unsupported_reason(random_mask, captures, "mask_mod")
    if reason is not None:  # a number past the dtype in where / clamp: refused by name, run on the CPU
        assert "a number outside" in reason, reason
        return
    assert torch.equal(_translated_mask(random_mask, captures, *position), want)


def test_a_score_mod_adding_a_product_past_2_31_equals_torchs() -> None:
    def hashed_bias(score, b, h, q_idx, kv_idx):
        return score + (((q_idx + 1) * 2**16 * (kv_idx + 1) * 2**16 + KNUTH * h) % 1000).float()

    for position in POSITIONS:
        want = hashed_bias(torch.zeros(BLOCK_M, BLOCK_N), *_grids(*position))
        assert torch.equal(_translated_score(hashed_bias, (), *position), want)


def test_index_comparisons_stay_int32_and_products_become_int64() -> None:
    from flashattn_teach.triton.usermod import generated_source

    cheap = generated_source(lambda b, h, q, kv: (q >= kv) & (q - kv <= 128) & (q // 64 == kv // 64))
    assert "tl.int64" not in cheap  # no overflow is possible: the inner loop keeps its int32 compares
    assert "q_idx.to(tl.int64) + 1" in generated_source(MASKS["product_past_2^31"])


def test_a_number_outside_a_captures_dtype_in_clamp_is_refused_by_name() -> None:
    def clamped(b, h, q_idx, kv_idx):
        return torch.clamp(CAP32[h], max=2**40) > kv_idx

    with pytest.raises(RuntimeError, match="overflow"):  # torch's own evaluation raises for it
        clamped(*_grids(0, 0, 0, 0))
    reason = unsupported_reason(clamped, (CAP32,), "mask_mod")
    assert reason is not None and str(2**40) in reason and "outside int32" in reason and "CPU reference" in reason


def test_an_integer_torch_cannot_convert_is_refused_by_name() -> None:
    def too_big(b, h, q_idx, kv_idx):
        return q_idx * 2**64 == kv_idx

    with pytest.raises(OverflowError):  # torch's own evaluation raises for it
        too_big(*_grids(0, 0, 0, 0))
    reason = unsupported_reason(too_big, (), "mask_mod")
    assert reason is not None and str(2**64) in reason and "test_usermod_integers.py" in reason
    q = k = v = torch.randn(1, 1, 32, 16)
    call_reason = call_unsupported_reason(q, k, v, make_options(q, k, v, mask_mod=too_big))
    assert call_reason is not None and str(2**64) in call_reason
    with pytest.raises(BackendUnavailableError, match=str(2**64)):
        fa.flash_attention(q, k, v, mask_mod=too_big, backend="triton")


@pytest.mark.parametrize("name", ["product_past_2^31", "knuth_hash"])
def test_flash_attention_with_integer_masks_matches_the_dense_path_and_torchs_flex_attention(name) -> None:
    B, H, N, D = 1, 4, 64, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    fn = MASKS[name]

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + ((q_idx + 1) * 2**16 * (kv_idx + 1) * 2**16 % 5).float() / 4

    got = fa.flash_attention(q, k, v, mask_mod=fn, score_mod=score_mod, backend="triton")
    dense = fa.flash_attention(q.double(), k.double(), v.double(), mask_mod=fn, score_mod=score_mod, backend="dense")
    block_mask = torch_flex.create_block_mask(fn, B, H, N, N, device="cpu")
    torchs = torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    assert (got - dense).abs().max().item() < 1e-5
    assert (got - torchs).abs().max().item() < 1e-5


def test_the_block_mask_classifier_sees_the_int64_mask() -> None:
    fn = MASKS["product_past_2^31"]
    kinds = triton_block_kinds(fn, 1, 1, 100, 80, 16, 16, torch.device("cpu"))
    assert kinds is not None, "the function was not translated"
    expect = kinds_from_visibility(*tile_visibility(fn, 1, 1, 100, 80, 16, 16, torch.device("cpu")))
    assert torch.equal(kinds, expect)


AOT_SCRIPT = """
import torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from flashattn_teach.triton.usermod import compile_mask_mod, compile_score_mod

cap8 = torch.zeros(4, dtype=torch.int8)

def mask_fn(b, h, q, kv):
    product = ((q + 1) * 2**16 * (kv + 1) * 2**16) % 3 == 0
    return product & ((q * 2654435761 + h) % 64 < (kv * 2654435761) % 64) & (cap8[h] * 3 > kv - q)

def score_fn(s, b, h, q, kv):
    hashed = ((q + 1) * 2**16 * (kv + 1) * 2**16 + 2654435761 * h) % 1000
    return s + torch.where(q > kv, hashed, torch.where(q < kv, 2**31, -(2**40))).float()

mask_mod = compile_mask_mod(mask_fn, (cap8,))
score_mod = compile_score_mod(score_fn, ())

@triton.jit
def tile(O, C0, b, h, q0, kv0, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = q0 + tl.arange(0, BM)[:, None]
    cols = kv0 + tl.arange(0, BN)[None, :]
    s = SCORE_MOD(tl.zeros((BM, BN), dtype=tl.float32), b, h, rows, cols, C0, C0, C0, C0)
    s = tl.where(MASK_MOD(b, h, rows, cols, C0, C0, C0, C0), s, 0.0)
    tl.store(O + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :], s)

signature = {"O": "*fp32", "C0": "*i8", "b": "i32", "h": "i32", "q0": "i32", "kv0": "i32",
             "MASK_MOD": "constexpr", "SCORE_MOD": "constexpr", "BM": "constexpr", "BN": "constexpr"}
constexprs = {"MASK_MOD": mask_mod.jit, "SCORE_MOD": score_mod.jit, "BM": 64, "BN": 64}
source = triton.compiler.ASTSource(fn=tile, signature=signature, constexprs=constexprs)
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
ptx = compiled.asm["ptx"]
print("ok", len(compiled.asm["cubin"]) > 0, "mul.lo.s64" in ptx or "mul.wide" in ptx)
"""


def test_the_int64_arithmetic_compiles_for_sm90(tmp_path: Path) -> None:
    """Ahead of time, without a GPU and without the interpreter: the int64 constants and the widened
    indices are accepted by triton's compiler, not only by its interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH", "")])
    script = tmp_path / "aot_int64.py"
    script.write_text(AOT_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["ok", "True", "True"], done.stdout
