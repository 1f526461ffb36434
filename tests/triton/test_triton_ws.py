"""The warp-specialised forward (``KernelConfig.ws``): what it computes, when it runs, and what it compiles to.

- In the interpreter the specialised source (one masked key loop, descriptors made in the kernel) equals
  the float64 oracle: causal and not, GQA, a ragged N_k, variants; a recording of the launcher's choice
  shows the specialised build ran.
- Where it cannot run (fp32, packed sequences, an attn_mask, dropout, strides TMA cannot describe) the
  launcher runs the configuration's fallback, and says why; ``explain`` names the forward that runs.
- Triton's scratch allocator, which in-kernel descriptors need, is installed only where none is set.
- Compiled ahead of time for sm_90 (in a subprocess without TRITON_INTERPRET), the shipped bf16 hd64 and
  hd128 forward, causal and not, is specialised as read from its SASS: setmaxnreg, named barriers, no
  CTA-wide barrier in the consumer's loop, more than 4 warps, no spills, shared memory within the limit;
  the same check on the fallback (not specialised) says so.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch
from _triton_cases import DEVICE, ON_GPU, REL_TOL, assert_close_scaled

import flashattn_teach as fa
from flashattn_teach.errors import AttentionValueError
from flashattn_teach.reference import dense_attention
from flashattn_teach.triton import AttentionConfig, KernelConfig, launch, support, tma, triton_attention
from flashattn_teach.triton.configs import shipped_config
from flashattn_teach.triton.variants import PLAIN, KernelVariants

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

WS_TILE = KernelConfig(32, 16, 4, 1, tma=True, ws=True, fallback=KernelConfig(16, 16, 4, 1))
WS_CONFIG = AttentionConfig(forward=WS_TILE, backward_dkdv=None, backward_dq=None)
# bf16 dots come out wrong in the interpreter: fp16 there, both on a GPU
WS_DTYPES = [torch.float16, *([torch.bfloat16] if ON_GPU else [])]


@contextlib.contextmanager
def _forward_tiles() -> Iterator[list[tuple[KernelConfig, bool]]]:
    """Records what ``launch.forward_tile`` returns: (configuration, warp-specialised)."""
    seen: list[tuple[KernelConfig, bool]] = []
    real = launch.forward_tile

    def recording(*args):
        seen.append(real(*args))
        return seen[-1]

    launch.forward_tile = recording
    try:
        yield seen
    finally:
        launch.forward_tile = real


def _inputs(B, H_kv, group, N_q, N_k, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_kv * group, N_q, D, generator=g)
    k, v = (torch.randn(B, H_kv, N_k, D, generator=g) for _ in range(2))
    return tuple(t.to(DEVICE, dtype) for t in (q, k, v))


@pytest.mark.parametrize("dtype", WS_DTYPES)
@pytest.mark.parametrize(
    ("group", "N_q", "N_k", "causal", "align"),
    [
        (1, 64, 64, False, "top_left"),  # N_k a multiple of BLOCK_N: the loop runs unmasked (EVEN_N)
        (1, 64, 64, True, "top_left"),  # the same lengths, causal: masked
        (2, 45, 113, False, "top_left"),  # GQA, a ragged last key block
        (2, 70, 113, True, "bottom_right"),
        (1, 113, 50, True, "bottom_right"),  # the first 63 rows see no key: O = 0, lse = -inf
    ],
)
def test_specialised_forward_matches_dense(group, N_q, N_k, causal, align, dtype) -> None:
    q, k, v = _inputs(1, 2, group, N_q, N_k, 64, dtype)
    with _forward_tiles() as seen:
        O, lse = triton_attention(
            q, k, v, causal=causal, causal_align=align, enable_gqa=True, return_lse=True, config=WS_CONFIG
        )
    assert seen == [(WS_TILE, True)]
    ref_O, ref_lse = dense_attention(
        *(t.double().cpu() for t in (q, k, v)), causal=causal, causal_align=align, enable_gqa=True, return_lse=True
    )
    assert_close_scaled(O, ref_O, REL_TOL[dtype], "O")
    assert_close_scaled(lse, ref_lse, REL_TOL[torch.float32], "lse")


VARIANTS = {
    "window_softcap": {"window": (20, 3), "softcap": 2.0, "causal_align": "bottom_right"},
    # batch element 0 has no keys: its rows give O = 0, lse = -inf
    "alibi_seqlens_causal": {"alibi_slopes": [0.25, 0.0625], "seqlens_k": [0, 37], "causal": True},
    # N_k = 80 is a multiple of BLOCK_N, but seqlens_k cuts it: the loop must stay masked
    "seqlens_even_n": {"seqlens_k": [20, 80]},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_specialised_forward_with_variants_matches_dense(name: str) -> None:
    q, k, v = _inputs(2, 2, 1, 53, 80 if name == "seqlens_even_n" else 81, 32, torch.float16, seed=1)
    options = {
        key: torch.tensor(x, dtype=torch.int32 if key == "seqlens_k" else torch.float32) if isinstance(x, list) else x
        for key, x in VARIANTS[name].items()
    }
    with _forward_tiles() as seen:
        O, lse = triton_attention(
            q, k, v, return_lse=True, config=WS_CONFIG, **{key: _to(x, DEVICE) for key, x in options.items()}
        )
    assert seen == [(WS_TILE, True)]
    ref_O, ref_lse = dense_attention(*(t.double().cpu() for t in (q, k, v)), return_lse=True, **options)
    assert_close_scaled(O, ref_O, REL_TOL[torch.float16], f"{name} O")
    assert_close_scaled(lse, ref_lse, REL_TOL[torch.float32], f"{name} lse")


def _to(x, device: str):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _reason(q, k, v, variants: KernelVariants = PLAIN, c: KernelConfig = WS_TILE) -> str | None:
    return tma.ws_reason(c, q, k, v, variants)


def test_where_the_specialised_forward_cannot_run_its_fallback_does_and_the_reason_names_why() -> None:
    q, k, v = _inputs(1, 2, 1, 40, 40, 64, torch.float16)
    assert _reason(q, k, v) is None
    assert _reason(q, k, v, c=WS_TILE.unspecialised()) == "the configuration does not ask for it (ws=False)"
    assert "float32" in _reason(*(t.float() for t in (q, k, v)))
    mask = KernelVariants(attn_mask=torch.ones(1, 2, 40, 40, dtype=torch.uint8))
    assert _reason(q, k, v, mask) == "an attn_mask (the pass does not take that loop)"
    # D = 17 in fp16: rows 34 bytes apart, which no tensor descriptor describes
    q17, k17, v17 = (t[..., :17].contiguous() for t in (q, k, v))
    assert "the query tensor cannot be read by TMA" in _reason(q17, k17, v17)
    with _forward_tiles() as seen:
        O = triton_attention(q17, k17, v17, causal=True, config=WS_CONFIG)
    assert seen == [(WS_TILE.fallback, False)]
    ref = dense_attention(*(t.double().cpu() for t in (q17, k17, v17)), causal=True)
    assert_close_scaled(O, ref, REL_TOL[torch.float16], "O")


def test_a_ws_configuration_needs_tma_and_four_warps() -> None:
    with pytest.raises(AttentionValueError, match="num_warps=4"):
        KernelConfig(128, 128, 8, 2, tma=True, ws=True)
    with pytest.raises(AttentionValueError, match="needs tma=True"):
        KernelConfig(128, 128, 4, 2, ws=True)
    tile = KernelConfig(128, 128, 4, 2, tma=True, ws=True)
    assert str(tile) == "128x128 w4 s2 tma ws"
    assert tile.unspecialised() == KernelConfig(128, 128, 4, 2, tma=True)
    row = shipped_config(128, torch.bfloat16, "sm90").forward
    assert row.ws and row.num_warps == 4 and not row.unspecialised().ws
    assert row.by_pointers() == row.unspecialised().by_pointers() and not row.by_pointers().tma
    assert not shipped_config(128, torch.bfloat16, "sm80").forward.ws
    assert not shipped_config(128, torch.float32, "sm90").forward.ws
    assert not shipped_config(128, torch.bfloat16, "sm90", dropout=True).forward.ws


def test_the_scratch_allocator_is_installed_only_where_none_is_set() -> None:
    import triton
    from triton.runtime import _allocation

    def check() -> None:
        assert _allocation._allocator.get() is _allocation._NULL_ALLOCATOR  # a fresh context has none
        tma.ensure_scratch_allocator()
        assert _allocation._allocator.get() is tma._torch_scratch

        def users(size: int, alignment: int, stream: int | None) -> torch.Tensor:
            return torch.empty(size, dtype=torch.int8)

        triton.set_allocator(users)
        tma.ensure_scratch_allocator()
        assert _allocation._allocator.get() is users  # the caller's own is kept

    # in a new context, so the allocators set here do not leak into other tests
    contextvars.Context().run(check)


def test_explain_names_the_forward_that_runs_and_whether_it_is_specialised(monkeypatch) -> None:
    q, k, v = _inputs(1, 2, 1, 64, 64, 128, torch.float16)
    # the interpreter's default is the small test tile; ask for the sm_90 table's row, warp specialisation
    # included as if switched on (the default leaves it out: test_triton_provenance.py)
    monkeypatch.setattr(
        support, "default_config", lambda q, s, variants, tried=True: shipped_config(128, q.dtype, "sm90")
    )
    text = str(fa.explain(q, k, v, is_causal=True, backend="triton"))
    assert "forward 128x128 w4 s2 tma ws: warp-specialised" in text, text
    text = str(fa.explain(q, k, v, dropout_p=0.1, backend="triton"))
    assert "forward 128x128 w8 s3 tma: not warp-specialised: dropout" in text, text


SM90 = ON_GPU and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_shipped_forward_runs_specialised_and_replays_in_a_cuda_graph(monkeypatch) -> None:
    # the scratch memory of the kernel's descriptors comes from torch's caching allocator, which serves capture
    monkeypatch.setenv("FLASHATTN_TEACH_WARP_SPECIALIZE", "1")  # off by default until a GPU run passes it
    q, k, v = _inputs(2, 4, 2, 1000, 1000, 128, torch.bfloat16, seed=4)
    with _forward_tiles() as seen:
        first = triton_attention(q, k, v, causal=True, enable_gqa=True)  # compiles outside the capture
    assert seen[0][1], seen
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        O = triton_attention(q, k, v, causal=True, enable_gqa=True)
    q2, k2, v2 = _inputs(2, 4, 2, 1000, 1000, 128, torch.bfloat16, seed=5)
    for dst, src in ((q, q2), (k, k2), (v, v2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    ref = dense_attention(*(t.double().cpu() for t in (q2, k2, v2)), causal=True, enable_gqa=True)
    assert_close_scaled(O, ref, REL_TOL[torch.bfloat16], "O replayed")
    assert not torch.equal(O, first)


# --- compiled for sm_90 ---------------------------------------------------------------------------------

_COMPILE = textwrap.dedent(
    """
    import json, os, subprocess, sys, tempfile
    import torch, triton
    from flashattn_teach.triton.configs import shipped_config
    from flashattn_teach.tools.kernels.specialize import kernel_request, with_kernel_config

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = []
    for d, causal, ws in json.loads(sys.argv[1]):
        config = shipped_config(d, torch.bfloat16, "sm90")
        if not ws:
            config = with_kernel_config(config, "forward", config.forward.unspecialised())
        compiled = kernel_request("forward", config, torch.bfloat16, d, "sm90", causal=causal).compile()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.cubin")
            with open(path, "wb") as f:
                f.write(compiled.asm["cubin"])
            sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
            usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        meta = compiled.metadata
        out.append(dict(d=d, causal=causal, ws=ws, config=str(config.forward), num_warps=meta.num_warps,
                        shared=meta.shared, sass=sass, usage=usage))
    print(json.dumps(out))
    """
)
BUILDS = [(64, False, True), (64, True, True), (128, False, True), (128, True, True), (128, False, False)]
SM90_SHARED_LIMIT = 232_448  # bytes of shared memory one block may use on sm_90
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


@pytest.fixture(scope="module")
def builds() -> dict[tuple[int, bool, bool], dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(BUILDS)], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {(b["d"], b["causal"], b["ws"]): b for b in json.loads(done.stdout.splitlines()[-1])}


def _sass_lines(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of each SASS instruction, predicate included."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.search, sass.splitlines()) if m]


def _consumer_loops(code: list[tuple[int, str]]) -> list[list[str]]:
    """The bodies of the innermost loops that hold warpgroup MMAs. A loop ends in a predicated branch back
    to a lower address; an unpredicated one is the way back from an mbarrier wait's retry stub, placed
    after the kernel's end, not a loop."""
    loops = []
    for address, text in code:
        branch = re.match(r"@!?U?P\d BRA (0x[0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) <= address:
            loops.append((int(branch.group(1), 16), address))
    bodies = {span: [t for a, t in code if span[0] <= a <= span[1]] for span in loops}
    with_mma = [span for span in loops if any(t.startswith("HGMMA") for t in bodies[span])]
    innermost = [s for s in with_mma if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in with_mma)]
    return [bodies[s] for s in innermost]


