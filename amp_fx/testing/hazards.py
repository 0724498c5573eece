"""Small models with one planted mixed-precision hazard in one named module, and their healthy
twins (``hazard=False``: the same model without it), for amp_fx.advise's tests, docs and bench.

Each builder returns ``(model, inputs, loss_fn)`` like :mod:`amp_fx.testing.zoo`, with the
module that holds the hazard in :data:`HAZARDS`:

* ``linear_overflow`` (fp16): ``up``'s output reaches ~2e5, above fp16's max 65504, though every
  weight and input fits;
* ``attention_overflow`` (fp16): inside ``attn``, the functional ``q @ k.transpose(-2, -1)`` sums
  32 products of ~100 x ~100 (~3e5): not a leaf module's output;
* ``cancellation`` (bf16): ``shift`` computes ``proj(x) - offset`` where ``proj(x)`` is a signal
  of size ~1 riding on an offset of 1000; bf16's spacing at 1000 is 4, so the signal is lost;
* ``weight_overflow`` (fp16): one entry of ``big.weight`` is 1e5, so its fp16 cast is inf (the
  input it multiplies is ~1e-3, so the fp32 output is ~100);
* ``cancellation_after_module`` (bf16): the cancellation of ``cancellation`` in the root's own
  ``forward``, after ``proj`` returned: ``proj``'s output is as exact as bf16 allows (the offset of
  1000 rides in its bias); the functional ``- offset`` that follows loses the signal. Keeping
  ``proj`` in fp32 fixes it;
* ``overflow_in_block`` (fp16): ``block.fc2``'s output reaches ~2e5 inside ``block`` (fc1, ReLU,
  fc2, dropout), so the dropout after it and ``block`` itself hold the same overflowing value:
  keeping the one Linear ``block.fc2`` suffices;
* ``overflow_then_dropout`` (fp16): ``up``'s output overflows, then passes through the dropout
  ``drop`` (no low-precision op inside: keeping it would change no op);
* ``residual_cancellation`` (bf16): six pre-norm residual blocks (``x + blocks[i](norms[i](x))``)
  and a final norm; ``blocks.4``'s bias adds 1000 to the residual stream, and every LayerNorm after
  it subtracts the mean again, leaving mostly the rounding of ``blocks.4``'s bf16 output. The
  damaged value has five producers (every block before it): keeping ``blocks.4`` alone suffices;
* ``exp_overflow`` (fp16): inside ``block``, a hand-written softplus ``log1p(exp(inp(x)))`` whose
  ``exp`` overflows fp16 (``inp``'s outputs reach ~16, and exp(11.1) is fp16's max): ``block`` is
  where the inf appears, but keeping ``block.inp`` in fp32 is enough (the ``exp`` follows its
  input's dtype).

    >>> model, inputs, loss_fn = build("linear_overflow")
    >>> bool(torch.isfinite(loss_fn(model(*inputs))))
    True
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from amp_fx.testing.zoo import Built

__all__ = ["HAZARDS", "MINIMAL_KEEP", "FP8_HAZARDS", "build"]

HAZARDS = {
    "linear_overflow": ("fp16", "up"),
    "attention_overflow": ("fp16", "attn"),
    "cancellation": ("bf16", "shift"),
    "weight_overflow": ("fp16", "big"),
    "cancellation_after_module": ("bf16", "proj"),
    "overflow_in_block": ("fp16", "block.fc2"),
    "overflow_then_dropout": ("fp16", "up"),
    "exp_overflow": ("fp16", "block"),
    "residual_cancellation": ("bf16", "blocks.4"),
}
"""name -> (dtype, the module holding the hazard)."""

MINIMAL_KEEP = {
    "linear_overflow": ("up",),
    "attention_overflow": ("attn",),
    "cancellation": ("shift.proj",),
    "weight_overflow": ("big",),
    "cancellation_after_module": ("proj",),
    "overflow_in_block": ("block.fc2",),
    "overflow_then_dropout": ("up",),
    "exp_overflow": ("block.inp",),
    "residual_cancellation": ("blocks.4",),
}
"""name -> the smallest keep-list that meets advise's default target: the module whose
low-precision op (a Linear's matmul; for ``attention_overflow`` the functional ``q @ k.T``, which
only ``attn`` itself runs) is at fault, never its parent or a module with no low-precision op."""


FP8_HAZARDS = {
    "fp8_outlier": "up",
    "fp8_mantissa": "diff",
}
"""fp8 hazards (``amp_fx.advise(..., dtype="bf16", fp8=recipe)``, every recipe): name -> the one
module to keep out of fp8, the smallest keep that meets advise's default target. Both are healthy in
bf16 and in fp8 without the hazard (``build(name, hazard=False)``).

