"""``replay_decode(..., source="triton")``: every term the decode kernel traced (triton/kernels/decode.py,
``TRACE=True``, in Triton's interpreter), each split's updates and its partial before the merge, against the
reference's within what the arithmetic allows; negative controls that break one term; the CLI's table and JSON.

The bounds are a priori, from the inputs, never from the kernel's output (``u`` the unit roundoff, ``2^-24`` in
float32, ``2^-11`` in float16; ``n`` the keys of the split folded in so far; both sides round, so each bound
covers the kernel's rounding and the float32 reference's):

    S_ij     (D + 4) u32 scale (|q| |k|^T)          a length-D dot, the folded scale, the ln 2 back
    m_i      e_m: the same, the row's largest        a maximum of those scores
    alpha    alpha (2 e_m + 4 u32)                   exp of a difference of two maxima
    l_i      l_i (2 e_m + (n + 4) u32)               a sum of n exponentials
    acc      (rel + uP) l_i max|V|                   the same sum times V; uP: P rounded to V's dtype (u16)
    O_s      (2 rel + uP + uO) max|V|                acc / l_i; uO: O rounded to q's dtype with one split
    lse_s    e_m + 2 rel + 4 u32 (|lse_s| + 1)        m_i + log l_i

with ``rel = 2 e_m + (n + 4) u32``. The float16 inputs are the same numbers for both (the reference computes
in float32 from them): only the kernel's cast of ``P`` (and with one split its float16 output) adds rounding."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

pytest.importorskip("triton")

import torch

from flashattn_teach.errors import AttentionValueError
from flashattn_teach.replay.decode_replay import replay_decode

U32, U16 = 2.0**-24, 2.0**-11
B, H_Q, H_KV, N_MAX, D = 2, 4, 2, 70, 24  # D = 24: lanes past D masked (BLOCK_D 32)


def inputs(dtype: torch.dtype, N_new: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_Q, N_new, D, generator=g)
    caches = [torch.randn(B, H_KV, N_MAX, D, generator=g) for _ in range(2)]
    new = [torch.randn(B, H_KV, 2, D, generator=g) for _ in range(2)]
    return [t.to(dtype) for t in (q, *caches, *new)]


def head_inputs(q, k_cache, v_cache, k, v, n: int, b: int, h: int):
    """``q (N_new, D)``, ``k, v (L, D)`` of the replayed head after the step's write, float64."""
    h_kv = h // (H_Q // H_KV)
    keys = torch.cat([k_cache[b, h_kv, :n], k[b, h_kv]]).double()
    values = torch.cat([v_cache[b, h_kv, :n], v[b, h_kv]]).double()
    return q[b, h].double(), keys, values


def over_bound(r, q, k, v, uP: float, uO: float) -> list[tuple[int, int, str]]:
    """``(split, update, term)`` of every traced term further from the reference's than its bound, anywhere."""
    bad = []
    scale, Vmax = r.scale, v.abs().max()
    for split in r.splits:
        s0 = split.keys[0]
        for step in split:
            c0, c1 = step.cols
            e_S = (D + 4) * U32 * scale * (q.abs() @ k[c0:c1].abs().T)  # (N_new, Bc)
            e_m = (D + 4) * U32 * scale * (q.abs() @ k[s0:c1].abs().T).amax(-1)  # (N_new,)
            rel = 2 * e_m + (c1 - s0 + 4) * U32
            l_i = step["l_i"].double()
            bounds = {
                "S_ij": e_S,
                "m_i": e_m,
                "alpha": step["alpha"].double() * (2 * e_m + 4 * U32),
                "l_i": l_i * rel,
                "acc_new": ((rel + uP) * l_i * Vmax)[:, None],
                "O_partial": ((2 * rel + uP + uO) * Vmax)[:, None],
            }
            assert set(step.kernel) == set(bounds) - ({"O_partial"} if not step.last else set())
            for name, mine in step.kernel.items():
                ref = step[name].double()
                if not bool(((mine == ref) | ((mine - ref).abs() <= bounds[name])).all()):
                    bad.append((split.index, step.index, name))
    return bad


