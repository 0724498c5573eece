"""A tiny model for the ``amp-fx`` command.

    amp-fx explain examples/tiny_mlp.py:build --svg tiny_mlp.svg
    amp-fx compare examples/tiny_mlp.py:build --dtype fp16
    amp-fx find-nonfinite examples/tiny_mlp.py:build_overflowing

``build`` is healthy in bf16 and fp16. ``build_overflowing`` scales ``up``'s weights so that its
output exceeds fp16's largest value (65504) while fp32 and bf16 handle it; the LayerNorm after it
brings the values back to about 1, so keeping ``up`` in fp32 fixes the model.
"""

import torch
from torch import nn


class TinyMLP(nn.Module):
    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.up = nn.Linear(d_in, d_hidden)
        self.norm = nn.LayerNorm(d_hidden)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.up(x))))


def build():
    torch.manual_seed(0)
    return TinyMLP(), (torch.randn(4, 8),)


def build_overflowing():
    torch.manual_seed(0)
    model = TinyMLP()
    with torch.no_grad():
        model.up.weight.mul_(1e5)  # |up(x)| reaches ~1e5 > 65504
    return model, (torch.randn(4, 8),)
