"""flashattn_teach inside Hugging Face models: small random-weight models built in code (no download),
left-padded batches, compared with transformers' eager attention. The ``backends`` fixture (conftest.py)
records the backend of every call."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashattn_teach.errors import AttentionValueError  # noqa: E402
from flashattn_teach.integrations.transformers import register  # noqa: E402

VOCAB, N, NEW_TOKENS = 101, 13, 6


def _configs() -> dict[str, object]:
    small = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: 2 query heads per key/value head
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return {
        "llama": transformers.LlamaConfig(**small),
        "mistral": transformers.MistralConfig(**small, sliding_window=4),
        "gemma2": transformers.Gemma2Config(
            **small, head_dim=16, sliding_window=4, attn_logit_softcapping=2.0, query_pre_attn_scalar=16
        ),
    }


CONFIGS = _configs()
MODELS = {
    "llama": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM,
}


def _pair(family: str):
    """The same random weights twice: with eager attention, and with flashattn_teach."""
    torch.manual_seed(0)
    eager = MODELS[family](copy.deepcopy(CONFIGS[family]))
    eager.set_attn_implementation("eager")
    teach = MODELS[family](copy.deepcopy(CONFIGS[family]))
    teach.load_state_dict(eager.state_dict())
    teach.set_attn_implementation(register())
    return eager.eval(), teach.eval()


def _left_padded_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, N), generator=g)
    mask = torch.ones(3, N, dtype=torch.long)
    mask[1, :5] = 0  # left padding: 5 and 9 pad tokens; row 0 has none
    mask[2, :9] = 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.mark.parametrize("family", sorted(MODELS))
def test_logits_on_real_tokens_match_eager(family, backends):
    eager, teach = _pair(family)
    ids, mask = _left_padded_batch()
    with torch.no_grad():
        expected = eager(input_ids=ids, attention_mask=mask).logits
        backends.clear()
        got = teach(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert (got - expected)[real].abs().max().item() < 1e-5
    assert backends and "dense" not in backends
    # negative control: ignoring the padding changes the real tokens' logits well beyond the tolerance
    with torch.no_grad():
        unpadded = teach(input_ids=ids).logits
    assert (unpadded - expected)[real].abs().max().item() > 1e-3


@pytest.mark.parametrize("family", sorted(MODELS))
def test_greedy_generation_with_kv_cache_matches_eager(family, backends):
    eager, teach = _pair(family)
    ids, mask = _left_padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    expected = eager.generate(ids, **kwargs)
    backends.clear()
    got = teach.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    # one call per layer for the prompt and for each new token after the first, none dense
    layers = CONFIGS[family].num_hidden_layers
    assert len(backends) == layers * NEW_TOKENS and "dense" not in backends


@pytest.mark.parametrize("family", sorted(MODELS))
def test_training_step_gradients_match_eager(family, backends):
    eager, teach = _pair(family)
    ids, mask = _left_padded_batch()
    # The loss at position t compares logits[t] with labels[t + 1]: leave out each row's first real token, so
    # that no padding position's logits count (there eager averages padding values, and this library gives 0).
    first_real = mask.argmax(dim=1)
    labels = ids.masked_fill(mask == 0, -100).index_put((torch.arange(3), first_real), torch.tensor(-100))
    for model in (eager.train(), teach.train()):
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert "dense" not in backends
    for (name, p_e), (_, p_t) in zip(eager.named_parameters(), teach.named_parameters(), strict=True):
        torch.testing.assert_close(p_t.grad, p_e.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "name",
    [
        "paged|teach",  # transformers strips "paged|" and looks for "teach"
        "teach|kernels-community/attn",  # split at "|" for a hub kernel
        "kernels-community/teach",  # a hub kernel repository
        "flash_teach",  # any name with "flash" takes transformers' flash-attention paths
        "teach_sdpa",  # its SDPA dispatch checks
        "flex_attention_teach",  # its flex-attention checks
        "eager",
        "sdpa",
        "paged|eager",
        "",
    ],
)
def test_register_refuses_names_transformers_rewrites_or_reserves(name):
    with pytest.raises(AttentionValueError, match="name="):
        register(name)


def test_register_accepts_a_plain_name_and_a_paged_prefix_would_have_been_stripped():
    assert register("teach_attention") == "teach_attention"
    _, model = _pair("llama")
    model.set_attn_implementation("teach_attention")
    # negative control: registered directly under "paged|...", transformers strips the prefix and refuses the rest
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    from flashattn_teach.integrations.transformers import attention_forward

    AttentionInterface.register("paged|teach_probe", attention_forward)
    AttentionMaskInterface.register("paged|teach_probe", sdpa_mask)
    with pytest.raises(ValueError, match="teach_probe"), pytest.warns(FutureWarning, match="paged"):
        model.set_attn_implementation("paged|teach_probe")


def test_compiled_model_makes_one_graph_for_five_lengths():
    import torch._dynamo.testing

    eager, teach = _pair("llama")
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(teach, backend=counter, dynamic=True, fullgraph=True)
    for n in (9, 17, 40, 64, 100):
        ids = torch.randint(3, VOCAB, (2, n), generator=torch.Generator().manual_seed(n))
        mask = torch.ones(2, n, dtype=torch.long)
        mask[1, :3] = 0
        with torch.no_grad():
            got, expected = (
                compiled(input_ids=ids, attention_mask=mask).logits,
                eager(input_ids=ids, attention_mask=mask).logits,
            )
        assert (got - expected)[mask.bool()].abs().max().item() < 1e-5
    assert counter.frame_count == 1


def test_attention_dropout_in_training_runs_on_the_fast_path_and_follows_the_seed(backends):
    config = copy.deepcopy(CONFIGS["llama"])
    config.attention_dropout = 0.3
    torch.manual_seed(0)
    model = MODELS["llama"](config)
    model.set_attn_implementation(register())
    ids, mask = _left_padded_batch()

    def logits(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits

    model.train()
    first, again, other = logits(1), logits(1), logits(2)
    assert torch.equal(first, again) and not torch.allclose(first, other)
    model.eval()  # no dropout: the seed no longer matters
    assert torch.equal(logits(1), logits(2))
    assert backends and "dense" not in backends


def test_output_attentions_warns_as_transformers_sdpa_does_and_returns_none():
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    _, teach = _pair("llama")
    ids, mask = _left_padded_batch()
    logging.warning_once.cache_clear()  # transformers logs each message once per process
    with CaptureLogger(logging.get_logger("transformers")) as captured, torch.no_grad():
        out = teach(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert "output_attentions=True" in captured.out and "attn_implementation='eager'" in captured.out
    sdpa = MODELS["llama"](copy.deepcopy(CONFIGS["llama"]))
    sdpa.set_attn_implementation("sdpa")
    with torch.no_grad():
        sdpa_out = sdpa.eval()(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert [a is None for a in out.attentions] == [a is None for a in sdpa_out.attentions]  # what SDPA returns
    # negative control: without output_attentions nothing is logged
    logging.warning_once.cache_clear()
    with CaptureLogger(logging.get_logger("transformers")) as captured, torch.no_grad():
        teach(input_ids=ids, attention_mask=mask)
    assert captured.out == ""
