"""Logits of left- and right-padded batches in float32, bfloat16 and float16, flashattn_teach against eager
attention and transformers' SDPA. In float32 all three agree within 1e-5; in 16 bits each is judged against
the float32 eager model, and this library's error must stay within twice that of eager or SDPA in the same
precision (flash-attention's own test rule), plus a floor for rounding of the logits themselves."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import build, llama_config, padded_batch, qwen2_config  # noqa: E402

FAMILIES = {
    "llama": (transformers.LlamaForCausalLM, llama_config),
    "qwen2": (transformers.Qwen2ForCausalLM, qwen2_config),
}
# A floor added to twice the reference error: a quarter of an ulp of the logits (|logits| < 1 here: ulp 2^-8
# in bfloat16, 2^-11 in float16); the errors seen are about 3e-3 and 4e-4, for all three implementations.
FLOOR = {torch.bfloat16: 1e-3, torch.float16: 1e-4}


def _logits(family: str, implementation: str, dtype: torch.dtype, ids, mask) -> torch.Tensor:
    model_class, config = FAMILIES[family]
    with torch.no_grad():
        return build(model_class, config(), implementation, dtype)(input_ids=ids, attention_mask=mask).logits.float()


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float32_logits_match_eager_and_sdpa(family, side, backends):
    ids, mask = padded_batch(side)
    real = mask.bool()  # transformers discards the padding rows; there eager averages padding, this library gives 0
    got = _logits(family, "teach", torch.float32, ids, mask)
    assert backends and "dense" not in backends
    for other in ("eager", "sdpa"):
        want = _logits(family, other, torch.float32, ids, mask)
        assert (got - want)[real].abs().max().item() < 1e-5, other


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_16_bit_logits_err_no_more_than_twice_eager_or_sdpa(family, side, dtype):
    ids, mask = padded_batch(side)
    real = mask.bool()
    reference = _logits(family, "eager", torch.float32, ids, mask)

    def error(implementation: str) -> float:
        return (_logits(family, implementation, dtype, ids, mask) - reference)[real].abs().max().item()

    baseline = max(error("eager"), error("sdpa"))
    assert error("teach") <= 2 * baseline + FLOOR[dtype]
