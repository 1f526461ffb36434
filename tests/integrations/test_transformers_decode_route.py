"""A transformers decode step goes to flash_attention_with_kvcache when its mask shows each row one run of keys
(left padding, a static cache's unused slots, a sliding window), with cache_leftpad and cache_seqlens from the
mask; any other mask keeps the general path. On CUDA that is the split-KV decode kernel; here the route is
switched on for the CPU (DECODE_DEVICES) and checked against eager generation."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import PAD, build, gpt_oss_config, llama_config, padded_batch  # noqa: E402

from flashattn_teach.integrations import transformers_decode  # noqa: E402


@pytest.fixture
def routed(monkeypatch):
    """The decode route on for CPU tensors; the list of every cache_leftpad it passed (None: no mask)."""
    seen: list[torch.Tensor | None] = []
    call = transformers_decode.flash_attention_with_kvcache

    def record(*args, **kwargs):
        seen.append(kwargs["cache_leftpad"])
        return call(*args, **kwargs)

    monkeypatch.setattr(transformers_decode, "DECODE_DEVICES", ("cpu",))
    monkeypatch.setattr(transformers_decode, "flash_attention_with_kvcache", record)
    return seen


def test_visible_runs_reads_each_rows_run_and_refuses_a_hole():
    keys = torch.arange(8)
    rows = torch.stack([(keys >= 2) & (keys < 6), keys >= 0, (keys >= 5)])  # (3, 8)
    leftpad, seqlens = transformers_decode.visible_runs(rows[:, None, None, :])
    assert leftpad.tolist() == [2, 0, 5] and seqlens.tolist() == [6, 8, 8]
    assert leftpad.dtype == seqlens.dtype == torch.int32
    holed = rows.clone()
    holed[1, 3] = False  # row 1 sees [0, 3) and [4, 8): two runs, not a padding
    assert transformers_decode.visible_runs(holed[:, None, None, :]) is None
    empty = rows.clone()
    empty[2] = False
    assert transformers_decode.visible_runs(empty[:, None, None, :]) is None


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_left_padded_generation_decodes_on_the_kvcache_path_and_equals_eager(cache, routed):
    eager, teach = (build(transformers.LlamaForCausalLM, llama_config(), name) for name in ("eager", "teach"))
    ids, mask = padded_batch("left")
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD, cache_implementation=cache)
    expected = eager.generate(ids, **kwargs)
    assert torch.equal(teach.generate(ids, **kwargs), expected)
    # 3 decode steps (the first new token comes from the prefill) in each of 2 layers, each with the padding
    assert len(routed) == 3 * 2
    assert all(lp is not None and lp.tolist() == [0, 5, 9] for lp in routed)


def test_gpt_oss_decode_with_sinks_and_a_window_equals_eager(routed):
    eager, teach = (build(transformers.GptOssForCausalLM, gpt_oss_config(), name) for name in ("eager", "teach"))
    with torch.no_grad():
        for model in (eager, teach):  # sinks far from 0, so a dropped sink changes the tokens' logits
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, layer.self_attn.sinks.numel()))
    ids, mask = padded_batch("left")
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        want = eager.generate(ids, **kwargs, output_logits=True, return_dict_in_generate=True)
        got = teach.generate(ids, **kwargs, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-5, rtol=1e-5)
    assert len(routed) == 3 * 2  # the sliding layer's window (4 keys) is a run too


def test_a_step_with_no_keys_takes_the_general_path():
    mask = torch.zeros(2, 1, 1, 0, dtype=torch.bool)
    assert transformers_decode.visible_runs(mask) is None
