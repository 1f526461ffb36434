"""Tiny random-weight Hugging Face models built in code (no download) for the integration tests, and the
batches they run on. Each model is built once per implementation from the same seed, so the weights agree."""

from __future__ import annotations

import copy

import torch
import transformers

from flashattn_teach.integrations.transformers import register

VOCAB = 101
PAD = 0

_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention: 2 query heads per key/value head
    max_position_embeddings=64,
    pad_token_id=PAD,
    bos_token_id=None,
    eos_token_id=None,  # random weights: no row ends early, every row generates every new token
)


def llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**_SMALL)


def qwen2_config() -> transformers.Qwen2Config:
    return transformers.Qwen2Config(**_SMALL)


def t5_config() -> transformers.T5Config:
    """A T5 with relative position buckets (``position_bias``) in encoder, decoder and cross attention."""
    return transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        pad_token_id=PAD,
        eos_token_id=None,
        decoder_start_token_id=PAD,
    )


def gpt_oss_config() -> transformers.GptOssConfig:
    """A GPT-OSS: attention sinks (``s_aux``), a sliding and a full layer, two experts."""
    return transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=PAD,
        eos_token_id=None,
        bos_token_id=None,
    )


def build(model_class, config, implementation: str, dtype: torch.dtype = torch.float32):
    """``model_class(config)`` with the weights of seed 0, in ``dtype``, in eval mode."""
    torch.manual_seed(0)
    model = model_class(copy.deepcopy(config))  # from_config-like: the model keeps (and edits) its config
    model.set_attn_implementation(register() if implementation == "teach" else implementation)
    return model.to(dtype).eval()


def padded_batch(side: str, B: int = 3, N: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``(B, N)``: row 0 unpadded, rows 1 and 2 padded with 5 and 9
    tokens on ``side`` ("left", as for generation, or "right", as for training)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (B, N), generator=g)
    mask = torch.ones(B, N, dtype=torch.long)
    for b, pads in zip(range(1, B), (5, 9), strict=False):
        if side == "left":
            mask[b, :pads] = 0
        else:
            mask[b, N - pads :] = 0
    ids[mask == 0] = PAD
    return ids, mask
