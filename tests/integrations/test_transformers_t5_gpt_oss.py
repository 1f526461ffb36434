"""Models that hand the attention function more than a mask: T5's relative position bias (``position_bias``)
must reach the scores; GPT-OSS's attention sinks (``s_aux``) must reach every softmax, forward and backward."""

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


def _gpt_oss(name: str):
    return build(transformers.GptOssForCausalLM, gpt_oss_config(), name)


def test_gpt_oss_logits_and_gradients_match_eager(backends):
    """Every parameter's gradient, the sinks' included, of a loss over the real (unpadded) positions; left
    padding leaves query rows that see no key, where both give 0 (the sink takes all the weight)."""
    ids, mask = padded_batch("left")
    real = mask.bool()
    out = {}
    for name in ("eager", "teach"):
        model = _gpt_oss(name).train()  # train(): gradients; the config has no attention dropout
        backends.clear()
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = logits[real].logsumexp(-1).sum()
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        out[name] = (logits.detach(), grads)
    assert backends and "dense" not in backends  # the teach model ran flashattn_teach, not the oracle
    (want, want_grads), (got, got_grads) = out["eager"], out["teach"]
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert want_grads.keys() == got_grads.keys()
    sink_names = [n for n in want_grads if n.endswith("sinks")]
    assert len(sink_names) == 2 and all(want_grads[n].abs().max() > 0 for n in sink_names)
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, atol=1e-5, rtol=1e-4, msg=n)


def test_gpt_oss_greedy_generation_matches_eager():
    ids, mask = padded_batch("left")
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        assert torch.equal(_gpt_oss("teach").generate(ids, **kwargs), _gpt_oss("eager").generate(ids, **kwargs))


def test_gpt_oss_sinks_change_the_logits():
    """Negative control: without its sinks (-inf: no weight) the model's logits move, so the comparison above
    would see sinks that were dropped."""
    ids, mask = padded_batch("left")
    teach = _gpt_oss("teach")
    with torch.no_grad():
        logits = teach(input_ids=ids, attention_mask=mask).logits
        for layer in teach.model.layers:
            layer.self_attn.sinks.fill_(-torch.inf)  # exp(-inf) = 0: the sink takes no weight
        without_sinks = teach(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert logits.isfinite().all() and (logits[real] - without_sinks[real]).abs().max() > 1e-3
