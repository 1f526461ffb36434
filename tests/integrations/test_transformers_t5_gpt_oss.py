"""Models that hand the attention function more than a mask: T5's relative position bias (``position_bias``)
must reach the scores; GPT-OSS's attention sinks (``s_aux``), not implemented here, must be refused by name."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import PAD, build, gpt_oss_config, padded_batch, t5_config  # noqa: E402

T5 = transformers.T5ForConditionalGeneration


def _decoder_ids(B: int) -> torch.Tensor:
    return torch.randint(3, 101, (B, 6), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("side", ["left", "right"])
def test_t5_logits_match_eager(side, backends):
    eager, teach = (build(T5, t5_config(), name) for name in ("eager", "teach"))
    ids, mask = padded_batch(side)
    decoder_ids = _decoder_ids(ids.shape[0])
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        backends.clear()
        got = teach(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    # every decoder position is real; the encoder's padding rows are masked out of the cross attention
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert backends and "dense" not in backends


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_t5_greedy_generation_matches_eager(cache):
    eager, teach = (build(T5, t5_config(), name) for name in ("eager", "teach"))
    ids, mask = padded_batch("right")
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD, cache_implementation=cache)
    assert torch.equal(teach.generate(ids, **kwargs), eager.generate(ids, **kwargs))


def test_t5_training_gradients_match_eager():
    # the relative attention bias is learned: its gradient flows through position_bias
    ids, mask = padded_batch("right")
    labels = _decoder_ids(ids.shape[0])
    grads = []
    for name in ("eager", "teach"):
        model = build(T5, t5_config(), name).train()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("relative_attention_bias" in n for n in grads[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_gpt_oss_attention_sinks_are_refused_by_name():
    ids, mask = padded_batch("left")
    teach = build(transformers.GptOssForCausalLM, gpt_oss_config(), "teach")
    with pytest.raises(NotImplementedError, match=r"s_aux.*attn_implementation='eager'"), torch.no_grad():
        teach(input_ids=ids, attention_mask=mask)
    # negative control: the model runs with eager attention, and its sinks change its logits
    eager = build(transformers.GptOssForCausalLM, gpt_oss_config(), "eager")
    with torch.no_grad():
        logits = eager(input_ids=ids, attention_mask=mask).logits
        for layer in eager.model.layers:
            layer.self_attn.sinks.fill_(-torch.inf)  # exp(-inf) = 0: the sink takes no weight
        without_sinks = eager(input_ids=ids, attention_mask=mask).logits
    assert logits.isfinite().all() and (logits - without_sinks).abs().max() > 1e-3
