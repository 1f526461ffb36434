"""``replay_decode`` takes its arguments "as for ``flash_attention_with_kvcache``": every keyword the two share
has the call's default and kind, so a step made with the defaults is replayed as the call runs it. The
call's keywords the replay does not take are listed by name, so a keyword added to the call later fails
here until the replay takes it or the list says why not."""

from __future__ import annotations

import inspect

import torch

from flashattn_teach import flash_attention_with_kvcache
from flashattn_teach.replay import replay_decode

# the call's parameters the replay has no use for: it runs no backend, returns lse with every replay, and
# replays caches without left padding
NOT_REPLAYED = {"backend", "return_lse", "cache_leftpad"}


def test_replay_decode_defaults_are_the_decode_calls() -> None:
    call = inspect.signature(flash_attention_with_kvcache).parameters
    replay = inspect.signature(replay_decode).parameters
    assert set(call) - set(replay) == NOT_REPLAYED
    for name in set(call) & set(replay):
        assert (replay[name].default, replay[name].kind) == (call[name].default, call[name].kind), name


def test_a_multi_query_step_made_with_defaults_is_replayed_as_the_call_runs_it() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 3, 4, generator=g, dtype=torch.float64)  # three new queries: causal changes them
    k_cache, v_cache = (torch.randn(1, 1, 8, 4, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 1, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
    r = replay_decode(q, k_cache, v_cache, k, v, cache_seqlens=4, block_n=2, num_splits=2)
    O = flash_attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=4)
    torch.testing.assert_close(r.O, O[0, 0], rtol=0, atol=1e-13)
    causal = flash_attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=4, causal=True)
    assert (causal - O).abs().max() > 1e-2  # the control: the default matters on this step