def not_specialised(build: dict) -> list[str]:
    """What in a compiled forward says it is not warp-specialised (nothing: it is)."""
    code = _sass_lines(build["sass"])
    instructions = [t.split(" ", 1)[-1] if t.startswith("@") else t for _, t in code]
    why = []
    if not any(t.startswith("USETMAXREG") for t in instructions):
        why.append("no setmaxnreg (USETMAXREG): the warpgroups do not trade registers")
    if not any(re.match(r"BAR\.(SYNC|ARV)\S* 0x[0-9a-f]+, 0x[0-9a-f]+$", t) for t in instructions):
        why.append("no named barrier (BAR.SYNC/BAR.ARV with a barrier id and a thread count)")
    loops = _consumer_loops(code)
    if not loops:
        why.append("no loop with HGMMA")
    for body in loops:
        cta_wide = [t for t in body if re.search(r"\bBAR\.SYNC(\.DEFER_BLOCKING)? 0x0$", t)]
        if cta_wide:
            why.append(f"a CTA-wide barrier in the consumer's loop: {cta_wide[0]}")
    if build["num_warps"] <= 4:
        why.append(f"{build['num_warps']} warps after compiling: no producer warpgroup was added")
    return why


@pytest.mark.parametrize(("d", "causal"), [(64, False), (64, True), (128, False), (128, True)])
def test_shipped_sm90_bf16_forward_is_warp_specialised(d: int, causal: bool, builds) -> None:
    build = builds[(d, causal, True)]
    assert build["config"].endswith(" ws"), build["config"]
    assert not_specialised(build) == []
    assert build["num_warps"] == 12  # a producer warpgroup and two consumer warpgroups
    assert build["shared"] <= SM90_SHARED_LIMIT
    spills = re.findall(r"(STACK|LOCAL):(\d+)", build["usage"])
    assert spills and all(n == "0" for _, n in spills), build["usage"]
    assert not re.search(r"\b(LDL|STL)\b", build["sass"])


def test_the_check_says_not_specialised_for_the_fallback_build(builds) -> None:
    build = builds[(128, False, False)]
    assert not build["config"].endswith(" ws")
    why = not_specialised(build)
    assert "no setmaxnreg (USETMAXREG): the warpgroups do not trade registers" in why, why
