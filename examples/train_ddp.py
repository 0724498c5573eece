"""Data-parallel training with amp_fx: DistributedDataParallel + amp_fx.compile + amp_fx.GradScaler.

    torchrun --nproc-per-node 2 examples/train_ddp.py [--dtype fp16|bf16] [--steps 20] [--inf-at 5]
    torchrun --nnodes N --node-rank I --master-addr HOST --nproc-per-node G examples/train_ddp.py

The same script runs on CPUs (gloo) and on GPUs (nccl, one GPU per process): the process group
backend and the device follow from whether CUDA is available. Each rank prints its loss, the
loss scale and how many steps it skipped; with ``--inf-at K`` rank 1's batch at step K holds an
inf, DDP's all-reduce carries it to every rank, and every rank skips that step and backs off the
scale together (the loss printed on rank 1 is then nan or inf).

Synthetic regression data (targets from a fixed random linear map), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import amp_fx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--inf-at", type=int, default=5, help="step whose batch on rank 1 holds an inf (-1: none)")
    parser.add_argument(
        "--compile-backend", default=None, help="torch.compile backend (default: inductor on GPU, aot_eager on CPU)"
    )
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).to(device)
    backend = args.compile_backend or ("inductor" if cuda else "aot_eager")
    # Either order works: DDP(amp_fx.compile(model)) or amp_fx.compile(DDP(model)).
    ddp = DDP(amp_fx.compile(model, dtype=args.dtype, backend=backend))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    scaler = amp_fx.GradScaler(device.type, growth_interval=10)

    target_map = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)).to(device)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for step in range(args.steps):
        x = torch.randn(16, 32, generator=data).to(device)
        y = x @ target_map
        if step == args.inf_at and rank == 1 % world:
            x[0, 0] = float("inf")
        loss = F.mse_loss(ddp(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        # Printing reads the device (a sync): fine for an example, not for a hot loop.
        print(
            f"rank {rank}/{world} step {step:3d} loss {loss.item():9.4f} "
            f"scale {scaler.get_scale():8.0f} skipped {int(scaler.skipped_steps)}\n",
            end="",
            flush=True,
        )  # one write per line: the ranks share the terminal
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