def partial_over_bound(r, q, k, v, uP: float, uO: float) -> list[str]:
    """The merges' traced partials (``lse_a, lse_b, O_a, O_b``) beyond their bound (module docstring)."""
    bad = []
    scale, Vmax = r.scale, v.abs().max()
    for m in r.merges:
        for side, split in (("a", m.merged[0] if m.index == 0 else None), ("b", m.split)):
            if split is None:
                continue
            s0, s1 = r.ranges[split]
            e_m = (D + 4) * U32 * scale * (q.abs() @ k[s0:s1].abs().T).amax(-1)
            rel = 2 * e_m + (s1 - s0 + 4) * U32
            lse = m[f"lse_{side}"].double()
            bounds = {
                f"lse_{side}": e_m + 2 * rel + 4 * U32 * (lse.abs() + 1),
                f"O_{side}": ((2 * rel + uP + uO) * Vmax)[:, None],
            }
            for name, bound in bounds.items():
                mine, ref = m.kernel[name], m[name].double()
                if not bool(((mine == ref) | ((mine - ref).abs() <= bound)).all()):
                    bad.append(name)
    return bad


CASES = [  # (N_new, causal, num_splits, window): one split, several (the last one short), a window
    (1, False, 1, None),
    (2, True, 3, None),
    (2, True, 2, (20, 0)),
]


@pytest.mark.parametrize(("dtype", "uP"), [(torch.float32, 0.0), (torch.float16, U16)])
@pytest.mark.parametrize(("N_new", "causal", "splits", "window"), CASES)
def test_every_traced_decode_term_matches_the_reference(dtype, uP, N_new, causal, splits, window) -> None:
    t = inputs(dtype, N_new)
    b, h, n = 1, 3, 50
    r = replay_decode(
        *t, cache_seqlens=n, block_n=16, num_splits=splits, batch_index=b, head=h, causal=causal, window=window,
        source="triton",
    )  # fmt: skip
    assert r.source == "triton" and r.block_n == 16 and len(r.splits) >= min(splits, 2)
    q, k, v = head_inputs(*t, n, b, h)
    uO = 0.0 if splits > 1 else (U16 if dtype == torch.float16 else U32)  # one split: O in q's dtype
    assert over_bound(r, q, k, v, uP, uO) == []
    assert partial_over_bound(r, q, k, v, uP, uO) == []
    assert all(step.kernel for split in r.splits for step in split) and all(m.kernel for m in r.merges)
    # the kernel's merged output against the dense float64 one: as close as its partials allow
    assert float((r.kernel.trace.O.double() - r.O_final).abs().max()) < (1e-3 if dtype == torch.float16 else 1e-5)


def test_float16_acc_differs_by_the_rounding_of_P() -> None:
    """Without ``uP`` in the bound the float16 run's ``acc`` (and only ``acc`` and the partial) leaves it."""
    t = inputs(torch.float16, 2)
    r = replay_decode(*t, cache_seqlens=50, block_n=16, num_splits=3, causal=True, source="triton")
    q, k, v = head_inputs(*t, 50, 0, 0)
    bad = over_bound(r, q, k, v, 0.0, 0.0)
    assert bad and {name for _, _, name in bad} <= {"acc_new", "O_partial"}


def test_the_replay_takes_the_kernels_block_n_and_split_ranges() -> None:
    t = inputs(torch.float32, 1)
    r = replay_decode(*t, cache_seqlens=50, block_n=4, num_splits=3, source="triton")
    # L = 52 keys, 4 blocks of 16: two blocks a split (the kernel's whole blocks), where the reference cuts 18
    assert r.ranges == ((0, 32), (32, 52), (52, 52)) and r.block_n == 16
    assert "16 keys" in r.note and "not 4" in r.note
    ref = replay_decode(*t, cache_seqlens=50, block_n=4, num_splits=3)
    assert ref.ranges == ((0, 18), (18, 36), (36, 52)) and ref.source == "reference"
    assert all(not step.kernel for split in ref.splits for step in split)


