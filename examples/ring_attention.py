"""Ring attention across processes: causal attention over a sequence sharded in the zigzag layout, forward
and backward, checked against the dense oracle on the whole sequence.

Run (CPU, gloo):         torchrun --nproc-per-node 4 examples/ring_attention.py
Run (one GPU per rank):  the same command on a machine with GPUs; NCCL and the Triton kernels are chosen.

Every rank builds the same seeded full tensors (as a data loader would hand each rank its part), keeps only
its shard, and runs :func:`flashattn_teach.distributed.ring_attention`. Rank 0 gathers the shards of the
output and of the gradients and prints their largest error against the dense float64 oracle.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from flashattn_teach import dense_attention
from flashattn_teach.distributed import picture, ring_attention, shard, unshard

LAYOUT = "zigzag"


def gather(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """The full sequence on every rank, from each rank's shard ``t``."""
    shards = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(shards, t.contiguous())
    return unshard([s.cpu() for s in shards], LAYOUT)


def main() -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")  # env:// rendezvous from torchrun
    rank, W = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.float32 if cuda else torch.float64  # the Triton kernels take fp16/bf16/fp32

    B, H_q, H_kv, N, D = 1, 4, 2, 64 * W, 32  # grouped-query attention; N a multiple of 2W for zigzag
    gen = torch.Generator().manual_seed(0)
    q, k, v, dO = (torch.randn(B, H, N, D, generator=gen, dtype=torch.float64) for H in (H_q, H_kv, H_kv, H_q))

    # (B, H, N, D) -> (B, H, N / W, D): this rank's chunks r and 2W-1-r
    q_r, k_r, v_r = (shard(t, W, rank, LAYOUT).to(device, dtype).requires_grad_() for t in (q, k, v))
    O_r = ring_attention(q_r, k_r, v_r, causal=True, layout=LAYOUT)
    O_r.backward(shard(dO, W, rank, LAYOUT).to(device, dtype))
    O, dq, dk, dv = (gather(t, W) for t in (O_r.detach(), q_r.grad, k_r.grad, v_r.grad))

    if rank == 0:
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        O_ref = dense_attention(*ref, causal=True, enable_gqa=True)
        O_ref.backward(dO)
        if W <= 8:
            print(picture(W, LAYOUT), end="\n\n")
        backend = dist.get_backend()
        print(f"ring attention over {W} ranks ({backend}, {LAYOUT}, causal), N = {N}, {str(dtype)[6:]}")
        for name, got, want in (
            ("O", O, O_ref),
            ("dQ", dq, ref[0].grad),
            ("dK", dk, ref[1].grad),
            ("dV", dv, ref[2].grad),
        ):
            print(f"max error {name:<2} {(got.double() - want.detach()).abs().max().item():.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
