"""A decode loop against a preallocated KV cache with ``flashattn_teach.flash_attention_with_kvcache``.

Two prompts of different lengths are prefilled one at a time into a cache of ``--max-len`` slots per batch
element (as a server admits requests), then the batch decodes token by token. Each step writes one new
key and value per element in place at ``cache_seqlens[b]`` and attends the new query over
``[0, cache_seqlens[b] + 1)``; the keys are cut into ``--num-splits`` ranges whose partial results are
merged exactly (split-KV; Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference").
The model is one attention layer with grouped-query heads, random projections and a residual, so each
step's query comes from the previous step's output, as in generation.

Every call is checked against the float64 dense oracle (``flashattn_teach.dense_attention``) over the
element's whole sequence so far, kept apart from the cache; the example fails if the error exceeds the
tolerance of the dtype (float32: 1e-5, float64: 1e-12), and prints torch SDPA's error on the same calls in
the same dtype, what rounding alone gives.

Run: python examples/04_decode_loop.py [--prompt-lens 37,20] [--new-tokens 8] [--num-splits 3]

Prints (a real run of the defaults on a 2-core CPU; long lines wrapped here)::

    explain, the prefill of prompt 0:
      parallel: cpu tensors: query-major tiles, the (batch, head) slices spread over 2 single-threaded workers;
        3 key ranges per batch element over L_b = [37] keys at 1024 x 2048 tiles, merged exactly
    prefill 0: 37 tokens, max |O - dense| 5.9e-07
    prefill 1: 20 tokens, max |O - dense| 3.1e-07
    explain, a decode step:
      parallel: cpu tensors: query-major tiles, the (batch, head) slices spread over 2 single-threaded workers;
        3 key ranges per batch element over L_b = [38, 21] keys at 1024 x 2048 tiles, merged exactly; one new
        query: the G = 4 query heads of each key/value head run as 4 rows of it
    step 0: cache_seqlens [37, 20], max |O - dense| 2.8e-07
    step 1: cache_seqlens [38, 21], max |O - dense| 3.0e-07
    step 2: cache_seqlens [39, 22], max |O - dense| 3.4e-07
    step 3: cache_seqlens [40, 23], max |O - dense| 2.1e-07
    step 4: cache_seqlens [41, 24], max |O - dense| 3.0e-07
    step 5: cache_seqlens [42, 25], max |O - dense| 2.2e-07
    step 6: cache_seqlens [43, 26], max |O - dense| 3.2e-07
    step 7: cache_seqlens [44, 27], max |O - dense| 1.7e-07
    max error over 10 calls: 5.9e-07 (tolerance 1e-05, float32)
    torch SDPA on the same calls, float32: 4.8e-07
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import Tensor

import flashattn_teach as fa

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


def heads(x: Tensor, W: Tensor, H: int) -> Tensor:
    """Project tokens to ``H`` heads: ``(B, N, C) @ (C, H D) -> (B, N, H D) -> (B, H, N, D)``."""
    B, N, _ = x.shape
    return (x @ W).view(B, N, H, -1).transpose(1, 2)


class Layer:
    """One attention layer's weights: ``C = H_q D`` model width, ``H_kv`` key/value heads (GQA)."""

    def __init__(self, H_q: int, H_kv: int, D: int, dtype: torch.dtype, gen: torch.Generator) -> None:
        C = H_q * D
        self.H_q, self.H_kv = H_q, H_kv
        self.W_q, self.W_k, self.W_v = (
            torch.randn(C, H * D, generator=gen, dtype=dtype) / C**0.5 for H in (H_q, H_kv, H_kv)
        )
        self.W_o = torch.randn(C, C, generator=gen, dtype=dtype) / C**0.5

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x (B, N, C)`` -> ``q (B, H_q, N, D)``, ``k, v (B, H_kv, N, D)``."""
        return heads(x, self.W_q, self.H_q), heads(x, self.W_k, self.H_kv), heads(x, self.W_v, self.H_kv)

    def next_token(self, x: Tensor, O: Tensor) -> Tensor:
        """The residual stream after attention: ``x + O W_o``, normalised, ``(B, 1, C)`` from the last row."""
        B = O.shape[0]
        y = O[:, :, -1:].transpose(1, 2).reshape(B, 1, -1) @ self.W_o  # (B, 1, H_q D) @ (C, C) -> (B, 1, C)
        return F.layer_norm(x[:, -1:] + y, (y.shape[-1],))


def oracle_errors(q: Tensor, k_seen: Tensor, v_seen: Tensor, O: Tensor) -> tuple[float, float]:
    """``max |O - dense|`` for one element, ``q (1, H_q, N_new, D)`` over all of its keys (bottom-right
    causal), and the same for torch's SDPA in ``q``'s dtype, the yardstick of what rounding alone gives."""
    want = fa.dense_attention(
        q.double(), k_seen.double(), v_seen.double(), causal=True, causal_align="bottom_right", enable_gqa=True
    )
    N_new, L = q.shape[2], k_seen.shape[2]
    visible = torch.ones(N_new, L, dtype=torch.bool).tril(L - N_new)  # row i sees keys j <= L - N_new + i
    sdpa = F.scaled_dot_product_attention(q, k_seen, v_seen, attn_mask=visible, enable_gqa=True)
    return (O.double() - want).abs().max().item(), (sdpa.double() - want).abs().max().item()


def explain_step(what: str, *args: Tensor, **kwargs: object) -> None:
    """What ``explain_with_kvcache`` says the call with these arguments runs (it writes nothing)."""
    print(f"explain, {what}:")
    print("  " + str(fa.explain_with_kvcache(*args, **kwargs)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-lens", default="37,20", help="prompt lengths, one per batch element")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=64, help="cache slots per batch element (N_max)")
    parser.add_argument("--heads", default="8,2", help="H_q,H_kv")
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--num-splits", type=int, default=3, help="key ranges per step; 0 lets the library pick")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = parser.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    H_q, H_kv = (int(h) for h in args.heads.split(","))
    B, D, N_max = len(prompt_lens), args.head_dim, args.max_len
    if max(prompt_lens) + args.new_tokens > N_max:
        parser.error(f"--max-len {N_max} has no room for {max(prompt_lens)} + {args.new_tokens} tokens")
    gen = torch.Generator().manual_seed(0)
    layer = Layer(H_q, H_kv, D, dtype, gen)
    k_cache = torch.zeros(B, H_kv, N_max, D, dtype=dtype)  # (B, H_kv, N_max, D), filled in place
    v_cache = torch.zeros(B, H_kv, N_max, D, dtype=dtype)
    # The oracle's copy of each element's keys and values, grown by concatenation, never read by the decode.
    k_seen: list[Tensor] = []
    v_seen: list[Tensor] = []
    errors: list[float] = []
    sdpa_errors: list[float] = []

    # Prefill: each prompt alone, at its own length, into its own rows of the cache (cache_seqlens = 0).
    x_next = []
    for b, P in enumerate(prompt_lens):
        x = torch.randn(1, P, H_q * D, generator=gen, dtype=dtype)  # (1, P, C), the prompt's embeddings
        q, k, v = layer.qkv(x)
        if b == 0:
            explain_step(
                "the prefill of prompt 0",
                q,
                k_cache[:1],
                v_cache[:1],
                k,
                v,
                cache_seqlens=0,
                causal=True,
                num_splits=args.num_splits,
            )
        O = fa.flash_attention_with_kvcache(
            q, k_cache[b : b + 1], v_cache[b : b + 1], k, v, cache_seqlens=0, causal=True, num_splits=args.num_splits
        )
        k_seen.append(k)
        v_seen.append(v)
        error, sdpa_error = oracle_errors(q, k, v, O)
        errors.append(error)
        sdpa_errors.append(sdpa_error)
        print(f"prefill {b}: {P} tokens, max |O - dense| {errors[-1]:.1e}")
        x_next.append(layer.next_token(x, O))
    x = torch.cat(x_next)  # (B, 1, C): each element's next input token

    # Decode: the whole batch, one token per step, each element at its own cache length.
    cache_seqlens = torch.tensor(prompt_lens, dtype=torch.int32)
    for step in range(args.new_tokens):
        q, k, v = layer.qkv(x)  # (B, H_q, 1, D), (B, H_kv, 1, D)
        if step == 0:
            explain_step(
                "a decode step",
                q,
                k_cache,
                v_cache,
                k,
                v,
                cache_seqlens=cache_seqlens,
                causal=True,
                num_splits=args.num_splits,
            )
        O = fa.flash_attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, causal=True, num_splits=args.num_splits
        )  # writes k, v at cache_seqlens[b], attends over [0, cache_seqlens[b] + 1)
        for b in range(B):
            k_seen[b] = torch.cat([k_seen[b], k[b : b + 1]], dim=2)
            v_seen[b] = torch.cat([v_seen[b], v[b : b + 1]], dim=2)
        step_errors = [oracle_errors(q[b : b + 1], k_seen[b], v_seen[b], O[b : b + 1]) for b in range(B)]
        errors.append(max(e for e, _ in step_errors))
        sdpa_errors.append(max(e for _, e in step_errors))
        print(f"step {step}: cache_seqlens {cache_seqlens.tolist()}, max |O - dense| {errors[-1]:.1e}")
        cache_seqlens += 1  # flash_attention_with_kvcache leaves it as it was, as flash-attn does
        x = layer.next_token(x, O)

    worst, tol = max(errors), TOLERANCE[dtype]
    print(f"max error over {len(errors)} calls: {worst:.1e} (tolerance {tol:.0e}, {args.dtype})")
    print(f"torch SDPA on the same calls, {args.dtype}: {max(sdpa_errors):.1e}")
    if not worst <= tol:
        raise SystemExit(f"decode differs from the dense oracle by {worst:.1e} > {tol:.0e}")


if __name__ == "__main__":
    main()
