"""Every backward of the library computes its tiles with ``core.backward.tile_terms``, and every tiled forward
folds its tiles with ``core.online_softmax``: a deliberately wrong version of either, patched in where it is
used, changes each path's result by exactly the planted amount, so no path holds a copy of its own."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashattn_teach as fa
from flashattn_teach._options import make_options
from flashattn_teach.core import backward as core_backward
from flashattn_teach.core import dense_attention, flash_backward
from flashattn_teach.core import online_softmax as core_update
from flashattn_teach.reference import parallel
from flashattn_teach.reference.backward import flash_backward as reference_backward
from flashattn_teach.replay.backward_replay import replay_backward

from probes import patch_everywhere

F64 = torch.float64


def _inputs(N_q: int = 20, N_k: int = 28, D: int = 8):
    g = torch.Generator().manual_seed(0)
    q, k, v, dO = (torch.randn(1, 1, n, D, generator=g, dtype=F64) for n in (N_q, N_k, N_k, N_q))
    O, lse = dense_attention(q, k, v, causal=True)
    return q, k, v, O, dO, lse


def _backwards(softcap: float | None) -> dict[str, torch.Tensor]:
    """``dv`` of each backward path on the same causal call (one head), with ``softcap`` where it takes one."""
    q, k, v, O, dO, lse = _inputs()
    opts = {"causal": True, "block_m": 8, "block_n": 8}
    if softcap is not None:  # O and lse of the capped attention, from the library's own oracle
        O, lse = fa.dense_attention(q, k, v, causal=True, softcap=softcap, return_lse=True)
    grouped = [t.unsqueeze(2) for t in (q, k, v, O, lse, dO)]  # (B, H_kv, G = 1, N, .)
    out = {
        "reference": reference_backward(q, k, v, O, lse, dO, softcap=softcap, **opts)[2],
        "parallel": parallel.parallel_backward(
            *grouped, None, scale=8**-0.5, tiling=make_options(q, k, v, causal=True).mask.tiling(8, 8), workers=1
        )[2].squeeze(2)
        if softcap is None
        else None,
        "replay": replay_backward(q[0, 0], k[0, 0], v[0, 0], dO[0, 0], softcap=softcap, **opts).grads()[2],
    }
    if softcap is None:
        out["core"] = flash_backward(q, k, v, O, dO, lse, **opts)[2]
    return {name: dv.reshape(k.shape[-2], -1) for name, dv in out.items() if dv is not None}


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_every_backward_computes_its_tiles_with_core_tile_terms(softcap, monkeypatch) -> None:
    right = _backwards(softcap)
    original = core_backward.tile_terms

    def planted(*args, **kwargs):
        t = original(*args, **kwargs)
        return dataclasses.replace(t, dV=3 * t.dV)  # a wrong dV contribution: 3 P^T dO

    patch_everywhere(monkeypatch, core_backward, "tile_terms", planted)
    wrong = _backwards(softcap)
    assert set(wrong) == set(right) and len(right) == (4 if softcap is None else 2)
    for name in right:
        assert right[name].abs().max() > 0.1
        torch.testing.assert_close(wrong[name], 3 * right[name], msg=name)


def test_every_tiled_forward_folds_its_tiles_with_core_online_softmax(monkeypatch) -> None:
    """``finalize`` gives O and lse to the query-major, key-major and parallel paths and to core's loops."""
    q, k, v, *_ = _inputs()
    paths = {
        backend: (lambda backend=backend: fa.flash_attention(q, k, v, causal=True, backend=backend))
        for backend in ("query_major", "key_major", "parallel")
    }
    right = {name: call() for name, call in paths.items()}
    original_normalize = core_update.normalize

    def planted(l_i, acc):
        return 2 * original_normalize(l_i, acc)

    patch_everywhere(monkeypatch, core_update, "normalize", planted)
    original_finalize = core_update.finalize
    patch_everywhere(
        monkeypatch, core_update, "finalize", lambda m, l, acc: (planted(l, acc), original_finalize(m, l, acc)[1])
    )
    for name, call in paths.items():
        torch.testing.assert_close(call(), 2 * right[name], msg=name)