* ``fp8_outlier``: one channel of ``up``'s input is 10**6 in every token (a "massive activation",
  which ``up``'s weights ignore); fp8 scales each tensor (tensorwise) or row (rowwise) by its amax,
  so the 10**6 takes the top of e4m3's range and the other channels, order 1, fall below its
  smallest subnormal (2**-9 after scaling) and flush to zero. amp_fx's scales never let a finite
  value saturate (it lands on e4m3's maximum): the range hazard of dynamic scaling is this, the
  other end.
* ``fp8_mantissa``: ``diff``'s input is a signal of order 0.5 on an offset of 32, and its weights
  read differences between features (rows of zero mean, so the offset cancels in the product):
  e4m3's 3 mantissa bits resolve 32 +- 0.5 in steps of about 2.5, bf16's 8 in steps of 0.25."""


def _loss(out: Tensor) -> Tensor:
    return out.float().pow(2).mean()


class LinearOverflow(nn.Module):
    def __init__(self, hazard: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.up = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 4)
        with torch.no_grad():
            # |weights| ~0.06 times 40000 (~2500, fits fp16) over 64 positive inputs of ~0.3:
            # outputs ~1e5, above fp16's 65504
            self.up.weight.abs_().mul_(40000.0 if hazard else 1.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.up(torch.relu(self.fc1(x)))))


class Attention(nn.Module):
    def __init__(self, d: int, hazard: bool) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.scale = 1 / math.sqrt(d)
        with torch.no_grad():
            if hazard:  # q and k ~100 in every entry: their dot product over d=32 is ~3e5
                self.q.bias.fill_(100.0)
                self.k.bias.fill_(100.0)

    def forward(self, x: Tensor) -> Tensor:
        scores = torch.matmul(self.q(x), self.k(x).transpose(-2, -1)) * self.scale
        return self.o(torch.softmax(scores, dim=-1) @ self.v(x))


class AttentionOverflow(nn.Module):
    def __init__(self, hazard: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.attn = Attention(32, hazard)
        self.head = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        return self.head(h + self.attn(h))


class Shift(nn.Module):
    def __init__(self, offset: float) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.register_buffer("offset", torch.full((16,), offset))
        with torch.no_grad():
            self.proj.bias.add_(offset)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x) - self.offset


class Cancellation(nn.Module):
    def __init__(self, hazard: bool) -> None:
        super().__init__()
        self.shift = Shift(1000.0 if hazard else 0.0)
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.shift(x)))


class CancellationAfterModule(nn.Module):
    offset: Tensor

    def __init__(self, hazard: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.register_buffer("offset", torch.full((16,), 1000.0 if hazard else 0.0))
        with torch.no_grad():
            self.proj.bias.add_(self.offset)

    def forward(self, x: Tensor) -> Tensor:
        # proj's bf16 output ~1000 holds the signal to 4 (bf16's spacing at 1000): its relative
        # error is one rounding, but after the subtraction the signal (~1) is mostly rounding
        return self.head(torch.tanh(self.proj(x) - self.offset))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(torch.relu(self.fc1(x))))


class OverflowInBlock(nn.Module):
    def __init__(self, hazard: bool) -> None:
        super().__init__()
        self.block = _Block()
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            # as LinearOverflow's `up`: positive weights x40000 on ~0.3 inputs: ~1e5 > 65504
            self.block.fc2.weight.abs_().mul_(40000.0 if hazard else 1.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.block(x)))


class OverflowThenDropout(nn.Module):
    def __init__(self, hazard: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.up = nn.Linear(64, 64)
        self.drop = nn.Dropout(0.0)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 4)
        with torch.no_grad():
            self.up.weight.abs_().mul_(40000.0 if hazard else 1.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.drop(self.up(torch.relu(self.fc1(x))))))


class _Softplus(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.log1p(torch.exp(self.inp(x))))


class ExpOverflow(nn.Module):
    def __init__(self, hazard: bool) -> None:
        super().__init__()
        self.block = _Softplus()
        self.head = nn.Linear(16, 4)
        with torch.no_grad():  # bias 16: exp(16) ~ 9e6, above fp16's 65504; bias 2: exp ~7, fits
            self.block.inp.bias.fill_(16.0 if hazard else 2.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(x))


class ResidualCancellation(nn.Module):
    def __init__(self, hazard: bool) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(16) for _ in range(6))
        blocks = [nn.Linear(16, 16) for _ in range(6)]
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            blocks[4].bias.add_(1000.0 if hazard else 0.0)

    def forward(self, x: Tensor) -> Tensor:
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(norm(x))
        return self.head(self.norm(x))


class WeightOverflow(nn.Module):
    def __init__(self, hazard: bool) -> None:
        super().__init__()
        self.big = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.big.weight[:, 0] = 1e5 if hazard else 1e3  # 1e5 > 65504; 1e3 fits

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.big(x))


class Fp8Outlier(nn.Module):
    def __init__(self, hazard: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.up = nn.Linear(64, 64)
        self.down = nn.Linear(64, 32)
        spike = torch.zeros(64)
        spike[0] = 1e6 if hazard else 0.0
        self.register_buffer("spike", spike)
        with torch.no_grad():
            self.up.weight[:, 0] = 0.0  # the massive channel carries nothing `up` reads

    def forward(self, x: Tensor) -> Tensor:
        return self.down(torch.relu(self.up(self.inp(x) + self.spike)))


class Fp8Mantissa(nn.Module):
    def __init__(self, hazard: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.diff = nn.Linear(64, 64)
        self.head = nn.Linear(64, 32)
        self.register_buffer("offset", torch.full((64,), 32.0 if hazard else 0.0))
        with torch.no_grad():
            self.diff.weight.sub_(self.diff.weight.mean(dim=1, keepdim=True))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.diff(self.inp(x) + self.offset)))


def build(name: str, *, hazard: bool = True, seed: int = 0) -> Built:
    """The model ``name`` of :data:`HAZARDS` or :data:`FP8_HAZARDS` (or its healthy twin), inputs
    and loss function."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if name == "fp8_outlier":  # 2 x 16 tokens: every GEMM dimension a multiple of 16
        return Fp8Outlier(hazard), (torch.randn(2, 16, 32, generator=gen),), _loss
    if name == "fp8_mantissa":
        return Fp8Mantissa(hazard), (torch.randn(2, 16, 32, generator=gen),), _loss
    if name == "linear_overflow":
        return LinearOverflow(hazard), (torch.randn(4, 16, generator=gen),), _loss
    if name == "attention_overflow":
        return AttentionOverflow(hazard), (torch.randn(2, 6, 8, generator=gen),), _loss
    if name == "cancellation":
        return Cancellation(hazard), (torch.randn(4, 16, generator=gen),), _loss
    if name == "weight_overflow":
        x = torch.randn(4, 16, generator=gen)
        x[:, 0] = 1e-3  # the input the 1e5 weight multiplies: the fp32 product is ~100
        return WeightOverflow(hazard), (x,), _loss
    if name == "cancellation_after_module":
        return CancellationAfterModule(hazard), (torch.randn(4, 16, generator=gen),), _loss
    if name == "overflow_in_block":
        return OverflowInBlock(hazard), (torch.randn(4, 16, generator=gen),), _loss
    if name == "overflow_then_dropout":
        return OverflowThenDropout(hazard), (torch.randn(4, 16, generator=gen),), _loss
    if name == "residual_cancellation":
        return ResidualCancellation(hazard), (torch.randn(4, 16, generator=gen),), _loss
    if name == "exp_overflow":
        return ExpOverflow(hazard), (torch.randn(4, 16, generator=gen),), _loss
    raise ValueError(f"amp_fx.testing.hazards: unknown model {name!r}; known: {sorted(HAZARDS) + sorted(FP8_HAZARDS)}")
