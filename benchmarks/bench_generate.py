"""A Hugging Face model's prefill and greedy ``generate`` on the CPU: this library's attention against torch's SDPA.

A random-weight Llama (GQA: 8 query heads, 2 key/value heads, head dim 64, 8 layers) built from a config,
no download; a batch of two prompts of 512 tokens, the second left-padded by 100; a prefill call, then 32
greedy tokens with the KV cache. Each implementation runs twice, alternating, in one process, so that the
two are measured under the same load; the script prints every run. Needs ``transformers``.

    python benchmarks/bench_generate.py
    python benchmarks/bench_generate.py --new-tokens 64 --layers 4

A one-off on the CPU; never a CI gate.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args(argv)
    import transformers

    from flashattn_teach.integrations.transformers import register

    name = register()
    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    ids = torch.randint(0, 1000, (2, args.prompt_len), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :100] = 0  # left padding of the second prompt
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    for impl in ("sdpa", name, "sdpa", name):
        cfg._attn_implementation = impl
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            start = time.perf_counter()
            model(ids, attention_mask=attention_mask)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(
                ids,
                attention_mask=attention_mask,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
            )
            generate = time.perf_counter() - start
        print(f"{impl:>6}: prefill {1e3 * prefill:5.0f} ms   generate {args.new_tokens} tokens {generate:5.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
