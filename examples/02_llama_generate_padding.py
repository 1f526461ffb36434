"""A Hugging Face Llama with grouped-query attention running on flashattn_teach: a left-padded batch and
greedy generation with the KV cache, token for token the same as transformers' eager attention.

The model is built from a config in code with random weights (no download; transformers is the optional
``[transformers]`` extra). Two prompts of different lengths are left-padded into one batch, the way
tokenizers pad for generation; the two lines a user writes are::

    from flashattn_teach.integrations.transformers import register
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register())

``register()`` installs the attention function and transformers' SDPA mask function under one name, so the
padding reaches every attention call as a bool mask. The example compares the logits on real tokens with
eager attention's (float32; the integration's tests hold them within 1e-5), generates greedily with both,
and prints what ``flashattn_teach.explain`` says about the two kinds of call the model makes: the prompt
(causal and padding mask) and a decode step (one query over the cache, padding mask).

Run: python examples/02_llama_generate_padding.py [--new-tokens 12] [--layers 2]

Prints (a real run of the defaults on a 2-core CPU, transformers 5.24)::

    attn_implementation: 'teach', compared with 'eager'
    prompts (left-padded with 0):
       [24, 76, 91, 55, 90, 30, 66, 36, 66, 97, 49]
       [0, 0, 0, 0, 0, 0, 100, 71, 50, 40, 85]
    explain, the prompt in each layer: q (2, 4, 11, 16), k/v (2, 2, 11, 16), mask causal & padding
      parallel: cpu tensors: query-major tiles, the (batch, head) slices spread over 2 single-threaded workers;
        attn_mask read tile by tile;
        1 tile of 1024 x 256: 0 visited whole, 1 visited with a tile mask, 0 skipped
    explain, a decode step: q (2, 4, 1, 16), k/v (2, 2, 12, 16), mask padding
      parallel: cpu tensors: query-major tiles, the (batch, head) slices spread over 2 single-threaded workers;
        attn_mask read tile by tile;
        1 tile of 1024 x 256: 0 visited whole, 1 visited with a tile mask, 0 skipped
    max |logits - eager| on real tokens: 2.4e-07 (tolerance 1e-05)
    greedy generation, 12 new tokens with the KV cache:
      row 0 flashattn_teach: [43, 53, 69, 35, 68, 53, 69, 35, 70, 27, 36, 53]
      row 0 eager:           [43, 53, 69, 35, 68, 53, 69, 35, 70, 27, 36, 53]
      row 1 flashattn_teach: [16, 21, 11, 58, 39, 70, 63, 1, 85, 99, 82, 30]
      row 1 eager:           [16, 21, 11, 58, 39, 70, 63, 1, 85, 99, 82, 30]
    tokens equal eager's: True
"""

from __future__ import annotations

import argparse
import copy

import torch

import flashattn_teach as fa

try:
    import transformers
except ImportError:
    raise SystemExit("this example needs transformers: pip install 'flashattn-teach[transformers]'") from None

from flashattn_teach.integrations.transformers import register

VOCAB, PAD = 101, 0
LOGITS_TOLERANCE = 1e-5  # float32, as the integration's tests


def config(layers: int) -> transformers.LlamaConfig:
    """A small Llama: 4 query heads sharing 2 key/value heads (GQA), head dimension 16."""
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,  # random weights: no token ends a row early, both rows generate every new token
    )


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``(B, N)``: each prompt right-aligned, padding on the left."""
    N = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), N), PAD)
    mask = torch.zeros(len(prompts), N, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, N - len(p) :] = torch.tensor(p)
        mask[b, N - len(p) :] = 1
    return ids, mask


def show(plan: fa.Plan) -> None:
    """explain's answer, one clause a line."""
    print("  " + str(plan).replace("; ", ";\n    "))


def explain_calls(cfg: transformers.LlamaConfig, mask: torch.Tensor) -> None:
    """What explain says about the model's calls: the same shapes and mask as transformers passes them."""
    B, N = mask.shape
    H_q, H_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // H_q
    real = mask.bool()  # (B, N): key j of row b is a real token
    q, kv = torch.randn(B, H_q, N, D), torch.randn(B, H_kv, N, D)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    prompt_mask = causal & real[:, None, None, :]  # (N, N) & (B, 1, 1, N) -> (B, 1, N, N), True: visible
    print(f"explain, the prompt in each layer: q {tuple(q.shape)}, k/v {tuple(kv.shape)}, mask causal & padding")
    show(fa.explain(q, kv, kv, attn_mask=prompt_mask, enable_gqa=True))
    # The first decode step: one query per row over N + 1 cached keys, the padding still masked.
    step_mask = torch.cat([real, torch.ones(B, 1, dtype=torch.bool)], dim=1)[:, None, None, :]  # (B, 1, 1, N + 1)
    q1, kv1 = torch.randn(B, H_q, 1, D), torch.randn(B, H_kv, N + 1, D)
    print(f"explain, a decode step: q {tuple(q1.shape)}, k/v {tuple(kv1.shape)}, mask padding")
    show(fa.explain(q1, kv1, kv1, attn_mask=step_mask, enable_gqa=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)

    cfg = config(args.layers)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=register()).eval()
    # A config of its own: the model keeps its config object, and from_config writes the implementation into it.
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())  # the same random weights
    names = model.config._attn_implementation, eager.config._attn_implementation
    print(f"attn_implementation: {names[0]!r}, compared with {names[1]!r}")

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (11, 5)]
    ids, mask = left_padded(prompts)
    print("prompts (left-padded with 0):")
    for row in ids.tolist():
        print("  ", row)
    explain_calls(cfg, mask)

    with torch.no_grad():
        got, want = (m(input_ids=ids, attention_mask=mask).logits for m in (model, eager))
    logits_error = (got - want)[mask.bool()].abs().max().item()
    print(f"max |logits - eager| on real tokens: {logits_error:.1e} (tolerance {LOGITS_TOLERANCE:.0e})")

    kwargs = dict(attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=PAD)
    tokens, eager_tokens = (m.generate(ids, **kwargs)[:, ids.shape[1] :] for m in (model, eager))
    print(f"greedy generation, {args.new_tokens} new tokens with the KV cache:")
    for b in range(len(prompts)):
        print(f"  row {b} flashattn_teach: {tokens[b].tolist()}")
        print(f"  row {b} eager:           {eager_tokens[b].tolist()}")
    same = torch.equal(tokens, eager_tokens)
    print(f"tokens equal eager's: {same}")
    if not (same and logits_error <= LOGITS_TOLERANCE):
        raise SystemExit("flashattn_teach and eager attention disagree")


if __name__ == "__main__":
    main()
