"""Ready-made 4-D masks, as transformers' ``test_custom_4d_attention_mask`` passes them: a float mask with
``finfo(dtype).min`` where masked, here packing two sequences into one row, against eager attention and
against each sequence run alone."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import VOCAB, build, llama_config, qwen2_config  # noqa: E402

FAMILIES = {
    "llama": (transformers.LlamaForCausalLM, llama_config),
    "qwen2": (transformers.Qwen2ForCausalLM, qwen2_config),
}
LENGTHS = (5, 6)  # two sequences packed into one row of 11 tokens


def _packed() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids (1, 11)``, ``position_ids (1, 11)`` restarting at each sequence, and the block-causal bool
    mask ``(1, 1, 11, 11)`` (True: visible)."""
    ids = torch.randint(3, VOCAB, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(4))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    sequence = torch.cat([torch.full((n,), s) for s, n in enumerate(LENGTHS)])  # (11,): which sequence
    N = sum(LENGTHS)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    visible = causal & (sequence[:, None] == sequence[None, :])
    return ids, positions, visible[None, None]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_custom_float_4d_mask_matches_eager_and_the_sequences_run_alone(family, backends):
    model_class, config = FAMILIES[family]
    eager, teach = (build(model_class, config(), name) for name in ("eager", "teach"))
    ids, positions, visible = _packed()
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        backends.clear()
        got = teach(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        alone = torch.cat([teach(input_ids=part).logits for part in ids.split(LENGTHS, dim=1)], dim=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    assert backends and "dense" not in backends


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_is_causal_false_passed_to_the_model_gives_bidirectional_attention_as_sdpa(family):
    # transformers' kwargs carry is_causal to every attention call ("use decoder attention modules as encoders");
    # without padding its mask function builds no mask, and SDPA then attends both ways
    model_class, config = FAMILIES[family]
    sdpa, teach = (build(model_class, config(), name) for name in ("sdpa", "teach"))
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = sdpa(input_ids=ids, is_causal=False).logits
        got = teach(input_ids=ids, is_causal=False).logits
        causal = teach(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (causal - want).abs().max() > 1e-3  # negative control: the flag matters


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_sequences_marked_by_position_ids_alone_match_eager(family, backends):
    # training on packed rows without an attention_mask or cache: transformers' mask function finds the
    # sequences from the restarting position_ids and builds a block-causal bool mask
    model_class, config = FAMILIES[family]
    eager, teach = (build(model_class, config(), name) for name in ("eager", "teach"))
    ids, positions, _ = _packed()
    with torch.no_grad():
        want = eager(input_ids=ids, position_ids=positions, use_cache=False).logits
        backends.clear()
        got = teach(input_ids=ids, position_ids=positions, use_cache=False).logits
        unpacked = teach(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert backends and "dense" not in backends
    assert (unpacked - want).abs().max() > 1e-3  # negative control: the packing matters
