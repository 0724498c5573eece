"""Sharded training with amp_fx: FSDP2 (fully_shard) + amp_fx.compile + amp_fx.GradScaler.

    torchrun --nproc-per-node 2 examples/train_fsdp.py [--dtype fp16|bf16] [--steps 20] [--inf-at 5]
                                                         [--compile-step]
    torchrun --nnodes N --node-rank I --master-addr HOST --nproc-per-node G examples/train_fsdp.py

The same script runs on CPUs (gloo) and on GPUs (nccl, one GPU per process). Every layer and the
root are sharded with ``fully_shard``; amp_fx compiles each sharded layer's forward and leaves
FSDP2's all-gather/reduce-scatter hooks to FSDP2. Gradients are DTensor shards, so
``amp_fx.GradScaler`` all-reduces its inf/NaN flag (one collective per step, on the device):
with ``--inf-at K`` an inf is written into one gradient element of rank 0's shard only after
the backward of step K, and every rank still skips that step.

``--param-dtype`` sets FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``: ``same`` gathers the
weights already in the compute dtype (half the all-gather bytes), ``fp32`` keeps them in fp32
and amp_fx casts them for compute. Other combinations are refused by amp_fx.compile.

``--compile-step`` trains with ``amp_fx.compile_step`` instead: forward, backward, and a compiled
finish on each rank's local shards that all-reduces the inf/NaN flag inside the graph (the
planted inf is written by an optimizer step pre-hook, which runs before that finish).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import amp_fx


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--param-dtype", default="fp32", choices=["fp32", "same"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--inf-at", type=int, default=5, help="step after whose backward rank 0's gradient shard gets an inf (-1: none)"
    )
    parser.add_argument(
        "--compile-backend", default=None, help="torch.compile backend (default: inductor on GPU, aot_eager on CPU)"
    )
    parser.add_argument("--compile-step", action="store_true", help="train with amp_fx.compile_step")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    low = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    mp = MixedPrecisionPolicy(param_dtype=low if args.param_dtype == "same" else None, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), Block(64), Block(64), nn.Linear(64, 8)).to(device)
    # Every layer, the first and last Linear included: nn.Sequential's loop over the sharded layers
    # makes Dynamo skip the root's frame, so a layer left to the root would run as eager autocast
    # (amp_fx says so once, naming it; docs/distributed.md).
    for layer in model:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    backend = args.compile_backend or ("inductor" if cuda else "aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = amp_fx.GradScaler(device.type, growth_interval=10, step_mode=amp_fx.StepMode.MASKED)
    at = {"step": -1}

    def plant_inf() -> None:
        if at["step"] == args.inf_at and rank == 0:
            with torch.no_grad():  # one element of rank 0's shard: no other rank holds it
                model[0].weight.grad.to_local().view(-1)[0] = float("inf")

    target_map = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)).to(device)
    if args.compile_step:
        opt.register_step_pre_hook(lambda *_: plant_inf())
        train_step = amp_fx.compile_step(model, opt, F.mse_loss, dtype=args.dtype, backend=backend, scaler=scaler)
    else:
        compiled = amp_fx.compile(model, dtype=args.dtype, backend=backend)

        def train_step(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(compiled(x).float(), target)
            scaler.scale(loss).backward()
            plant_inf()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss

    data = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        at["step"] = step
        x = torch.randn(16, 32, generator=data).to(device)
        loss = train_step(x, x @ target_map)
        print(
            f"rank {rank}/{world} step {step:3d} loss {loss.item():9.4f} "
            f"scale {scaler.get_scale():8.0f} skipped {int(scaler.skipped_steps)}\n",
            end="",
            flush=True,
        )  # one write per line: the ranks share the terminal
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