def test_a_perturbed_alpha_in_the_trace_is_caught() -> None:
    t = inputs(torch.float32, 2)
    r = replay_decode(*t, cache_seqlens=50, block_n=16, num_splits=2, causal=True, source="triton")
    q, k, v = head_inputs(*t, 50, 0, 0)
    assert over_bound(r, q, k, v, 0.0, 0.0) == []
    records = r.kernel.trace.records  # (splits, blocks, N_new, W), what the steps read when iterated
    records[0, 1, :, 16 + 2] *= 1 + 1e-3  # alpha of split 0's second block: its bound is about 2e-5 alpha here
    assert over_bound(r, q, k, v, 0.0, 0.0) == [(0, 1, "alpha")]


def test_a_perturbed_partial_is_caught() -> None:
    t = inputs(torch.float32, 2)
    r = replay_decode(*t, cache_seqlens=50, block_n=16, num_splits=2, causal=True, source="triton")
    q, k, v = head_inputs(*t, 50, 0, 0)
    assert partial_over_bound(r, q, k, v, 0.0, 0.0) == []
    r.kernel.trace.lse_part[1] += 1e-4  # split 1's lse before the merge, far past its bound
    merges = tuple(dataclasses.replace(m, kernel=r.kernel.merge_terms(m, last=True)) for m in r.merges)
    assert partial_over_bound(dataclasses.replace(r, merges=merges), q, k, v, 0.0, 0.0) == ["lse_b"]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"sinks": torch.zeros(H_Q)}, "sinks"),
        ({"merge_order": [1, 0]}, "merge_order"),
        ({"block_table": torch.zeros(B, 5, dtype=torch.int32)}, "block_table"),
    ],
)
def test_what_the_trace_build_does_not_run_is_refused_by_name(kwargs, named) -> None:
    q, k_cache, v_cache, k, v = inputs(torch.float32, 1)
    if "block_table" in kwargs:  # pools of 16-key pages
        k_cache, v_cache = torch.randn(10, H_KV, 16, D), torch.randn(10, H_KV, 16, D)
    with pytest.raises(AttentionValueError, match=named):
        replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=30, block_n=16, num_splits=2, source="triton", **kwargs)


def test_the_cli_writes_the_kernel_column_in_table_and_json(tmp_path) -> None:
    from flashattn_teach.replay.manifest import schema

    jsonschema = pytest.importorskip("jsonschema")
    common = [sys.executable, "-m", "flashattn_teach.cli", "replay", "decode", "--source", "triton", "--dtype"]
    common += ["float32", "--head-dim", "8", "--cache-len", "30", "--num-splits", "2", "--cache-size", "40"]
    out = tmp_path / "decode.json"
    done = subprocess.run([*common, "--format", "json", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, schema())
    assert doc["kernel"]["numSplits"] == 2 and doc["kernel"]["blockN"] == 16
    terms = doc["cases"][0]["kernel"]["terms"]
    # 32 keys, two splits of one 16-key block each: the split's one update is its last, with its partial
    assert [t["name"] for t in terms] == ["S_ij", "m_i", "l_i", "alpha", "acc_new", "O_partial"]
    assert all(t["maxDiff"] is not None and t["maxDiff"] < 1e-5 for t in terms)
    assert {t["name"] for t in doc["decode"]["merges"][-1]["kernel"]["terms"]} >= {"lse_b", "O_b", "lse", "O"}
    done = subprocess.run([*common, "--format", "table"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Kernel (decode.py) beside the reference" in done.stdout and "max |difference|" in done.stdout
    assert "the kernel's partials and result" in done.stdout and not math.isnan(doc["kernel"]["maxDiffOutput"])
