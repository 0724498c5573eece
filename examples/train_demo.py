"""Train a small transformer classifier with amp_fx and show what the pass did.

    python examples/train_demo.py [--dtype bf16|fp16] [--backend inductor|aot_eager] [--steps 30]

The task: each example is 16 random numbers, and the label says whether their mean is positive
(2 classes, balanced). The data is synthetic, so the demo needs no download.
The loss is cross-entropy: ln 2 = 0.693 is what a model that guesses 50/50 gets, so a loss below
that, and a batch accuracy above 0.5, mean it is learning.

With ``--dtype fp16`` the demo scales the loss with ``amp_fx.GradScaler``, as fp16 training
must (small fp16 gradients underflow to zero otherwise); bf16 has fp32's range and needs no
scaling. On this project's CPU there are no bf16/fp16 arithmetic units: expect it to be slower
than fp32, not faster; the point is what runs in which dtype.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch
from torch import nn

import amp_fx

_CHANCE_LOSS = math.log(2.0)  # cross-entropy of a 50/50 guess on 2 balanced classes


class TinyTransformer(nn.Module):
    def __init__(self, d_model: int = 32, n_heads: int = 4, n_classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(1, d_model)
        self.block = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.embed(x.unsqueeze(-1)))
        return self.head(self.norm(h).mean(dim=1))


def batch(n: int, seq: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences of ``seq`` numbers; label 1 if their mean is positive."""
    x = torch.randn(n, seq, generator=generator)
    y = (x.mean(1) > 0).long()
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    dtype = amp_fx.policy.resolve_dtype(args.dtype)

    print(
        "task: is the mean of 16 random numbers positive? "
        f"(2 classes; chance: loss ln 2 = {_CHANCE_LOSS:.3f}, accuracy 0.50)"
    )
    torch.manual_seed(0)
    model = TinyTransformer()
    reference = copy.deepcopy(model)
    compiled = amp_fx.compile(model, dtype=dtype, backend=args.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # fp16 needs loss scaling; bf16 does not (enabled=False makes every scaler call a no-op).
    scaler = amp_fx.GradScaler("cpu", enabled=args.dtype == "fp16")
    if scaler.is_enabled():
        print(
            "fp16: the loss is scaled by amp_fx.GradScaler (initial scale 2^16); steps whose "
            "gradients overflow are skipped and the scale backs off"
        )
    gen = torch.Generator().manual_seed(0)

    # One forward+backward against eager torch.autocast on identical weights and data.
    x, y = batch(16, 16, gen)
    # The loss runs outside the compiled model, so take it in fp32 on both sides (as eager
    # autocast would: cross_entropy is on its fp32 list).
    with torch.autocast("cpu", dtype):
        ref_logits = reference(x)
    ref_loss = nn.functional.cross_entropy(ref_logits.float(), y)
    t0 = time.perf_counter()
    loss = nn.functional.cross_entropy(compiled(x).float(), y)
    loss.backward()
    ref_loss.backward()
    compile_s = time.perf_counter() - t0
    grad_diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    print(
        f"against eager autocast: loss {loss.item():.4f} (eager {ref_loss.item():.4f}), "
        f"max |grad - eager grad| = {grad_diff:.3g}, first call incl. compile {compile_s:.1f}s"
    )
    if args.backend == "inductor":
        print(
            "  (inductor keeps fused intermediates in fp32, so it differs from eager autocast by "
            f"about one {args.dtype} rounding; --backend aot_eager is bitwise)"
        )
    opt.zero_grad()

    for step in range(1, args.steps + 1):
        x, y = batch(16, 16, gen)
        loss = nn.functional.cross_entropy(compiled(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step % 10 == 0 or step == args.steps:
            acc = (compiled(x).detach().argmax(-1) == y).float().mean().item()
            scale = f", loss scale {scaler.get_scale():.0f}" if scaler.is_enabled() else ""
            print(
                f"step {step}: loss {loss.item():.4f} (chance {_CHANCE_LOSS:.3f}), "
                f"batch accuracy {acc:.2f} (chance 0.50){scale}"
            )

    print(f"\nWhat amp_fx did ({args.dtype}, backend={args.backend}):")
    print(compiled.amp_fx_summary())
    print("\nParameters stay fp32:", ", ".join(sorted({str(p.dtype) for p in model.parameters()})))


if __name__ == "__main__":
    main()
