"""``compile_step`` with fp8, bitwise with torchao's eager recipe."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

import amp_fx
from amp_fx.testing import assert_bitwise
from amp_fx.testing.fp8_reference import (
    cpu_autocast_torchao,
    torchao_float8,
    torchao_missing,
)
from tests.fp8._fp8_cases import (
    _recipe,
    mlp,
)

pytestmark = pytest.mark.skipif(torchao_missing() is not None, reason=str(torchao_missing()))


@pytest.mark.parametrize("recipe", [_recipe("tensorwise"), _recipe("rowwise_with_gw_hp")])
def test_compile_step_bitwise_with_torchao(recipe: str) -> None:
    """compile_step(dtype="bf16", fp8=...): 5 AdamW steps (check-only scaler, clipping) bitwise
    with torchao's eager loop (unscale-free bf16 recipe: backward, clip_grad_norm_, step)."""
    model, x = mlp()
    target = torch.randn(2, 16, 16)
    ref = torchao_float8(model, recipe)
    ours = copy.deepcopy(model)
    # fused: compile_step skips an inf/NaN step inside the fused kernel, bitwise torch's eager
    # step (a non-fused optimizer is traced into the graph: tests/step/test_step.py says how close).
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, fused=True)

    def mse(out: Tensor, y: Tensor) -> Tensor:
        return (out.float() - y).pow(2).mean()

    step = amp_fx.compile_step(ours, opt, mse, dtype="bf16", fp8=recipe, backend="aot_eager", max_grad_norm=1.0)
    losses, losses_ref = [], []
    for i in range(5):
        xs = x * (1 + i / 4)
        with cpu_autocast_torchao(), torch.autocast("cpu", torch.bfloat16):
            loss_ref = mse(ref(xs), target)
        loss_ref.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt_ref.step()
        opt_ref.zero_grad()
        losses_ref.append(loss_ref.detach())
        losses.append(step(xs, target))
    assert_bitwise(losses, losses_ref, "losses")
    assert_bitwise(dict(ours.named_parameters()), dict(ref.named_parameters()), "parameters")
