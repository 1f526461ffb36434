"""Generation with flashattn_teach in a small Llama and Qwen 2, against eager attention: static and dynamic
caches, unpadded and left-padded batches, and a chunk of several tokens against a cache."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import PAD, build, llama_config, padded_batch, qwen2_config  # noqa: E402

FAMILIES = {
    "llama": (transformers.LlamaForCausalLM, llama_config),
    "qwen2": (transformers.Qwen2ForCausalLM, qwen2_config),
}
NEW_TOKENS = 5


def _pair(family: str):
    model_class, config = FAMILIES[family]
    return build(model_class, config(), "eager"), build(model_class, config(), "teach")


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_equal_eager(family, padding, cache, backends):
    eager, teach = _pair(family)
    ids, mask = padded_batch("left")
    if padding == "none":  # the prefill into a static cache then has no mask: transformers relies on is_causal
        ids, mask = ids[:1], mask[:1]
    kwargs = dict(
        attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD, cache_implementation=cache
    )
    expected = eager.generate(ids, **kwargs)
    backends.clear()
    assert torch.equal(teach.generate(ids, **kwargs), expected)
    assert backends and "dense" not in backends


def test_a_chunk_against_a_dynamic_cache_matches_eager():
    # 4 new tokens at once after a 9-token prompt (chunked prefill, speculative decoding): transformers builds a mask
    eager, teach = _pair("llama")
    ids, _ = padded_batch("left")
    prompt, chunk = ids[:, :9], ids[:, 9:]
    logits = []
    with torch.no_grad():
        for model in (eager, teach):
            cache = model(input_ids=prompt, use_cache=True).past_key_values
            logits.append(model(input_ids=chunk, cache=cache, use_cache=True).logits)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
