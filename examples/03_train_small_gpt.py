"""Train a small GPT with flashattn_teach as the drop-in for torch's SDPA, next to the same GPT on torch's
SDPA: same initialisation, same batches, and the two loss curves coincide.

The GPT is written out here (token and position embeddings, pre-norm blocks of causal self-attention and an
MLP, a tied output head; after nanoGPT) with the attention function as a parameter: one copy calls
``flashattn_teach.scaled_dot_product_attention(q, k, v, is_causal=True)``, the other
``torch.nn.functional.scaled_dot_product_attention`` with the same arguments. The corpus is made up on the
spot, lines of two-digit sums such as ``37+45=82`` (nothing is downloaded; the operands are random, so only
the format and the sums can be learnt). Each step draws a batch of windows of a random length between
``--block // 2`` and ``--block``, and both models train on it with AdamW, without dropout (so that the two
runs differ by rounding only).

Two runs that differ only in rounding drift apart, since training is chaotic: in float32 the losses of a
step agree to 1e-7 at first, and the gap grows about tenfold every 50 steps (to a few 1e-2 by step 300). So
the check is on the mean loss over each ``--every`` steps: the two means must agree within ``TOLERANCE``,
relative (float32: 3e-2, where the default run below reaches 2e-3, and 8e-3 to 1.1e-2 compiled, as
inductor's threaded reductions round differently from run to run; float64: 1e-6, where it reaches 3e-11).
A real difference is far beyond that: the same run with flashattn_teach called without the causal mask gave
mean losses 1.2e-2, 8e-2 and 1.4e-1 apart (relative) over the first three windows. Much longer float32 runs
end up as far apart as two runs from different seeds; ``--dtype float64`` keeps the strict comparison.

With ``--compile`` the flashattn_teach model runs under ``torch.compile(dynamic=True)``; each attention
call is one custom op in the graph, so every sequence length shares one graph, and the example prints
dynamo's graph count.

Run: python examples/03_train_small_gpt.py [--steps 300] [--compile]

Prints (a real run of the defaults on a 2-core CPU, 2.6 CPU-minutes)::

    GPT: 2 layers, 4 heads, width 64, 102976 parameters, float32
    explain, each attention call at the longest length: q, k, v (8, 4, 32, 16), is_causal=True
      parallel: cpu tensors: query-major tiles, the (batch, head) slices spread over 2 single-threaded workers
    uniform guess: loss 2.5649
    mean loss over each 25 steps, and their relative difference (tolerance 3e-02):
      step  flashattn_teach  torch SDPA  relative difference  largest difference in a step
        25         2.372875    2.372875              3.6e-08                       7.2e-07
        50         2.129211    2.129211              9.6e-08                       9.8e-06
        75         1.952365    1.952371              3.0e-06                       2.8e-05
       100         1.845856    1.845864              4.2e-06                       9.4e-05
       125         1.790287    1.790274              7.7e-06                       3.4e-04
       150         1.750164    1.750152              7.0e-06                       4.1e-04
       175         1.683882    1.683891              5.2e-06                       1.1e-03
       200         1.668444    1.667850              3.6e-04                       1.7e-03
       225         1.668023    1.667755              1.6e-04                       1.7e-02
       250         1.659951    1.658723              7.4e-04                       2.1e-02
       275         1.644232    1.647462              2.0e-03                       2.4e-02
       300         1.653453    1.653405              2.9e-05                       5.4e-02
    largest relative difference: 2.0e-03 (tolerance 3e-02, float32)
    17 sequence lengths from 16 to 32

With ``--compile`` (inductor, 1.2 CPU-minutes with a warm compile cache) a run ends::

       250         1.651498    1.658723              4.4e-03                       3.4e-02
       275         1.643087    1.647462              2.7e-03                       3.4e-02
       300         1.670997    1.653405              1.1e-02                       6.6e-02
    largest relative difference: 1.1e-02 (tolerance 3e-02, float32)
    torch.compile(dynamic=True, backend='inductor'): 1 graph(s) for 17 sequence lengths from 16 to 32
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import flashattn_teach as fa

Attention = Callable[..., Tensor]
VOCAB = "0123456789+=\n"
TOLERANCE = {torch.float32: 3e-2, torch.float64: 1e-6}  # relative difference of the mean losses


@dataclass(frozen=True)
class GPTConfig:
    block: int  # longest sequence (positions embedded)
    layers: int
    heads: int
    width: int  # C = heads x D


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, attention: Attention) -> None:
        super().__init__()
        self.heads, self.attention = cfg.heads, attention
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = (
            t.view(B, N, self.heads, C // self.heads).transpose(1, 2)  # (B, N, C) -> (B, H, N, D)
            for t in self.qkv(x).split(C, dim=2)  # (B, N, C) @ (C, 3C) -> (B, N, 3C) -> 3 x (B, N, C)
        )
        O = self.attention(q, k, v, is_causal=True)  # (B, H, N, D)
        return self.proj(O.transpose(1, 2).reshape(B, N, C))  # (B, H, N, D) -> (B, N, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, attention: Attention) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg, attention)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, attention: Attention) -> None:
        super().__init__()
        self.tok = nn.Embedding(len(VOCAB), cfg.width)
        self.pos = nn.Embedding(cfg.block, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg, attention) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases (torch's N(0, 1) embeddings would give the
        tied head logits of size sqrt(C))."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        """``idx, targets (B, N)`` token ids -> the mean next-token cross-entropy."""
        N = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(N, device=idx.device))  # (B, N, C) + (N, C)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.tok.weight.T  # tied head: (B, N, C) @ (C, V) -> (B, N, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def corpus(lines: int, gen: torch.Generator) -> Tensor:
    """``lines`` random two-digit sums, ``a+b=c``, one per line, as token ids ``(T,)``."""
    a, b = torch.randint(0, 100, (2, lines), generator=gen).tolist()
    text = "".join(f"{x}+{y}={x + y}\n" for x, y in zip(a, b, strict=True))
    return torch.tensor([VOCAB.index(c) for c in text])


def batch(data: Tensor, size: int, block: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """``size`` windows of one random length ``N`` in ``[block // 2, block]``: inputs and next tokens
    ``(size, N)``."""
    N = int(torch.randint(block // 2, block + 1, (), generator=gen))
    starts = torch.randint(0, len(data) - N - 1, (size,), generator=gen)
    window = torch.stack([data[s : s + N + 1] for s in starts.tolist()])  # (size, N + 1)
    return window[:, :-1], window[:, 1:]


def train_step(model: nn.Module, optim: torch.optim.Optimizer, x: Tensor, y: Tensor) -> float:
    """One AdamW step on the batch ``x, y``; the loss before it."""
    loss = model(x, y)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()
    return loss.item()


def explain_call(cfg: GPTConfig, batch_size: int, dtype: torch.dtype) -> None:
    """What explain says about each attention call of a longest batch."""
    q = torch.randn(batch_size, cfg.heads, cfg.block, cfg.width // cfg.heads, dtype=dtype)
    print(f"explain, each attention call at the longest length: q, k, v {tuple(q.shape)}, is_causal=True")
    print("  " + str(fa.explain(q, q, q, is_causal=True)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25, help="print the losses every this many steps")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=32, help="longest sequence")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--compile", action="store_true", help="torch.compile(dynamic=True) the flashattn_teach model")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (with --compile)")
    args = parser.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    cfg = GPTConfig(block=args.block, layers=args.layers, heads=args.heads, width=args.width)
    torch.manual_seed(0)
    teach = GPT(cfg, fa.scaled_dot_product_attention).to(dtype)
    sdpa = GPT(cfg, F.scaled_dot_product_attention).to(dtype)
    sdpa.load_state_dict(teach.state_dict())  # the same initialisation
    n_params = sum(p.numel() for p in teach.parameters())
    print(f"GPT: {cfg.layers} layers, {cfg.heads} heads, width {cfg.width}, {n_params} parameters, {args.dtype}")
    explain_call(cfg, args.batch, dtype)

    teach_step = teach
    if args.compile:
        torch._dynamo.reset()
        teach_step = torch.compile(teach, dynamic=True, backend=args.backend)
    optims = [torch.optim.AdamW(m.parameters(), lr=args.lr) for m in (teach, sdpa)]
    gen = torch.Generator().manual_seed(1)
    data = corpus(4000, gen)
    tol = TOLERANCE[dtype]
    print(f"uniform guess: loss {math.log(len(VOCAB)):.4f}")
    print(f"mean loss over each {args.every} steps, and their relative difference (tolerance {tol:.0e}):")
    print("  step  flashattn_teach  torch SDPA  relative difference  largest difference in a step")
    window: list[tuple[float, float]] = []
    lengths: set[int] = set()
    worst = 0.0
    for step in range(1, args.steps + 1):
        x, y = batch(data, args.batch, cfg.block, gen)  # one batch, both models
        lengths.add(x.shape[1])
        window.append((train_step(teach_step, optims[0], x, y), train_step(sdpa, optims[1], x, y)))
        if step % args.every == 0 or step == args.steps:
            mean_teach, mean_sdpa = (sum(w) / len(window) for w in zip(*window, strict=True))
            relative = abs(mean_teach - mean_sdpa) / mean_sdpa
            largest = max(abs(a - b) for a, b in window)
            worst = max(worst, relative)
            print(f"{step:6d}  {mean_teach:15.6f}  {mean_sdpa:10.6f}  {relative:19.1e}  {largest:28.1e}")
            window.clear()

    print(f"largest relative difference: {worst:.1e} (tolerance {tol:.0e}, {args.dtype})")
    shapes = f"{len(lengths)} sequence lengths from {min(lengths)} to {max(lengths)}"
    if args.compile:
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        print(f"torch.compile(dynamic=True, backend={args.backend!r}): {graphs} graph(s) for {shapes}")
    else:
        print(shapes)
    if not worst <= tol:
        raise SystemExit(f"the mean losses differ by {worst:.1e} > {tol:.0e} (relative)")


if __name__ == "__main__":
    main()
