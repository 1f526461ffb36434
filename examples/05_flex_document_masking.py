"""FlexAttention code with the import changed: document masking and a learned relative-position bias.

Three documents packed into each sequence see only themselves (a ``mask_mod`` over a captured document-id
tensor, causal within a document), and every head adds a learned bias of the distance ``q_idx - kv_idx``
(a ``score_mod`` capturing a parameter). The block mask is classified tile by tile, never as an
``N x N`` matrix; the CPU backends run the functions on each tile and the backward gives the bias its
gradient, which torch's FlexAttention cannot do on a CPU. The script checks the output and the bias
gradient against the dense float64 oracle with the same functions, and the output against torch's own
``flex_attention`` (eager, forward only), then fits a zeroed bias to that output with a few optimiser steps.

Run: ``python examples/05_flex_document_masking.py`` (add ``--n 2048`` for longer sequences).
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

import flashattn_teach as fa


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=384, help="sequence length")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    B, H, N, D = 2, 4, args.n, 32
    # three documents per sequence, of different lengths in each batch element
    cuts = torch.tensor([[N // 4, N // 2], [N // 3, 5 * N // 6]])
    doc = torch.stack([torch.bucketize(torch.arange(N), c, right=True) for c in cuts])  # (B, N) document ids
    bias = torch.nn.Parameter(torch.zeros(H, 2 * N - 1))  # a bias per head and distance q_idx - kv_idx

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + N - 1]

    block_mask = fa.create_block_mask(document_causal, B, None, N, N, device="cpu")
    print(block_mask)
    q, k, v = (torch.randn(B, H, N, D, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        bias.normal_(0.0, 0.5)

    out = fa.flex_attention(q, k, v, score_mod=relative_bias, block_mask=block_mask)
    (grad_bias,) = torch.autograd.grad(out.square().sum(), bias)

    # the same functions on the dense float64 oracle
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    bias64 = bias.detach().double().requires_grad_()

    def relative_bias64(score, b, h, q_idx, kv_idx):
        return score + bias64[h, q_idx - kv_idx + N - 1]

    oracle = fa.dense_attention(q64, k64, v64, score_mod=relative_bias64, mask_mod=document_causal)
    (grad_oracle,) = torch.autograd.grad(oracle.square().sum(), bias64)
    out_err = (out.double() - oracle).abs().max().item()
    grad_err = ((grad_bias.double() - grad_oracle).abs().max() / grad_oracle.abs().max()).item()
    print(f"output: max |ours - float64 oracle| = {out_err:.2e}")
    print(f"bias gradient: max relative error against the oracle = {grad_err:.2e}")

    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # torch warns that eager flex_attention is its unfused fallback
        theirs = torch_flex(
            q.detach(),
            k.detach(),
            v.detach(),
            score_mod=relative_bias,
            block_mask=torch_block_mask(document_causal, B, None, N, N, device="cpu"),
        )
    torch_err = (out - theirs).abs().max().item()
    print(f"output: max |ours - torch.nn.attention.flex_attention| = {torch_err:.2e}")

    # fit the bias to the output another bias gives: the loss falls as the gradient says it should
    target = out.detach()
    q, k, v = q.detach(), k.detach(), v.detach()
    with torch.no_grad():
        bias.zero_()
    optimiser = torch.optim.Adam([bias], lr=0.05)
    losses = []
    for _ in range(8):
        loss = (fa.flex_attention(q, k, v, score_mod=relative_bias, block_mask=block_mask) - target).square().mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    print("loss while training the bias: " + " ".join(f"{x:.4f}" for x in losses))
    ok = out_err < 1e-4 and grad_err < 1e-4 and torch_err < 1e-4 and losses[-1] < 0.5 * losses[0]
    print("check: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
