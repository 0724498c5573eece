"""What the fp8 tests share: the reference (torchao), the recipes as test parameters, the models.

fp8 training (``fp8=``) against torchao 0.18's float8 training, the reference.

The reference is torchao's ``convert_to_float8_training`` under ``torch.autocast("cpu", bf16)``,
run eagerly on an identical copy of the model in the same test, with one patch: torchao's
``Float8Linear.forward`` reads CUDA's autocast state to decide whether to cast its input, so on
the CPU it would scale the fp32 input where a GPU scales the bf16 one;
``amp_fx.testing.fp8_reference.cpu_autocast_torchao`` points that one branch at the CPU's
autocast state (amp_fx follows torchao's GPU numerics).

The ladder: the kernel alone (eager), then the pass under ``eager`` and ``aot_eager`` (bitwise:
loss, every gradient, 20 AdamW steps), then inductor (error against float64 no worse than torchao
+ ``torch.compile``'s, test_fp8_parity.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import amp_fx
from amp_fx.fp8 import Fp8Config, Fp8Recipe
from amp_fx.kernels.fp8_recipes import RECIPES as KERNEL_RECIPES
from amp_fx.kernels.fp8_support import rowwise_scales_missing
from amp_fx.policy import Policy
from amp_fx.testing.fp8_reference import (
    cpu_autocast_torchao,
    torchao_float8,
)

_NO_ROWWISE = rowwise_scales_missing("cpu")
"""torch 2.11's CPU _scaled_mm takes per-tensor scales only: the rowwise recipes cannot run there
(amp_fx refuses them with a clear error, test_rowwise_without_rowwise_scaled_mm_is_refused)."""


def _recipe(r: Fp8Recipe | str, value: object = None) -> object:
    """A recipe as a test parameter, skipped with the reason where this torch cannot run it."""
    rowwise = KERNEL_RECIPES[Fp8Recipe(r)].rowwise
    return pytest.param(
        r if value is None else value,
        id=Fp8Recipe(r).value,
        marks=pytest.mark.skipif(rowwise and _NO_ROWWISE is not None, reason=str(_NO_ROWWISE)),
    )


def _needs_rowwise() -> None:
    if _NO_ROWWISE is not None:
        pytest.skip(_NO_ROWWISE)


FLOAT8 = [r for r in Fp8Recipe if r not in (Fp8Recipe.MXFP8, Fp8Recipe.BLOCKWISE, Fp8Recipe.NVFP4)]
"""torchao's float8 training recipes, this file's reference (mxfp8: tests/fp8/test_mxfp8.py; blockwise:
tests/fp8/test_blockwise.py; nvfp4: tests/fp8/test_nvfp4.py)."""


RECIPES = [_recipe(r.value) for r in FLOAT8]


INDUCTOR_RECIPES = [_recipe(r.value) for r in FLOAT8 if r is not Fp8Recipe.ROWWISE_WITH_GW_HP]
"""The inductor tests' recipes (an inductor build of both sides is 30-55 s a case here): tensorwise
and rowwise scales; rowwise_with_gw_hp differs from rowwise by its weight gradient's matmul, which
is not fp8 (fewer fp8 constructs for inductor to keep whole): its numerics are the aot_eager
tests'."""


def compile_fp8(
    model: nn.Module,
    recipe: str | Fp8Config | None,
    *,
    backend: str = "aot_eager",
    policy: Policy | None = None,
    strict: bool = True,
    options: dict[str, object] | None = None,
) -> nn.Module:
    """``amp_fx.compile(model, dtype="bf16", fp8=recipe, ...)`` (``options``: inductor's)."""
    extra = {"options": options} if options else {}
    return amp_fx.compile(model, dtype="bf16", fp8=recipe, backend=backend, policy=policy, strict=strict, **extra)


class MLP(nn.Module):
    """Linears with and without bias, 3-D input, every size a multiple of 16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 48, bias=False)
        self.head = nn.Linear(48, 16)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.fc2(nn.functional.gelu(self.fc1(x)))))


def mlp() -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    return MLP(), torch.randn(2, 16, 32)


def loss_fn(out: Tensor) -> Tensor:
    """Autocast-neutral (no op of the CPU autocast table): the same inside and outside autocast."""
    return out.float().pow(2).mean()


def torchao_step(model: nn.Module, x: Tensor, recipe: str) -> tuple[Tensor, dict[str, Tensor | None]]:
    """torchao's loss and gradients on a converted copy of ``model``."""
    ref = torchao_float8(model, recipe)
    with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
        loss = loss_fn(ref(x))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters()}


def amp_step(model: nn.Module, x: Tensor, recipe: str, backend: str) -> tuple[Tensor, dict[str, Tensor | None]]:
    compiled = compile_fp8(model, recipe, backend=backend)
    loss = loss_fn(compiled(x))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def sgd_uncached_and_cached(
    model: nn.Module, steps: list, *, lr: float, **compile_kwargs: object
) -> list[tuple[list[Tensor], dict[str, Tensor]]]:
    """``amp_fx.compile(copy of model, dtype="bf16", weight_cache=False, then True, **compile_kwargs)``,
    each trained with SGD: per optimizer step, ``loss_fn`` and a backward for each of its
    micro-batches, then the update. Per run (uncached first): the losses and the parameters."""
    runs = []
    for cached in (False, True):
        ours = copy.deepcopy(model)
        compiled = amp_fx.compile(ours, dtype="bf16", weight_cache=cached, **compile_kwargs)
        opt = torch.optim.SGD(ours.parameters(), lr=lr)
        losses = []
        for micro_batches in steps:
            for mb in micro_batches:
                loss = loss_fn(compiled(mb))
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        runs.append((losses, dict(ours.named_parameters())))
    return runs


class Odd(nn.Module):
    """fc1's sizes are multiples of 16; ``odd`` has 40 out features (N); ``head`` has 40 in features
    (K); ``experts`` is a 3-D weight used by bmm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 40)
        self.head = nn.Linear(40, 16)
        self.experts = nn.Parameter(torch.randn(4, 16, 16) / 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.head(self.odd(self.fc1(x)))
        return torch.bmm(h.reshape(4, 8, 16), self.experts)


class LeftWeights(nn.Module):
    """Two matmuls whose parameter is the left operand (``W @ x``): fp8 takes the weight on the
    right only, so none of them converts."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(40, 24) / 5)
        self.w2 = nn.Parameter(torch.randn(8, 40) / 6)

    def forward(self, x: Tensor) -> Tensor:
        return (self.w2 @ torch.relu(self.w1 @ x.t())).t()
